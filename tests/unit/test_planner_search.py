"""``oases plan --gpus N``: the DP x TP x PP search (:mod:`megatron_oases.planner.search`)."""

import json
import subprocess
import sys

import pytest

from megatron_oases.planner.search import Layout, layouts, model_for_search, search, why_first
from megatron_oases.profiler.model_config import read_model_file


@pytest.fixture(scope="module")
def gpt7b():
    return model_for_search(read_model_file("gpt-6.7b"), 64)


def test_every_layout_is_one_megatron_runs(gpt7b):
    found = layouts(gpt7b, 8, 64, gpus_per_node=4)
    assert len(found) == len(set(found)) and found
    for lay in found:
        assert lay.tp * lay.pp * lay.dp == 8 and lay.tp <= 4  # TP within a node
        assert gpt7b.num_attention_heads % lay.tp == 0 and 32 % lay.pp == 0
        assert (64 // lay.dp) % lay.micro_batch == 0
    assert {lay.pp for lay in found} == {1, 2, 4, 8}
    assert Layout(4, 2, 1, 2) in found and Layout(8, 1, 1, 1) not in found


def test_pipeline_parallelism_wins_where_one_stage_does_not_fit(gpt7b):
    """6.7B on 8 RTX 3090s (24 GB): no single-stage layout fits; a pipelined one wins, and the
    winner is never slower than the usual rules' pick (TP within a node, fewest stages, the
    largest micro-batch, stock)."""
    result = search(gpt7b, "rtx3090-pcie", 8, 64)
    best = result["candidates"][0]
    assert best["layout"]["pp"] > 1 and best["level"] == 2
    assert all(c["layout"]["pp"] > 1 for c in result["candidates"])
    thumb = result["rule_of_thumb"]
    assert thumb["layout"]["tp"] == 4 and thumb["schedule"] == "off"
    assert best["iteration_time_s"] <= thumb["iteration_time_s"]
    times = [c["iteration_time_s"] for c in result["candidates"] if c["level"] == 2]
    assert times == sorted(times)
    plan = result["winner_plan"]
    lay = Layout(**plan["layout"])
    assert plan["launch_flags"].startswith(lay.flags(64) + " --oases-schedule ")
    assert "rule of thumb" in why_first(result)


def test_memory_forces_recompute(gpt7b):
    """64 H100s: with 80 GB the winner keeps every activation; with 30 GB it must recompute."""
    roomy = search(gpt7b, "h100-nvlink", 64, 64)["candidates"][0]
    tight = search(gpt7b, "h100-nvlink", 64, 64, memory_gb=30)["candidates"][0]
    assert roomy["recompute"] == "none"
    assert tight["recompute"] != "none" and tight["peak_memory_gb"] <= 30


def test_the_host_term_keeps_a_fast_gpu_from_splitting(gpt7b):
    """64 H100s: on device time alone a split schedule wins; at the measured host cost per call
    the split's launches make it host-bound and stock wins."""
    device_only = search(gpt7b, "h100-nvlink", 64, 64, host_us_per_call=0)["candidates"][0]
    assert device_only["schedule"] != "off"
    hosted = search(gpt7b, "h100-nvlink", 64, 64)
    assert hosted["candidates"][0]["schedule"] == "off"
    splits = [c for c in hosted["candidates"] if c["schedule"] != "off" and c["level"] == 2]
    assert all(c["iteration_time_s"] > hosted["candidates"][0]["iteration_time_s"] for c in splits)


def test_cli_prints_the_ranking_and_writes_the_winners_plan(tmp_path):
    out = tmp_path / "plan.json"
    cmd = [sys.executable, "-m", "megatron_oases", "plan", "--gpus", "8", "--cluster",
           "rtx3090-pcie", "--model", "gpt-6.7b", "--global-batch-size", "64", "--out", str(out)]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "layouts of 8 GPUs on rtx3090-pcie searched" in proc.stdout
    assert "why: " in proc.stdout and "run with: --tensor-model-parallel-size " in proc.stdout
    plan = json.loads(out.read_text())
    assert plan["search"]["gpus"] == 8 and plan["search"]["candidates"]
    assert plan["launch_flags"] in proc.stdout


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--gpus", "8", "--model", "gpt-6.7b"], "--gpus needs --cluster"),
        (["--gpus", "8", "--cluster", "rtx3090-pcie"], "--gpus needs --model"),
        (["--cluster", "rtx3090-pcie"], "--cluster: only with --gpus N"),
        (["--gpus", "8", "--cluster", "rtx3090-pcie", "--model", "gpt-6.7b", "--schedule",
          "oases"], "--gpus chooses --schedule itself"),  # fmt: skip
        (["--gpus", "8", "--cluster", "rtx3090-pcie", "--model", "gpt-6.7b", "--profile",
          "p.json"], "drop --profile"),  # fmt: skip
        ([], "pass --profile PROFILE_JSON"),
    ],
)
def test_bad_search_flags_are_one_line(extra, message, capsys):
    from megatron_oases.cli import main

    code = main(["plan", "--global-batch-size", "64", *extra])
    err = capsys.readouterr().err.strip().splitlines()
    assert code != 0 and len(err) == 1 and message in err[0], err


def test_spearman_ranks_with_ties():
    from megatron_oases.planner.verify import spearman

    assert spearman([1, 2, 3, 4], [10, 20, 30, 40]) == pytest.approx(1.0)
    assert spearman([1, 2, 3, 4], [4, 3, 2, 1]) == pytest.approx(-1.0)
    assert spearman([1, 1, 2], [1, 1, 2]) == pytest.approx(1.0)
    assert spearman([1], [2]) is None
