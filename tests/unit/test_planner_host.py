"""The planner's host term: calls per layer per setting (counted), the host time of an iteration,
and the choice it changes (a split that starves a fast GPU loses to stock)."""

import pytest
from helpers.variants import h2048_args

from megatron_oases.formats.profile import Profile
from megatron_oases.planner.choose import SETTINGS, alternatives_table, choose_plan
from megatron_oases.planner.host_model import host_time, load_table, setting_key
from megatron_oases.planner.settings import PlanSettings
from megatron_oases.profiler.analytic import analytic_profile
from megatron_oases.validation import SPLIT_SCHEDULES


def test_the_table_counts_every_setting_the_planner_plans():
    table = load_table()
    for schedule, recompute in SETTINGS:
        for split in ("batch", "sequence") if schedule in SPLIT_SCHEDULES else ("batch",):
            row = table[setting_key(schedule, recompute, split)]
            assert row["per_layer"] > 0 and row["rest"] > 0, (schedule, recompute, split)
    # two sub-batches issue more calls per layer than stock at the same recompute setting
    for recompute in ("none", "selective", "selective+ln", "full"):
        stock = table[setting_key("off", recompute)]["per_layer"]
        assert table[setting_key("overlap", recompute)]["per_layer"] > stock, recompute
    assert table["oases/full"]["per_layer"] > table["off/full"]["per_layer"]


def test_host_time_arithmetic():
    table = {
        "off/full": {"per_layer": 900, "rest": 1000},
        "overlap/none": {"per_layer": 1200, "rest": 1100},
        "off/none": {"per_layer": 800, "rest": 1000},
        "oases/full": {"per_layer": 1400, "rest": 1100},
    }
    s, calls = host_time("off", "full", "batch", 1, 4, 2, 2.0, table=table)
    assert calls == 2 * (4 * 900 + 1000) and s == pytest.approx(calls * 2e-6)
    # Megatron's block method: the first 2 of 4 layers recomputed, the others as overlap's
    _, calls = host_time("oases", "full", "batch", 2, 4, 1, 1.0, recompute_num_layers=2,
                         table=table)  # fmt: skip
    assert calls == 2 * 1400 + 2 * 1200 + 1100
    # three sub-batches: the calls above stock's grow with the sub-batches beyond the first
    table["overlap/full"] = {"per_layer": 1300, "rest": 1100}
    _, calls = host_time("overlap", "full", "batch", 3, 1, 1, 1.0, table=table)
    assert calls == 900 + (1300 - 900) * 2 + 1100


@pytest.fixture(scope="module")
def h2048():
    return h2048_args()


def test_the_host_term_keeps_a_fast_gpu_from_splitting(h2048):
    """The paper's H=2048 model on the analytic H100 NVLink cluster: without the host term a
    split setting wins (58 ms against stock's 68); with the profile's 12 µs per call (measured on an H100 host) every split
    setting is host-bound (an H100 runs a TMP-4 layer's share faster than its ~1,500 calls per
    micro-batch issue) and takes its host's time, and stock, which issues a third fewer calls
    and keeps the GPU busy, wins."""
    profile = Profile(analytic_profile(h2048, "h100-nvlink"))
    # at TP 4 (with the roofline's memory-bound work, 80 GB would let every layer drop to degree 1)
    kw = dict(schedule="auto", global_batch_size=128, memory_gb=80, degrees=[4])
    device_only = choose_plan(profile, PlanSettings(host_us_per_call=0, **kw))[0]
    assert device_only["schedule"] != "off" and device_only["predicted"]["host"] is None
    plan = choose_plan(profile, PlanSettings(**kw))[0]
    assert plan["schedule"] == "off", plan["launch_flags"]
    p = plan["predicted"]
    assert p["host"]["host_us_per_call"] == 12.0
    assert p["iteration_time_s"] == pytest.approx(max(p["device_time_s"], p["host"]["issue_s"]))
    assert p["iteration_time_s"] > device_only["predicted"]["iteration_time_s"]
    split = [t for t in plan["alternatives"] if t["fits"] and t["schedule"] != "off"]
    assert split and all(t["host_bound"] for t in split)
    assert all(t["iteration_time_s"] > t["device_time_s"] for t in split)
    assert "host-bound" in "\n".join(alternatives_table(plan))


def test_a_slow_gpu_is_not_host_bound(h2048):
    """On RTX 3090s the same model's layers take longer than their calls: the choice stands."""
    profile = Profile(analytic_profile(h2048, "rtx3090-nvlink"))
    plan = choose_plan(profile, PlanSettings(schedule="auto", global_batch_size=128, memory_gb=80))[
        0
    ]
    assert plan["schedule"] != "off" and not plan["predicted"]["host"]["host_bound"]
    assert plan["predicted"]["iteration_time_s"] == plan["predicted"]["device_time_s"]
