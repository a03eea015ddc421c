"""Unit tests of batch resharding between per-layer TMP degrees, against an unsharded reference.

Four gloo ranks form one TMP domain (T=4, degrees 1, 2, 4). A degree-d group holds batch share
``local // d`` of ``T // d``; resharding is the identity on the full tensor, so every rank's output
must be its share of the full input, and its input gradient its share of the full gradient. The pair
groups are built here from the documented rule (same ``big`` group, same ``local % small``), not by
``LayerDegreeGroups`` (tested on its own in tests/unit/test_groups.py). One run of four ranks serves the
whole file.
"""

import io
import itertools
import multiprocessing as mp
import os
import queue as queue_mod
import socket
import traceback
from datetime import timedelta
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

from megatron_oases.layer_degrees.reshard import reshard

T = 4
DEGREES = (1, 2, 4)
SHAPE = (3, 8, 5)  # [s, b, h]; b divisible by T
TIMEOUT_S = 90


def full_input():
    return torch.arange(torch.Size(SHAPE).numel(), dtype=torch.float32).reshape(SHAPE)


def full_weight():
    return torch.randn(SHAPE, generator=torch.Generator().manual_seed(0))


def share(t, d, local):
    """Degree d's batch share on rank ``local``: the reference layout."""
    return torch.chunk(t, T // d, dim=1)[local // d]


def chain_reference(x):
    """The same elementwise ops as :func:`_chain` without resharding."""
    return (x * x).sin() + x


def _chain(x, groups):
    """A plan's runs 4 → 1 → 2 → 4 with elementwise layers between (as the schedule patch does)."""
    h = reshard(x, 4, 1, groups)
    h = h * h
    h = reshard(h, 1, 2, groups)
    h = h.sin()
    h = reshard(h, 2, 4, groups)
    return h + x


def _pair_groups(rank):
    """Every rank creates every pair group in the same order; keep the ones holding ``rank``."""
    mine = {}
    for small, big in itertools.combinations(DEGREES, 2):
        keys = sorted({(r // big, r % small) for r in range(T)})
        for key in keys:
            ranks = [r for r in range(T) if (r // big, r % small) == key]
            group = dist.new_group(ranks)
            if rank in ranks:
                mine[(small, big)] = (group, ranks)
    return mine


def _worker():
    rank = dist.get_rank()
    pairs = _pair_groups(rank)
    groups = SimpleNamespace(
        domain_size=T, local=rank, pair_group=lambda a, b: pairs[(min(a, b), max(a, b))][0]
    )
    X, W = full_input(), full_weight()
    out = {"pair_ranks": {k: v[1] for k, v in pairs.items()}}
    for a, b in itertools.product(DEGREES, DEGREES):
        x = share(X, a, rank).clone().requires_grad_()
        y = reshard(x, a, b, groups)
        same = y is x
        (y * share(W, b, rank)).sum().backward()
        out[(a, b)] = (y.detach().clone(), x.grad.clone(), same)
    # Non-contiguous input (a transposed [b, s, h] buffer), growing 1 → 4.
    xt = share(X, 1, rank).transpose(0, 1).contiguous().transpose(0, 1).requires_grad_()
    assert not xt.is_contiguous()
    y = reshard(xt, 1, 4, groups)
    (y * W).sum().backward()
    out["noncontiguous"] = (y.detach().clone(), xt.grad.clone())
    x = X.clone().requires_grad_()
    y = _chain(x, groups)
    (y * W).sum().backward()
    out["chain"] = (y.detach().clone(), x.grad.clone())
    return out


def _entry(rank, world, port, fn, q):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    try:
        torch.set_num_threads(1)
        dist.init_process_group(
            "gloo", rank=rank, world_size=world, timeout=timedelta(seconds=TIMEOUT_S)
        )
        buf = io.BytesIO()
        torch.save(fn(), buf)
        q.put((rank, None, buf.getvalue()))
    except BaseException:  # noqa: BLE001 - the parent reports every rank's failure
        q.put((rank, traceback.format_exc(), None))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_ranks(fn, world, timeout=TIMEOUT_S):
    """Run ``fn()`` on ``world`` gloo ranks; per-rank results, or fail on error / hang.

    Forked where the platform allows (the ranks then start with torch already imported: a spawned
    rank spends seconds importing it, which four of them on a busy two-core host multiply).
    """
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("fork" if "fork" in mp.get_all_start_methods() else "spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=_entry, args=(r, world, port, fn, q)) for r in range(world)]
    for p in procs:
        p.start()
    results = {}
    try:
        while len(results) < world:
            try:
                rank, err, payload = q.get(timeout=timeout)
            except queue_mod.Empty:
                pytest.fail(f"ranks hung for {timeout}s (done: {sorted(results)})")
            if err:
                pytest.fail(f"rank {rank} failed:\n{err}")
            results[rank] = torch.load(io.BytesIO(payload), weights_only=False)
    finally:
        for p in procs:
            p.join(timeout=10 if len(results) == world else 1)
            if p.is_alive():
                p.kill()
    return [results[r] for r in range(world)]


@pytest.fixture(scope="module")
def ranks():
    return run_ranks(_worker, T)


def test_pair_groups_follow_the_documented_rule(ranks):
    """The reference groups themselves: (1,2) = neighbours, (2,4) = stride 2, (1,4) = all."""
    assert [r["pair_ranks"][(1, 2)] for r in ranks] == [[0, 1], [0, 1], [2, 3], [2, 3]]
    assert [r["pair_ranks"][(2, 4)] for r in ranks] == [[0, 2], [1, 3], [0, 2], [1, 3]]
    assert [r["pair_ranks"][(1, 4)] for r in ranks] == [[0, 1, 2, 3]] * 4


@pytest.mark.parametrize("a,b", list(itertools.product(DEGREES, DEGREES)), ids=lambda d: str(d))
def test_values_and_grads_match_the_unsharded_reference(ranks, a, b):
    """Output = degree b's share of the full input; input grad = degree a's share of the full
    gradient (shrink gathers gradient slices, grow keeps its slice)."""
    X, W = full_input(), full_weight()
    for local, r in enumerate(ranks):
        y, grad, same = r[(a, b)]
        assert torch.equal(y, share(X, b, local)), (a, b, local)
        assert torch.equal(grad, share(W, a, local)), (a, b, local)
        assert same == (a == b)  # equal degrees: no autograd node, the input itself


def test_non_contiguous_input(ranks):
    X, W = full_input(), full_weight()
    for local, r in enumerate(ranks):
        y, grad = r["noncontiguous"]
        assert torch.equal(y, X)
        assert torch.equal(grad, share(W, 1, local))


def test_plan_chain_matches_unsharded_forward_and_backward(ranks):
    """T → 1 → 2 → T around elementwise layers equals the same ops on the full batch."""
    x = full_input().requires_grad_()
    ref = chain_reference(x)
    (ref * full_weight()).sum().backward()
    for r in ranks:
        y, grad = r["chain"]
        torch.testing.assert_close(y, ref.detach())
        torch.testing.assert_close(grad, x.grad)
