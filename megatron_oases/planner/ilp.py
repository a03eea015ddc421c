"""The ILP of eq. (5)–(6) in PuLP/CBC, with linearised edge terms (after Alpa, §"intra-op ILP").

Variables: one-hot ``s[l][k]`` (binary) per layer; for each adjacent pair of layers an edge matrix
``e[l][i][j] ≥ 0`` with row sums ``s[l][i]`` and column sums ``s[l+1][j]`` — with binary ``s`` this
forces ``e = s_l s_{l+1}^T``, so the quadratic ``s_l^T R s_{l+1}`` of eq. (5) becomes the linear
``Σ R_ij e_ij``. The pairwise matrix holds eq. (4)'s re-shard costs together with the cross-layer
``max`` terms of eq. (3) (both depend on the two layers' degrees only); the within-layer terms are the
unary costs. Memory, eq. (6): ``Σ A s + r ≤ budget − fixed`` with ``r ≥ Σ_k R[l][k] s[l][k]`` for
every layer (the runtime peak of the worst layer), in the same integer granules as the DP. Degree
switches: ``Σ_{i≠j} e[l][i][j] ≤ S``. Pins remove variables. The solver status is always checked.

PuLP 2 and 3 (setup.py pins < 3; 3.3 also runs warning-free) through API neither deprecates:
``COIN_CMD`` (PuLP 3 warns that ``PULP_CBC_CMD`` goes in 4.0) and ``prob.add_variable`` where it
exists (PuLP 3 warns on direct ``LpVariable(...)``; PuLP 2 has nothing else).
"""

import os
import time

import numpy as np
import pulp

from ..errors import OasesConfigError
from .common import Solution
from .time_model import decompose, objective

DEFAULT_TIME_LIMIT_S = 60


def _variable(prob, name, low=None, cat="Continuous"):
    """A variable of ``prob``: ``prob.add_variable`` (PuLP >= 3), ``LpVariable`` on PuLP 2."""
    if hasattr(prob, "add_variable"):
        return prob.add_variable(name, lowBound=low, cat=cat)
    return pulp.LpVariable(name, lowBound=low, cat=cat)


def cbc_solver(msg=False, time_limit_s=DEFAULT_TIME_LIMIT_S):
    """CBC through ``COIN_CMD``, on the binary PuLP < 4 bundles (a class attribute of its
    ``PULP_CBC_CMD``; reading it constructs nothing, so nothing warns), else PuLP's own default
    (the ``cbcbox`` wheel, or ``cbc`` on PATH). Exact: single thread, zero gap."""
    bundled = getattr(getattr(pulp, "PULP_CBC_CMD", None), "pulp_cbc_path", None)
    path = bundled if bundled and os.access(bundled, os.X_OK) else None
    solver = pulp.COIN_CMD(
        path=path, msg=msg, timeLimit=time_limit_s, threads=1, gapRel=0, gapAbs=0
    )
    if not solver.available():
        raise OasesConfigError(
            f"the ILP planner needs the CBC solver and PuLP {pulp.__version__} has none here: "
            "pip install 'pulp>=2.7,<3' (bundles CBC), or put cbc on PATH, or use --solver dp"
        )
    return solver


def solve_ilp(problem, decomposition=None, time_limit_s=DEFAULT_TIME_LIMIT_S, msg=False):
    t0 = time.perf_counter()
    U, P = decomposition or decompose(problem)
    L, K = U.shape
    allowed = problem.allowed
    A, R, fixed, budget = problem.quantized()
    info = {"time_limit_s": time_limit_s, "memory_granule_bytes": problem.granule}

    def done(status, ks=None):
        dt = time.perf_counter() - t0
        if ks is None:
            return Solution("ilp", status, solve_time_s=dt, info=info)
        return Solution("ilp", status, ks, objective(U, P, ks), dt, info)

    if not allowed.any(axis=1).all():
        return done("infeasible")
    # scale seconds so the largest coefficient is ~1e6: CBC's absolute tolerances stay far below
    # the differences between plans.
    mags = [np.abs(U).max()] + ([np.abs(P).max()] if P.size else [])
    scale = 1e6 / max(max(mags), 1e-30)

    solver = cbc_solver(msg, time_limit_s)  # no CBC: say so before building anything
    prob = pulp.LpProblem("oases_plan", pulp.LpMinimize)
    s = [
        {k: _variable(prob, f"s_{l}_{k}", cat="Binary") for k in range(K) if allowed[l, k]}
        for l in range(L)
    ]
    e = []
    for l in range(L - 1):
        e.append({(i, j): _variable(prob, f"e_{l}_{i}_{j}", low=0) for i in s[l] for j in s[l + 1]})
    terms = [float(U[l, k]) * scale * v for l in range(L) for k, v in s[l].items()]
    terms += [float(P[l, i, j]) * scale * v for l in range(L - 1) for (i, j), v in e[l].items()]
    prob += pulp.lpSum(terms)

    for l in range(L):
        prob += pulp.lpSum(s[l].values()) == 1, f"onehot_{l}"
    for l in range(L - 1):
        for i, v in s[l].items():
            prob += pulp.lpSum(e[l][i, j] for j in s[l + 1]) == v, f"row_{l}_{i}"
        for j, v in s[l + 1].items():
            prob += pulp.lpSum(e[l][i, j] for i in s[l]) == v, f"col_{l}_{j}"

    if budget is not None:
        r = _variable(prob, "runtime_peak", low=0)
        for l in range(L):
            prob += r >= pulp.lpSum(float(R[l, k]) * v for k, v in s[l].items()), f"rt_{l}"
        additive = pulp.lpSum(float(A[l, k]) * v for l in range(L) for k, v in s[l].items())
        prob += additive + r <= float(budget - fixed), "memory"

    S = problem.max_switches
    if S is not None and S < L - 1 and L > 1:
        prob += pulp.lpSum(v for l in range(L - 1) for (i, j), v in e[l].items() if i != j) <= S, (
            "switches"
        )

    prob.solve(solver)
    info["lp_status"] = pulp.LpStatus[prob.status]
    info["solution_status"] = pulp.constants.LpSolution.get(prob.sol_status, str(prob.sol_status))
    if prob.status == pulp.LpStatusInfeasible or prob.sol_status == pulp.LpSolutionInfeasible:
        return done("infeasible")
    if prob.sol_status not in (pulp.LpSolutionOptimal, pulp.LpSolutionIntegerFeasible):
        if prob.status == pulp.LpStatusNotSolved and time.perf_counter() - t0 >= time_limit_s:
            return done("time_limit")
        return done("error")
    ks = []
    for l in range(L):
        vals = {k: (v.varValue or 0.0) for k, v in s[l].items()}
        k = max(vals, key=vals.get)
        if vals[k] < 0.5:
            return done("error")
        ks.append(k)
    if not problem.feasible(ks):  # never trust a solver blindly
        info["violation"] = "solution violates a constraint"
        return done("error")
    return done("optimal" if prob.sol_status == pulp.LpSolutionOptimal else "feasible", ks)
