"""Time model of the Oases paper (§4.2, eq. 3–4): iteration time of a degree assignment.

Each training pass is a chain of blocks (processing order) cut into *segments* at pass barriers; a
block is a computation followed by its all-reduce. For a segment with blocks ``0..k`` and two
sub-batches, eq. (3)::

    T_V = d_0^0 + Σ_{i≥1} max{d_i^0, c_{i-1}^1} + Σ_i max{d_i^1, c_i^0} + c_k^1

with ``d`` the block's compute and ``c`` its communication on that sub-batch. With one sub-batch
(``off``) a block costs ``d + c``.

Re-sharding (eq. 4): when the degree *grows* along a pass's processing order (forward: ``d_l <
d_{l+1}``; backward: ``d_{l+1} < d_l``) a blocking all-gather over ``d_large/d_small`` ranks is
needed for each sub-batch, and the overlap across that boundary is lost: the ``max{d^0, c^1}`` term
becomes ``c^1 + AG + d^0``, i.e. eq. (4)'s ``T_allgather + min{c^1, d^0}`` on top of the max.

Two forms of the same objective live here: :func:`evaluate` walks the chains directly (the
reference, used by brute force and to report), :func:`decompose` rewrites it as unary and pairwise
terms over adjacent layers (what the ILP and the DP optimise); the tests check they agree. What the
chains contain (blocks per schedule, boundaries, per-iteration terms) is :mod:`.build`'s concern.
"""

import numpy as np

#: The version of the planner's cost model (time and memory: this module, build, memory_model,
#: block_comm, the host term's rule): bump it (to the day's date) in the same commit that changes
#: what it computes; the planner's reports record it (tests/unit/test_report_versions.py).
COST_MODEL_VERSION = "2026-12-07.7"


# ====================================================================== evaluation (eq. 3, 4)
def _gather_if_grows(gather, ks, prev_layer, cur_layer):
    """All-gather seconds when the degree grows from ``prev_layer`` to ``cur_layer`` (processing
    order), else None. Degree indices are sorted ascending, so index order is degree order."""
    if prev_layer == cur_layer or ks[cur_layer] <= ks[prev_layer]:
        return None
    b = min(prev_layer, cur_layer)
    return float(gather[b, ks[b], ks[b + 1]])


def _segment_time(segment, ks, subs, gather, out):
    """Walk one segment (eq. 3 with eq. 4 at growing boundaries); accumulate per-layer
    [time, edge time] into ``out``; return (time, edge time)."""
    total = edge_total = 0.0
    last = len(segment) - 1
    for i, blk in enumerate(segment):
        k = ks[blk.layer]
        g = _gather_if_grows(gather, ks, segment[i - 1].layer, blk.layer) if i else None
        if subs == 1:
            t = blk.comp[0, k] + blk.comm[0, k]
            e = g or 0.0
        else:
            e = 0.0
            if i == 0:
                t = blk.comp[0, k]
            else:
                a, c = blk.comp[0, k], segment[i - 1].comm[1, ks[segment[i - 1].layer]]
                t = max(a, c)
                if g is not None:  # blocking all-gather: the overlap across the boundary is lost
                    e = g + min(a, c)
            t += max(blk.comp[1, k], blk.comm[0, k])
            if i == last:
                t += blk.exposed_tail()[k]
        out[blk.layer][0] += t
        out[blk.layer][1] += e
        total += t
        edge_total += e
    return total, edge_total


