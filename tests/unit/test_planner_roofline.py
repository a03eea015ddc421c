"""Analytic profiles charge each block's roofline time (:mod:`megatron_oases.device_model`: GEMM
FLOPs at the sustained rate plus memory-bound bytes at the memory bandwidth), the same function the
emulators dilate compute with."""

import copy

import pytest

from megatron_oases import device_model
from megatron_oases.profiler import analytic, layer_math
from megatron_oases.profiler.model_config import read_model_file
from megatron_oases.search.search import model_for_search
from megatron_oases.testbed.clusters import load_cluster


@pytest.fixture(scope="module")
def args():
    a = model_for_search(read_model_file("gpt-6.7b"), 64)
    a = copy.copy(a)
    a.tensor_model_parallel_size = 4
    return a


def test_analytic_profiles_use_the_device_models_roofline(args, monkeypatch):
    assert analytic.roofline_time is device_model.roofline_time  # the function, not a copy
    assert analytic.block_work is device_model.block_work
    calls = []
    real = device_model.roofline_time

    def spy(work, rates):
        calls.append((work, rates))
        return real(work, rates)

    monkeypatch.setattr(analytic, "roofline_time", spy)
    prof = analytic.analytic_profile(args, "rtx3090-pcie")
    assert len(calls) == len(layer_math.BLOCKS) * len(prof["degrees"])
    assert prof["hardware"]["compute_model"] == "roofline"


@pytest.mark.parametrize("cluster", ["rtx3090-pcie", "h100-nvlink", "l4-pcie"])
def test_each_block_costs_its_gemms_plus_its_memory_bound_bytes(args, cluster):
    prof = analytic.analytic_profile(args, cluster)
    spec = load_cluster(cluster)
    rates = device_model.DeviceRates.from_profile(spec)
    shape = dict(prof["model"], core_attention=prof["hardware"]["core_attention"])
    for block in layer_math.BLOCKS:
        for d in prof["degrees"]:
            entry = prof["compute"][block][str(d)]
            n, fwd = entry["forward_s"][2]
            work = device_model.block_work(shape, block, d, spec.dtype_bytes, samples=n)
            t = device_model.roofline_time(work, rates)
            assert fwd == pytest.approx(t.total_s, rel=1e-9)
            assert entry["backward_s"][2][1] == pytest.approx(2 * fwd, rel=1e-9)
            assert entry["recompute_s"][2][1] == pytest.approx(fwd, rel=1e-9)
            # more than the FLOP term alone: the memory-bound work is charged
            flops_only = (
                layer_math.block_flops_forward(prof["model"], block, d)
                * n
                / (spec.sustained_tflops * 1e12)
            )
            assert t.memory_s > 0 and fwd > flops_only * 1.02


def test_a_slower_memory_makes_the_profile_slower(args, monkeypatch):
    """Halving the memory bandwidth lengthens every block by its memory term (can fail: a
    FLOP-only profile would not move)."""
    fast = analytic.analytic_profile(args, "rtx3090-pcie")
    real = device_model.DeviceRates.from_profile

    def slow(profile):
        r = real(profile)
        return device_model.DeviceRates(r.gemm_flops_per_s, r.memory_bytes_per_s / 2, r.name)

    monkeypatch.setattr(analytic.DeviceRates, "from_profile", staticmethod(slow))
    slower = analytic.analytic_profile(args, "rtx3090-pcie")
    for block in layer_math.BLOCKS:
        a = fast["compute"][block]["4"]["forward_s"][0][1]
        b = slower["compute"][block]["4"]["forward_s"][0][1]
        assert b > a * 1.02
