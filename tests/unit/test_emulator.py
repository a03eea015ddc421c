"""Link emulator: model, channel serialization, calibration cache, dilation. Real gloo timing on 2
ranks: ``tests/e2e/test_emulator_e2e.py``."""

import argparse

import pytest
import torch
from helpers.emulation import DILATION as D

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
        make_patch(argparse.Namespace(emulate_link="dgx-9000"))
    msg = str(exc.value)
    assert "dgx-9000" in msg and "rtx3090-pcie" in msg and "h100-nvlink" in msg
    assert make_patch(argparse.Namespace(emulate_link=None)) is None


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


def test_dilation_from_host_rate(monkeypatch):
    monkeypatch.delenv("OASES_EMULATE_DILATION", raising=False)
    monkeypatch.setenv("OASES_HOST_FLOPS", "1e11")
    d, info = resolve_dilation(load_cluster("rtx3090-pcie"))
    assert d == pytest.approx(42e12 / 1e11) and info["source"] == "OASES_HOST_FLOPS"
    monkeypatch.setenv("OASES_EMULATE_DILATION", "123")
    assert resolve_dilation(load_cluster("rtx3090-pcie"))[0] == 123.0


def test_oversubscribed_host_scales_the_per_rank_rate():
    """More ranks x threads than CPUs: each rank's emulated GPU is slower, so D grows with it."""
    from megatron_oases.testbed.calibrate import oversubscription_share

    assert oversubscription_share(2, 1, cpus=2) == 1.0
    assert oversubscription_share(1, 1, cpus=2) == 1.0
    assert oversubscription_share(4, 1, cpus=2) == 0.5
    assert oversubscription_share(2, 2, cpus=2) == 0.5
