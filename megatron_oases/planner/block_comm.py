"""Seconds of a block's collectives per pass and schedule: one all-reduce, or under sequence
parallelism (SP) all-gathers and reduce-scatters.

Without SP a block ends in one all-reduce of its s·b·h output in forward, backward and (except
``oases``' fine-grained recompute, which starts after it) recompute. Under SP each block gathers its
layernorm output (s/t → s) before the column-parallel GEMM and reduce-scatters after the
row-parallel one; per block (all-gathers, reduce-scatters):

    pass        off    overlap, cross-pass    oases
    forward     1, 1   1, 1                   1, 1
    recompute   1, 1   1, 1                   1, 0  (re-gathers the ln output from the s/t input)
    backward    2, 1   1, 1                   1, 1

(``overlap`` without recompute has no recompute pass;
stock Megatron re-gathers the column input for the weight gradient: its second backward
all-gather). The time model has one communication slot after each block's computation
(:class:`~.problem.Block`); a block's all-gather is costed there with its reduce-scatter. Only the
residual add and the next layernorm separate one block's reduce-scatter from the next block's
all-gather, so on the chain this is the same sum in a slot shifted by that small op.
"""

import numpy as np

from ..formats.profile import tp_ranks

PASSES = ("forward", "recompute", "backward")

#: (all-gathers, reduce-scatters) per block under SP, by pass and schedule
SP_COLLECTIVES = {
    "forward": {"off": (1, 1), "overlap": (1, 1), "cross-pass": (1, 1), "oases": (1, 1)},
    "recompute": {"off": (1, 1), "overlap": (1, 1), "cross-pass": (1, 1), "oases": (1, 0)},
    "backward": {"off": (2, 1), "overlap": (1, 1), "cross-pass": (1, 1), "oases": (1, 1)},
}

#: all-reduces per block without SP
AR_COLLECTIVES = {
    "forward": {"off": 1, "overlap": 1, "cross-pass": 1, "oases": 1},
    "recompute": {"off": 1, "overlap": 1, "cross-pass": 1, "oases": 0},
    "backward": {"off": 1, "overlap": 1, "cross-pass": 1, "oases": 1},
}


def collective_counts(schedule, pass_, sequence_parallel):
    """{collective kind: count} one block issues in ``pass_`` under ``schedule``."""
    if not sequence_parallel:
        return {"all_reduce": AR_COLLECTIVES[pass_][schedule]}
    ag, rs = SP_COLLECTIVES[pass_][schedule]
    return {"all_gather": ag, "reduce_scatter": rs}


def block_comm(profile, degs, sizes, hidden_bytes, schedule, sequence_parallel):
    """{pass: (S, K) array}: seconds of one block's collectives per sub-batch ``s`` and degree
    index ``k``, for ``sizes[d][s]`` samples of ``hidden_bytes`` each (the full s-long tensor)."""
    time_of = {
        "all_reduce": profile.all_reduce_time,
        "all_gather": profile.all_gather_time,
        "reduce_scatter": profile.reduce_scatter_time,
    }
    S = len(sizes[degs[0]])
    out = {}
    for pass_ in PASSES:
        counts = collective_counts(schedule, pass_, sequence_parallel)
        out[pass_] = np.array(
            [
                [
                    sum(
                        c * time_of[kind](tp_ranks(d), sizes[d][s] * hidden_bytes)
                        for kind, c in counts.items()
                        if c
                    )
                    for d in degs
                ]
                for s in range(S)
            ]
        )
    return out
