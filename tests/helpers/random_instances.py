"""Random planning instances (random cost tables) for the solvers' cross-checks (test-only; not in
the package)."""

import numpy as np

from megatron_oases.planner.problem import Block, ChainProblem
from megatron_oases.validation import TAIL_PIECES


def random_problem(
    rng,
    num_layers,
    degrees=(1, 2, 4),
    subs=None,
    backward="random",
    memory="random",
    pins=True,
    switches=True,
    homogeneous=False,
):
    """A :class:`ChainProblem` with random compute/comm/gather/memory tables.

    ``backward``: 'oases' (2 blocks/layer, one segment), 'cross-pass' (4 blocks/layer, one segment),
    'overlap' (two segments per layer), or 'random'. ``memory``: 'random' (a budget between the
    smallest and largest peak, sometimes infeasible), 'none', or 'tight'. ``homogeneous``: every layer
    has the same tables (like a real model).
    """
    L, K = int(num_layers), len(degrees)
    subs = subs or int(rng.choice([1, 2]))
    if backward == "random":
        backward = str(rng.choice(["oases", "cross-pass", "overlap"]))

    def table():
        return rng.uniform(0.0, 1.0, size=(subs, K)) * rng.choice([0.3, 1.0, 3.0])

    cache = {}

    def tbl(l, name):
        key = name if homogeneous else (l, name)
        if key not in cache:
            cache[key] = (table(), table())
        return cache[key]

    def blk(l, name):
        comp, comm = tbl(l, name)
        return Block(l, name, comp, comm)

    forward = [[b for l in range(L) for b in (blk(l, "a.F"), blk(l, "m.F"))]]
    if subs == 2:  # the forward ends on a piece of its last block, as the builder has it
        forward[0][-1].tail = forward[0][-1].comm[1] / TAIL_PIECES
    if backward == "oases":
        back = [[b for l in reversed(range(L)) for b in (blk(l, "m.RB"), blk(l, "a.RB"))]]
    elif backward == "cross-pass":
        back = [
            [
                b
                for l in reversed(range(L))
                for b in (blk(l, "a.R"), blk(l, "m.R"), blk(l, "m.B"), blk(l, "a.B"))
            ]
        ]
    else:
        back = []
        for l in reversed(range(L)):
            back.append([blk(l, "a.R"), blk(l, "m.R")])
            back.append([blk(l, "m.B"), blk(l, "a.B")])
    g = rng.uniform(0.0, 1.0, size=(max(L - 1, 0), K, K))
    if homogeneous and L > 1:
        g[:] = g[0]
    for b in range(max(L - 1, 0)):
        np.fill_diagonal(g[b], 0.0)
    boundary = rng.uniform(0.0, 0.2, size=(L, K))
    mem_add = rng.integers(1, 20, size=(L, K)).astype(float)
    mem_rt = rng.integers(0, 10, size=(L, K)).astype(float)
    if homogeneous:
        mem_add[:] = mem_add[0]
        mem_rt[:] = mem_rt[0]
    fixed = float(rng.integers(0, 10))
    if memory == "none":
        mem = np.inf
    else:
        lo = fixed + mem_add.min(axis=1).sum() + mem_rt.min()
        hi = fixed + mem_add.max(axis=1).sum() + mem_rt.max()
        if memory == "tight":
            mem = float(np.floor(lo + 0.3 * (hi - lo)))
        else:
            mem = float(rng.integers(int(lo) - 2, int(hi) + 2))
    allowed = np.ones((L, K), dtype=bool)
    if pins and rng.random() < 0.3:
        l = int(rng.integers(0, L))
        allowed[l] = False
        allowed[l, int(rng.integers(0, K))] = True
    max_sw = int(rng.integers(0, L)) if switches and rng.random() < 0.4 else None
    return ChainProblem(
        degrees=list(degrees),
        num_layers=L,
        subs=subs,
        forward=forward,
        backward=back,
        gather_fwd=g,
        gather_bwd=rng.permutation(g.ravel()).reshape(g.shape) * 0 + g.transpose(0, 2, 1),
        boundary=boundary,
        repeats=int(rng.integers(1, 4)),
        mem_add=mem_add,
        mem_runtime=mem_rt,
        mem_fixed=fixed,
        memory_bytes=mem,
        margin=0.0,
        granule=1.0,
        allowed=allowed,
        max_switches=max_sw,
        meta={"backward": backward},
    )
