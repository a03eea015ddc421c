"""The cluster search covers what a Megatron user has (the distributed optimizer, TP = 1 layouts)
and names the best stock layout beside the best Oases one (:mod:`megatron_oases.search.search`).
"""

import json

import pytest

from megatron_oases.errors import OasesConfigError
from megatron_oases.formats.profile import Profile
from megatron_oases.planner.api import make_plan
from megatron_oases.planner.settings import PlanSettings
from megatron_oases.profiler.analytic import analytic_profile
from megatron_oases.profiler.model_config import read_model_file
from megatron_oases.search import search as search_mod
from megatron_oases.search.search import is_oases, model_for_search, search, verdict

GBS = 32


@pytest.fixture(scope="module")
def h2048():
    return model_for_search(read_model_file("h2048-l24"), GBS)


@pytest.fixture(scope="module")
def tight(h2048):
    """h2048-l24 on 4 RTX 3090 PCIe capped at 16 GB (the full Adam state of a 2-way shard does
    not fit beside its activations there), without sharded data parallelism (the distributed
    optimizer's case; with FSDP, Oases under Megatron-FSDP wins here)."""
    return search(h2048, "rtx3090-pcie", 4, GBS, memory_gb=16, top=2, sharding=False)


def _profile(args, tp, pp, dp, mb):
    import copy

    a = copy.copy(args)
    a.tensor_model_parallel_size, a.pipeline_model_parallel_size = tp, pp
    a.data_parallel_size, a.micro_batch_size = dp, mb
    return Profile(analytic_profile(a, "rtx3090-pcie"))


def test_the_distributed_optimizer_makes_a_layout_fit_and_win(h2048, tight, monkeypatch):
    best = tight["candidates"][0]
    lay = best["layout"]
    assert lay["dp"] > 1 and best["distributed_optimizer"]
    assert "--use-distributed-optimizer" in best["launch_flags"]
    assert tight["winner_plan"]["distributed_optimizer"] is True
    # the same layout and setting without it does not fit
    profile = _profile(h2048, lay["tp"], lay["pp"], lay["dp"], lay["micro_batch"])
    setting = dict(schedule=best["schedule"], recompute=best["recompute"], split=best["split"])
    kw = dict(global_batch_size=GBS, micro_batch_size=lay["micro_batch"], memory_gb=16)
    kw.update(degrees=best["degrees"], grad_sync=True)
    with pytest.raises(OasesConfigError):
        make_plan(profile, PlanSettings(distributed_optimizer=False, **setting, **kw))
    make_plan(profile, PlanSettings(distributed_optimizer=True, **setting, **kw))  # fits
    # and without the distributed optimizer in the search, the winner is slower
    monkeypatch.setattr(search_mod, "_optimizers", lambda layout: (False,))
    without = search(h2048, "rtx3090-pcie", 4, GBS, memory_gb=16, top=2, sharding=False)["candidates"][0]
    assert not without["distributed_optimizer"]
    assert without["iteration_time_s"] > best["iteration_time_s"] * 1.01


def test_its_sync_is_a_reduce_scatter_and_an_all_gather(h2048):
    """ZeRO-1 moves fp32 gradients once (reduce-scatter) and model-dtype parameters once
    (all-gather): 6 bytes per parameter against the all-reduce's 2 × 4 on the ring."""
    profile = _profile(h2048, 1, 1, 4, 1)
    ar, do = profile.grad_sync_time(1), profile.grad_sync_time(1, distributed_optimizer=True)
    assert 0.70 < do / ar < 0.80


def test_tp1_layouts_run_stock_only(h2048, tight):
    tp1 = [c for c in tight["candidates"] if c["layout"]["tp"] == 1]
    assert tp1, "no TP = 1 layout was ranked"
    assert all(not is_oases(c) for c in tp1)


def test_best_stock_and_best_oases_are_named_with_their_ratio(tight):
    stock, oases, ratio = tight["best_stock"], tight["best_oases"], tight["stock_over_oases"]
    assert not is_oases(stock) and is_oases(oases)
    assert ratio == pytest.approx(stock["iteration_time_s"] / oases["iteration_time_s"])
    # the best stock layout is no slower than any stock row ranked
    for c in tight["candidates"]:
        if not is_oases(c):
            assert stock["iteration_time_s"] <= c["iteration_time_s"] + 1e-12
    lines = verdict(tight)
    assert lines[0].startswith("best Oases: " + oases["name"])
    assert lines[1].startswith("best stock: " + stock["name"])
    assert f"{ratio:.2f}x" in lines[2] or f"{1 / ratio:.2f}x" in lines[2]


def test_where_stock_wins_it_says_so_with_stocks_launch_line(h2048):
    """13 GB, without sharded data parallelism: a pipelined TP = 1 layout (stock) beats every
    Oases layout on PCIe (with it, Oases under Megatron-FSDP wins: test_planner_sharding)."""
    result = search(h2048, "rtx3090-pcie", 4, GBS, memory_gb=13, top=2, sharding=False)
    assert result["stock_over_oases"] < 1
    stock = result["best_stock"]
    assert result["candidates"][0] is stock
    line = verdict(result)[2]
    assert line.startswith("stock Megatron") and " wins here: " in line
    assert stock["stock_launch_flags"] in line
    assert "--oases" not in line and "--tensor-model-parallel-size 1" in line


def test_plan_file_records_both(tmp_path):
    from megatron_oases.cli import main

    out = tmp_path / "plan.json"
    argv = ["plan", "--gpus", "4", "--cluster", "rtx3090-pcie", "--model", "h2048-l24"]
    argv += ["--global-batch-size", str(GBS), "--memory", "16", "--top", "2", "--out", str(out)]
    assert main(argv) == 0
    plan = json.loads(out.read_text())
    assert plan["best_stock"]["schedule"] == "off" and is_oases(plan["best_oases"])
    assert plan["stock_over_oases"] == pytest.approx(
        plan["best_stock"]["iteration_time_s"] / plan["best_oases"]["iteration_time_s"]
    )
