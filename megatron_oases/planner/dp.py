"""Exact dynamic program over the layer chain (the fast path, and the ILP's cross-check).

The objective is a chain: ``Σ_l U[l, k_l] + Σ_l P[l, k_l, k_{l+1}]`` (:func:`time_model.decompose`).
Constraints: allowed degrees per layer (pins), at most ``S`` degree switches, and eq. (6) memory in
integer granules: ``fixed + Σ_l A[l, k_l] + max_l R[l, k_l] ≤ budget``.

The ``max`` term is handled exactly by enumerating its value ``r`` over the distinct ``R`` entries:
for each ``r`` only degrees with ``R ≤ r`` are allowed and the additive budget is ``budget − fixed −
r``; the best over all ``r`` is the optimum (an optimal plan is feasible for ``r`` = its own max).
The additive memory is a DP dimension (granules above the per-layer minimum, so the array only spans
the slack), switches another. Without a memory limit — or when the memory-free optimum already fits —
it is plain Viterbi. Time O(L·K²·(S+1)·Q) per ``r``, numpy-vectorised over (S, Q).
"""

import time

import numpy as np

from ..errors import OasesConfigError
from .common import Solution
from .time_model import decompose, objective

MAX_STATES = 400_000_000  # back-pointer bytes (int8) the DP may allocate


def _chain_dp(U, P, allowed, S, A=None, cap=None):
    """min Σ U + Σ P s.t. allowed, switches ≤ S (None: unlimited), Σ A ≤ cap (A None: no memory).

    Returns (cost, ks) or (inf, None).
    """
    L, K = U.shape
    S1 = 1 if S is None else S + 1
    if A is not None:
        big = np.iinfo(np.int64).max // 4
        Amin = np.where(allowed, A, big).min(axis=1)
        if (Amin >= big).any():
            return np.inf, None
        cap = int(cap - Amin.sum())
        if cap < 0:
            return np.inf, None
        A = A - Amin[:, None]
        Q1 = cap + 1
    else:
        Q1 = 1
    if L * K * S1 * Q1 > MAX_STATES:
        raise OasesConfigError(
            f"the memory DP would need {L * K * S1 * Q1 / 1e6:.0f} M states; raise --granule-mb, "
            "lower --max-switches, or use --solver ilp"
        )
    inf = np.inf
    V = np.full((K, S1, Q1), inf)
    for k in range(K):
        if allowed[0, k]:
            q = 0 if A is None else A[0, k]
            if q < Q1:
                V[k, 0, q] = U[0, k]
    back = np.zeros((L, K, S1, Q1), dtype=np.int8)
    for l in range(1, L):
        new = np.full((K, S1, Q1), inf)
        for kp in range(K):
            if not allowed[l, kp]:
                continue
            a = 0 if A is None else int(A[l, kp])
            if a >= Q1:
                continue
            cand = V + P[l - 1, :, kp][:, None, None]
            if S is None:
                arg = cand.argmin(axis=0)
                best = cand.min(axis=0)  # the value at arg (take_along_axis, slower)
            else:
                best = cand[kp].copy()
                arg = np.full((S1, Q1), kp, dtype=np.int64)
                if K > 1 and S1 > 1:
                    other = cand.copy()
                    other[kp] = inf
                    oarg = other.argmin(axis=0)
                    obest = other.min(axis=0)
                    better = obest[:-1] < best[1:]
                    best[1:] = np.where(better, obest[:-1], best[1:])
                    arg[1:] = np.where(better, oarg[:-1], arg[1:])
            if a:
                new[kp, :, a:] = best[:, : Q1 - a] + U[l, kp]
                back[l, kp, :, a:] = arg[:, : Q1 - a]
            else:
                new[kp] = best + U[l, kp]
                back[l, kp] = arg
        V = new
    flat = int(np.argmin(V))
    k, s, q = np.unravel_index(flat, V.shape)
    cost = V[k, s, q]
    if not np.isfinite(cost):
        return inf, None
    ks = [int(k)]
    for l in range(L - 1, 0, -1):
        kprev = int(back[l, k, s, q])
        if A is not None:
            q -= int(A[l, k])
        if S is not None and kprev != k:
            s -= 1
        k = kprev
        ks.append(k)
    ks.reverse()
    return float(cost), ks


def _one_plan(problem):
    """Whether the instance has one plan only: one candidate degree, allowed on every layer (the
    search costs thousands of these; the DP's answer is that plan, if it fits)."""
    return len(problem.degrees) == 1 and bool(problem.allowed.all())


def solve_dp(problem, decomposition=None):
    t0 = time.perf_counter()
    U, P = decomposition or decompose(problem)
    L, K = U.shape
    S = problem.max_switches
    if S is not None and S >= L - 1:
        S = None
    A, R, fixed, budget = problem.quantized()
    allowed = problem.allowed
    info = {"memory_granule_bytes": problem.granule}

    def done(status, ks=None):
        dt = time.perf_counter() - t0
        if ks is None:
            return Solution("dp", status, solve_time_s=dt, info=info)
        return Solution("dp", status, ks, objective(U, P, ks), dt, info)

    if _one_plan(problem):  # (the search's uniform plans)
        ks = [0] * L
        if budget is None or problem.feasible(ks):
            info["path"] = "viterbi"
            return done("optimal", ks)
        info["path"] = "memory-dp"  # (the DP below finds no plan either: the same sum)
        return done("infeasible")
    # fast path: the memory-free optimum, if it fits
    cost, ks = _chain_dp(U, P, allowed, S)
    if ks is None:
        return done("infeasible")
    if budget is None or problem.feasible(ks):
        info["path"] = "viterbi"
        return done("optimal", ks)
    info["path"] = "memory-dp"
    best_cost, best_ks = np.inf, None
    for r in sorted(set(int(x) for x in R[allowed])):
        cap = budget - fixed - r
        if cap < 0:
            break
        allowed_r = allowed & (R <= r)
        cost, ks = _chain_dp(U, P, allowed_r, S, A=A, cap=cap)
        if ks is not None and cost < best_cost - 1e-15:
            best_cost, best_ks = cost, ks
    if best_ks is None:
        return done("infeasible")
    return done("optimal", best_ks)


def min_memory(problem):
    """The smallest peak memory (bytes, before the margin, quantized) over plans that satisfy the
    pins and the switch limit: the answer to "what memory would fit?" when a plan is infeasible."""
    A, R, fixed, _ = problem.quantized()
    L, K = A.shape
    if _one_plan(problem):  # what the DP below sums, exactly
        total = 0.0
        for a in A[:, 0]:
            total += float(a)
        return (fixed + total + int(R[:, 0].max())) * problem.granule
    S = problem.max_switches
    if S is not None and S >= L - 1:
        S = None
    zeros = np.zeros((max(L - 1, 0), K, K))
    best = np.inf
    for r in sorted(set(int(x) for x in R[problem.allowed])):
        allowed_r = problem.allowed & (R <= r)
        if not allowed_r.any(axis=1).all():
            continue
        cost, ks = _chain_dp(A.astype(float), zeros, allowed_r, S)
        if ks is not None:
            best = min(best, fixed + cost + r)
    return None if not np.isfinite(best) else best * problem.granule
