"""Link emulator: model, channel serialization, calibration cache, dilation. Real gloo timing on 2
ranks: ``tests/e2e/test_emulator_e2e.py``."""

import argparse

import pytest
import torch
from helpers.emulation import DILATION as D

from megatron_oases.config import EmulatedLink, OasesConfig
from megatron_oases.errors import OasesConfigError
from megatron_oases.testbed import calibrate
from megatron_oases.testbed.clusters import load_cluster
from megatron_oases.testbed.emulator import make_patch, resolve_dilation
from megatron_oases.testbed.link_model import LinkEmulator


def test_message_bytes_count_target_dtype():
    emu = LinkEmulator(load_cluster("rtx3090-pcie"), D)
    assert emu.tensor_bytes(torch.zeros(1000)) == 2000  # fp32 on CPU, fp16 on the target
    assert emu.tensor_bytes(torch.zeros(1000, dtype=torch.float64)) == 2000
    assert emu.tensor_bytes(torch.zeros(1000, dtype=torch.int64)) == 8000  # integers as they are


def test_link_is_chosen_by_global_ranks():
    emu = LinkEmulator(load_cluster("rtx3090-nvlink"), D)
    k = 8 << 20
    nvlink = emu.model_seconds("all_reduce", k, [0, 1])
    pcie = emu.model_seconds("all_reduce", k, [1, 2])
    ib = emu.model_seconds("all_reduce", k, [3, 4])
    p = emu.profile
    assert nvlink == pytest.approx(
        2 * (1 / 2) * k / (p.nvlink.bandwidth_gbs * 1e9) + 2 * p.nvlink.latency_us * 1e-6
    )
    assert pcie == pytest.approx(
        k / (p.intra_node.bandwidth_gbs * 1e9) + 2 * p.intra_node.latency_us * 1e-6
    )
    assert nvlink < pcie and ib == pytest.approx(emu.profile.all_reduce_time(k, [3, 4]))
    assert emu.model_seconds("all_reduce", k, [5]) == 0.0


def test_one_channel_per_group_serializes():
    now = [10.0]
    emu = LinkEmulator(load_cluster("rtx3090-pcie"), D, clock=lambda: now[0])
    assert emu.reserve(("coll", (0, 1)), 2.0) == (10.0, 12.0)
    assert emu.reserve(("coll", (0, 1)), 1.0) == (12.0, 13.0)  # queued behind the first
    assert emu.reserve(("coll", (2, 3)), 1.0) == (10.0, 11.0)  # another group: independent
    now[0] = 20.0
    assert emu.reserve(("coll", (0, 1)), 1.0) == (20.0, 21.0)  # channel idle again


def test_unknown_profile_lists_available_ones():
    with pytest.raises(OasesConfigError) as exc:
        make_patch(OasesConfig(emulate_link=EmulatedLink("dgx-9000")))
    msg = str(exc.value)
    assert "dgx-9000" in msg and "rtx3090-pcie" in msg and "h100-nvlink" in msg
    assert make_patch(OasesConfig()) is None


def test_calibration_is_cached_per_host_and_thread_count(tmp_path, monkeypatch):
    monkeypatch.setenv("OASES_CACHE_DIR", str(tmp_path))
    calls = []

    def fake(threads):
        calls.append(threads)
        return 1e11 * threads

    f1, info1 = calibrate.host_flops(1, measure=fake)
    f1b, info1b = calibrate.host_flops(1, measure=fake)
    f2, info2 = calibrate.host_flops(2, measure=fake)
    assert (f1, f1b, f2) == (1e11, 1e11, 2e11) and calls == [1, 2]
    assert not info1["cached"] and info1b["cached"] and info1["key"] != info2["key"]
    assert (tmp_path / "host-flops.json").exists()
    calibrate.host_flops(1, refresh=True, measure=fake)
    assert calls == [1, 2, 1]


def test_a_rate_measured_on_a_busy_host_is_not_cached(tmp_path, monkeypatch):
    """A measurement that got little of its CPU (here: none, it sleeps) would understate the
    host's rate for as long as the cache lives: used once, said why, measured again next time."""
    import time

    monkeypatch.setenv("OASES_CACHE_DIR", str(tmp_path))
    calls = []

    def starved(threads):
        calls.append(threads)
        time.sleep(2 * calibrate.MIN_JUDGED_S)
        return 2e10

    f1, info1 = calibrate.host_flops(1, measure=starved)
    f2, info2 = calibrate.host_flops(1, measure=starved)
    b1, binfo = calibrate.host_memory_bandwidth(1, measure=starved)
    assert (f1, f2, b1) == (2e10, 2e10, 2e10) and calls == [1, 1, 1]
    assert not info2["cached"] and info1["cpu_share"] < calibrate.MIN_CPU_SHARE
    assert "oases calibrate --refresh" in info1["not_cached"] and binfo["not_cached"]
    assert "not cached" in calibrate.rate_source(info1)
    assert not (tmp_path / "host-flops.json").exists()


