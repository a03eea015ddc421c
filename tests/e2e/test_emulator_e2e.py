"""Link emulator: real gloo timing of the emulated collectives on 2 ranks."""

import time

import pytest
import torch
from helpers.emulation import DILATION as D

from megatron_oases.launch import run_distributed

N = 1 << 20
TOL = 0.10


def _spin(seconds):
    """CPU-busy 'compute' of a known duration."""
    end = time.perf_counter() + seconds
    x = 0
    while time.perf_counter() < end:
        x += 1
    return x


def _timed(fn, reps=2):
    """Best of ``reps`` wall times of ``fn``, ranks aligned by a barrier before each.

    The emulator only ever adds time; the best of two filters out a rank being descheduled on a
    busy machine (the check is still two-sided: too fast fails as well as too slow).
    """
    import torch.distributed as dist

    best = float("inf")
    for _ in range(reps):
        dist.barrier()
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def _emulated_ranks():
    """Runs on 2 gloo ranks: every op's duration against its model, async overlap, errors."""
    import torch.distributed as dist

    from megatron_oases import platform
    from megatron_oases.patches import Patch
    from megatron_oases.testbed.collectives import EmulationError
    from megatron_oases.testbed.emulator import EmulatorPatch, make_emulator

    rank = dist.get_rank()
    emu = make_emulator("rtx3090-pcie", dilation=D)
    prof = emu.profile
    out = {}
    originals = {n: getattr(dist, n) for n in ("all_reduce", "isend", "P2POp")}
    patch = EmulatorPatch(emu)
    patch.install()
    try:
        x = torch.full((N,), float(rank + 1))
        dist.all_reduce(x)  # warm up gloo
        t_ar = D * prof.all_reduce_time(2 * N, [0, 1])
        out["values_ok"] = bool((x == 3.0).all())
        out["sync"] = (_timed(lambda: dist.all_reduce(x)), t_ar)

        def overlapped(compute):
            w = dist.all_reduce(x, async_op=True)
            _spin(compute)
            w.wait()

        out["overlap_equal"] = (_timed(lambda: overlapped(t_ar)), t_ar)
        out["overlap_longer_compute"] = (_timed(lambda: overlapped(1.5 * t_ar)), 1.5 * t_ar)

        def two_async():
            w1 = dist.all_reduce(x, async_op=True)
            w2 = dist.all_reduce(x, async_op=True)
            w1.wait()
            w2.wait()

        out["serialized"] = (_timed(two_async), 2 * t_ar)

        # Megatron-Core's own call sites: forward all-reduce and the import-time all-gather alias.
        from megatron.core import parallel_state
        from megatron.core.tensor_parallel import mappings

        platform.install_cpu_shims()
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=2)
        y = torch.ones(N)
        out["megatron_reduce"] = (
            _timed(lambda: mappings.reduce_from_tensor_model_parallel_region(y)),
            t_ar,
        )
        gathered = torch.empty(2 * N)
        t_ag = D * prof.all_gather_time(2 * 2 * N, [0, 1])
        out["megatron_all_gather"] = (
            _timed(lambda: mappings.dist_all_gather_func(gathered, y)),
            t_ag,
        )
        scattered = torch.empty(N // 2)
        t_rs = D * prof.reduce_scatter_time(2 * N, [0, 1])
        out["reduce_scatter"] = (_timed(lambda: dist.reduce_scatter_tensor(scattered, y)), t_rs)
        link = prof.link_for([0, 1])
        t_bc = D * (2 * N / (link.bandwidth_gbs * 1e9) + link.latency_us * 1e-6)
        out["broadcast"] = (_timed(lambda: dist.broadcast(y, src=0)), t_bc)

        # Pipeline p2p the way p2p_communication.py issues it.
        t_p2p = D * prof.p2p_time(2 * N, 0, 1)
        buf = torch.zeros(N)
        z = torch.full((N,), 7.0)
        peer = 1 - rank

        def batch():
            op = dist.P2POp(dist.isend, z, peer) if rank == 0 else dist.P2POp(dist.irecv, buf, peer)
            for w in dist.batch_isend_irecv([op]):
                w.wait()

        out["batch_isend_irecv"] = (_timed(batch), t_p2p)

        def plain():
            w = dist.isend(z, peer) if rank == 0 else dist.irecv(buf, peer)
            w.wait()

        out["isend_irecv"] = (_timed(plain), t_p2p)
        out["p2p_values_ok"] = rank == 0 or bool((buf == 7.0).all())

        # A single-rank group costs nothing.
        groups = [dist.new_group([r]) for r in range(2)]
        out["own_group"] = (_timed(lambda: dist.all_reduce(y, group=groups[rank])), 0.0)

        # A tracer-like wrapper installed on top sees the emulated completion through Work.wait.
        seen = {}
        inner = dist.all_reduce

        def traced(*a, **k):
            seen["issue"] = time.perf_counter()
            w = inner(*a, **k)
            if w is not None:
                w.wait()
            seen["done"] = time.perf_counter()
            return None

        tracer = Patch("tracer-like", [(dist, "all_reduce", traced)])
        tracer.install()
        stacked = []
        try:
            for _ in range(2):
                dist.barrier()
                dist.all_reduce(x, async_op=True)
                stacked.append(seen["done"] - seen["issue"])
        finally:
            tracer.uninstall()
        out["stacked"] = (min(stacked), t_ar)

        try:
            dist.all_to_all_single(torch.zeros(2), torch.zeros(2))
            out["unsupported"] = None
        except EmulationError as exc:
            out["unsupported"] = str(exc)
        parallel_state.destroy_model_parallel()
        out["usage"] = emu.usage()
    finally:
        patch.uninstall()
    out["restored"] = all(getattr(dist, n) is f for n, f in originals.items())
    out["records"] = len(emu.records)
    return out


@pytest.mark.timeout(120)
def test_emulated_collectives_on_two_ranks():
    results = run_distributed(_emulated_ranks, 2, timeout=110)
    for rank, out in enumerate(results):
        assert out["values_ok"] and out["p2p_values_ok"] and out["restored"], (rank, out)
        timed = [
            "sync",
            "megatron_reduce",
            "megatron_all_gather",
            "reduce_scatter",
            "broadcast",
            "batch_isend_irecv",
            "isend_irecv",
            "stacked",
        ]
        for key in timed:
            got, model = out[key]
            assert abs(got - model) <= TOL * model, (rank, key, got, model)
        # Async overlap hides the transfer: compute of the same length => ~max, not the sum.
        got, model = out["overlap_equal"]
        assert got <= (1 + TOL) * model, (rank, got, model)
        got, model = out["overlap_longer_compute"]
        assert got <= (1 + TOL) * model, (rank, got, model)
        # One channel per group: two async all-reduces take twice as long.
        got, model = out["serialized"]
        assert abs(got - model) <= TOL * model, (rank, got, model)
        assert out["own_group"][0] < 0.02
        assert "all_to_all_single is not supported under --emulate-link rtx3090-pcie" in (
            out["unsupported"] or ""
        )
        assert out["records"] >= 10
        u = out["usage"]  # the blocked time covers at least the timed ops above
        assert u["ops"] == out["records"] and u["blocked_s"] >= 2 * (1 - TOL) * out["sync"][1] * 6
        assert 0.0 < u["cpu_share"] <= 1.0 and u["blocked_s"] < u["wall_s"]