def evaluate(problem, ks):
    """Per-iteration times for degree indices ``ks`` (one per layer): a dict of seconds and bytes.

    Direct implementation of eq. (3)–(4) walking the chains — independent of the solvers'
    unary/pairwise decomposition (:func:`decompose`), which the tests check against it.
    """
    L = problem.num_layers
    ks = list(ks)
    fwd_layers = [[0.0, 0.0] for _ in range(L)]
    bwd_layers = [[0.0, 0.0] for _ in range(L)]
    fwd = bwd = edges = 0.0
    for passes, gather, acc in (
        (problem.forward, problem.gather_fwd, fwd_layers),
        (problem.backward, problem.gather_bwd, bwd_layers),
    ):
        prev_last = None
        for seg in passes:
            t, e = _segment_time(seg, ks, problem.subs, gather, acc)
            if acc is fwd_layers:
                fwd += t
            else:
                bwd += t
            edges += e
            # A barrier between segments: a degree change across it still needs its gather.
            if prev_last is not None:
                g = _gather_if_grows(gather, ks, prev_last.layer, seg[0].layer)
                if g is not None:
                    acc[seg[0].layer][1] += g
                    edges += g
            prev_last = seg[-1]
    boundary = [float(problem.boundary[l, k]) for l, k in enumerate(ks)]
    edges += sum(boundary)
    shard = [float(problem.sharding[l, k]) for l, k in enumerate(ks)]
    fwd += problem.fixed_forward_s
    bwd += problem.fixed_backward_s
    r = problem.repeats
    sync = [float(problem.grad_sync[l, k]) for l, k in enumerate(ks)]
    grad_sync = sum(sync)
    per_iter = sum(float(problem.per_iteration[l, k]) for l, k in enumerate(ks))
    per_layer = []
    for l in range(L):
        per_layer.append(
            {
                "layer": l,
                "degree": problem.degrees[ks[l]],
                "forward_s": float(r * fwd_layers[l][0]),
                "backward_s": float(r * bwd_layers[l][0]),
                "edges_s": float(r * (fwd_layers[l][1] + bwd_layers[l][1] + boundary[l])),
                "sharding_s": float(r * shard[l]),
                "grad_sync_s": sync[l],
                "replica_sync_s": float(problem.replica_sync[l, ks[l]]),
                "memory_bytes": float(problem.mem_add[l, ks[l]]),
            }
        )
    return {
        "iteration_time_s": float(r * (fwd + bwd + edges + sum(shard)) + per_iter),
        "forward_s": float(r * fwd),
        "backward_s": float(r * bwd),
        "edges_s": float(r * edges),
        "sharding_s": float(r * sum(shard)),
        "grad_sync_s": float(grad_sync),
        "grad_sync_included": problem.include_grad_sync,
        "replica_sync_s": float(sum(problem.replica_sync[l, k] for l, k in enumerate(ks))),
        "peak_memory_bytes": problem.peak_memory_bytes(ks),
        "per_layer": per_layer,
    }


# ====================================================================== decomposition for solvers
def decompose(problem):
    """(U, P): unary (L, K) and pairwise (L-1, K, K) seconds per iteration with
    ``objective(ks) = Σ_l U[l, k_l] + Σ_l P[l, k_l, k_{l+1}]`` equal to ``evaluate``'s iteration time.
    """
    L, K = problem.num_layers, len(problem.degrees)
    U = np.zeros((L, K))
    P = np.zeros((max(L - 1, 0), K, K))
    kk = np.arange(K)

    for passes, gather in (
        (problem.forward, problem.gather_fwd),
        (problem.backward, problem.gather_bwd),
    ):
        prev_last = None
        for seg in passes:
            if prev_last is not None and prev_last.layer != seg[0].layer:
                _add_gather(P, gather, prev_last.layer, seg[0].layer, K)
            for i, blk in enumerate(seg):
                l = blk.layer
                if problem.subs == 1:
                    U[l] += blk.comp[0] + blk.comm[0]
                    if i > 0 and seg[i - 1].layer != l:
                        _add_gather(P, gather, seg[i - 1].layer, l, K)
                    continue
                U[l] += np.maximum(blk.comp[1], blk.comm[0])
                if i == 0:
                    U[l] += blk.comp[0]
                else:
                    prev = seg[i - 1]
                    if prev.layer == l:
                        U[l] += np.maximum(blk.comp[0], prev.comm[1])
                    else:
                        lp = prev.layer
                        # pair term over (k_prev, k_cur) oriented to (k_low_layer, k_high_layer)
                        c = prev.comm[1][:, None]  # indexed by k_prev
                        a = blk.comp[0][None, :]  # indexed by k_cur
                        grow = kk[None, :] > kk[:, None]  # k_cur > k_prev
                        b = min(lp, l)
                        g = gather[b] if lp < l else gather[b].T  # (k_prev, k_cur)
                        term = np.where(grow, c + a + g, np.maximum(a, c))
                        P[b] += term if lp < l else term.T
                if i == len(seg) - 1:
                    U[l] += blk.exposed_tail()
            prev_last = seg[-1]
    U += problem.boundary + problem.sharding
    U[0] += problem.fixed_forward_s + problem.fixed_backward_s  # constant: same for every k
    U *= problem.repeats
    U += problem.per_iteration  # once per iteration, not per micro-batch
    return U, P * problem.repeats


def _add_gather(P, gather, lp, lc, K):
    """Blocking gather (no overlap lost) between layers lp → lc when the degree grows (never
    with one candidate degree: nothing to add)."""
    if K == 1:
        return
    b = min(lp, lc)
    kk = np.arange(K)
    if lp < lc:
        grow = kk[None, :] > kk[:, None]  # (k_b, k_b+1): k_{b+1} > k_b
    else:
        grow = kk[:, None] > kk[None, :]  # processing b+1 → b: grows if k_b > k_{b+1}
    P[b] += np.where(grow, gather[b], 0.0)


def objective(U, P, ks):
    return float(
        sum(U[l, k] for l, k in enumerate(ks))
        + sum(P[l, ks[l], ks[l + 1]] for l in range(len(ks) - 1))
    )