def test_dilation_from_host_rate(monkeypatch):
    monkeypatch.delenv("OASES_EMULATE_DILATION", raising=False)
    monkeypatch.setenv("OASES_HOST_FLOPS", "1e11")
    monkeypatch.setenv("OASES_HOST_MEM_GBS", "10")
    d, info = resolve_dilation(load_cluster("rtx3090-pcie"))  # no shape: GEMMs only
    assert d == pytest.approx(42e12 / 1e11) and info["source"] == "OASES_HOST_FLOPS"
    assert info["memory_source"] == "OASES_HOST_MEM_GBS"
    monkeypatch.setenv("OASES_EMULATE_DILATION", "123")
    assert resolve_dilation(load_cluster("rtx3090-pcie"))[0] == 123.0


def _megatron_args(**kw):
    a = dict(
        hidden_size=1024,
        num_attention_heads=16,
        num_query_groups=None,
        group_query_attention=False,
        kv_channels=64,
        ffn_hidden_size=4096,
        seq_length=512,
        swiglu=False,
        normalization="LayerNorm",
        add_bias_linear=True,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        attention_backend=None,
        micro_batch_size=4,
        tensor_model_parallel_size=2,
        sequence_parallel=False,
        bf16=False,
        fp16=False,
    )
    a.update(kw)
    return EmulatedLink.from_args("rtx3090-pcie", argparse.Namespace(**a))


def test_dilation_is_per_shape_roofline(monkeypatch):
    """D = host time ÷ target time of one layer of the run's shape (device_model's roofline): the
    host (CPU, fp32, unfused attention) at OASES_HOST_FLOPS / OASES_HOST_MEM_GBS, the target at
    the profile's rates (fp16, fused attention on CUDA)."""
    monkeypatch.delenv("OASES_EMULATE_DILATION", raising=False)
    monkeypatch.setenv("OASES_HOST_FLOPS", "1e11")
    monkeypatch.setenv("OASES_HOST_MEM_GBS", "10")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    prof = load_cluster("rtx3090-pcie")
    d, info = resolve_dilation(prof, _megatron_args())
    # by hand, per sample at TP 2: GEMM FLOPs 24·s·h²/2 + 4·s²·h/2 = 6.979e9; 4 samples
    flops = 4 * (24 * 512 * 1024**2 / 2 + 4 * 512**2 * 1024 / 2)
    sh = 512 * 1024
    # target (p=2, flash I/O): attention 32·s·h + mlp 30·s·h bytes per sample
    target_bytes = 4 * 62 * sh
    # host (p=4, unfused): attention 2·(32 - 4 flash I/O)·s·h + 16 per score over 8·s² scores;
    # mlp 2·30·s·h
    host_bytes = 4 * (56 * sh + 16 * 8 * 512**2 + 60 * sh)
    host_s = flops / 1e11 + host_bytes / 10e9
    target_s = flops / 42e12 + target_bytes / (prof.memory_bandwidth_gbs * 1e9)
    assert d == pytest.approx(host_s / target_s, rel=1e-9)
    assert info["roofline"].target.memory_s == pytest.approx(target_bytes / 796e9)
    # the same shape at another micro-batch: the same D (both times scale with the tokens)
    assert resolve_dilation(prof, _megatron_args(micro_batch_size=32))[0] == pytest.approx(d)
    # a wider layer at the same rates: GEMMs weigh more, so D moves toward the GEMM-only ratio
    wide = resolve_dilation(prof, _megatron_args(hidden_size=4096, ffn_hidden_size=16384))[0]
    assert abs(wide - 420) < abs(d - 420)


def test_compare_and_the_ranks_get_d_from_one_function(monkeypatch):
    """``oases compare`` fixes D before it launches the variants and hands it to their ranks:
    both sides compute it with :func:`resolve_dilation` (the rates of the same threads, the same
    oversubscription), and the value crosses the process boundary exactly (review 11-28: the host
    rates were resolved twice, in compare/cli.py and here)."""
    from megatron_oases.testbed.emulator import DILATION_ENV, dilation_env, emulation_info

    monkeypatch.delenv(DILATION_ENV, raising=False)
    monkeypatch.setenv("OASES_HOST_FLOPS", "1e11")
    monkeypatch.setenv("OASES_HOST_MEM_GBS", "10")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(calibrate, "host_cpus", lambda: 2)
    prof, link = load_cluster("rtx3090-pcie"), _megatron_args()
    emulation = emulation_info(prof, link, processes=4, threads=1)  # 4 ranks on 2 CPUs
    assert emulation["oversubscription_share"] == 0.5
    assert emulation["host_gflops"] == 50.0 and emulation["host_gflops_alone"] == 100.0
    # a launched rank: its local world and threads, the same rates
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    monkeypatch.setattr(torch, "get_num_threads", lambda: 1)
    d, info = resolve_dilation(prof, link)
    assert d == emulation["dilation"] == emulation["roofline_dilation"]
    assert info["roofline"].d == d and info["oversubscription_share"] == 0.5
    # handed over: the rank reads back the same float and computes nothing
    for k, v in dilation_env(d).items():
        monkeypatch.setenv(k, v)
    assert resolve_dilation(prof, link) == (d, {"source": DILATION_ENV, "host_flops": None})
    # a D forced by the user: compare still reports the roofline it replaces
    monkeypatch.setenv(DILATION_ENV, "7.5")
    forced = emulation_info(prof, link, processes=4, threads=1)
    assert forced["dilation"] == 7.5 and forced["host_source"] == DILATION_ENV
    assert forced["roofline_dilation"] == pytest.approx(d)


def test_memory_bandwidth_is_cached_beside_the_flops(tmp_path, monkeypatch):
    monkeypatch.setenv("OASES_CACHE_DIR", str(tmp_path))
    calls = []

    def fake(threads):
        calls.append(threads)
        return 5e9 * threads

    b1, i1 = calibrate.host_memory_bandwidth(1, measure=fake)
    b1b, i1b = calibrate.host_memory_bandwidth(1, measure=fake)
    f1, _ = calibrate.host_flops(1, measure=lambda t: 1e11)
    assert (b1, b1b, f1) == (5e9, 5e9, 1e11) and calls == [1]
    assert not i1["cached"] and i1b["cached"] and i1["key"].endswith("-memory")
    assert calibrate.measure_memory_bandwidth(1, n=1 << 20, reps=2) > 1e8  # a real CPU: > 0.1 GB/s


def test_oversubscribed_host_scales_the_per_rank_rate():
    """More ranks x threads than CPUs: each rank's emulated GPU is slower, so D grows with it."""
    from megatron_oases.testbed.calibrate import oversubscription_share

    assert oversubscription_share(2, 1, cpus=2) == 1.0
    assert oversubscription_share(1, 1, cpus=2) == 1.0
    assert oversubscription_share(4, 1, cpus=2) == 0.5
    assert oversubscription_share(2, 2, cpus=2) == 0.5


class _RealWork:
    """A real ``Work`` as the wrappers see it: ``wait`` recorded, the base methods answered."""

    waited = False

    def wait(self, timeout=None):
        self.waited = True
        return True

    def get_future(self):
        return "real future"

    def source_rank(self):
        return 3


def test_async_handle_is_a_torch_work_that_waits_for_the_real_op():
    """FSDP2's all-gather copy-out waits on its handle only ``if isinstance(work, Work)``: an
    emulated handle that is not one was never waited on and the copy-out read the output before
    gloo wrote it (wrong gradients of the split schedules under FSDP2 and ``--emulate-link``)."""
    import torch.distributed as dist

    now = [10.0]
    emu = LinkEmulator(load_cluster("rtx3090-pcie"), D, clock=lambda: now[0])
    emu._sleep = lambda s: now.__setitem__(0, now[0] + s)
    done, info = emu.issue("all_gather_single", "all_gather", 1 << 20, [0, 1], ("coll", (0, 1)))
    real = _RealWork()
    work = emu.wrap_async(real, done, info)
    assert isinstance(work, dist.Work)
    if isinstance(work, dist.distributed_c10d.Work):  # FSDP2's foreach_all_gather_copy_out
        work.wait()
    assert real.waited and now[0] >= done > 10.0
    assert work.get_future() == "real future" and work.source_rank() == 3


def test_the_tracers_async_handle_is_a_torch_work_too():
    """``--oases-trace`` wraps async handles as well: a ``Work`` subclass, so a caller that waits
    only on ``isinstance(work, Work)`` (FSDP2's copy-out) waits through it and the trace sees it."""
    import torch.distributed as dist

    from megatron_oases.instrument.trace_patch import _TracedWork

    class Tracer:
        seen = []

        def comm_wait(self, rec):
            self.seen.append(("wait", rec))

        def comm_done(self, rec):
            self.seen.append(("done", rec))

    tracer = Tracer()
    real = _RealWork()
    work = _TracedWork(real, tracer, "rec")
    assert isinstance(work, dist.distributed_c10d.Work)
    assert work.wait() and real.waited
    assert tracer.seen == [("wait", "rec"), ("done", "rec")]
    assert work.get_future() == "real future"
