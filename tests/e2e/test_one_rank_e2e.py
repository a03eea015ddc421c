"""One rank stands for the group: ``--one-rank`` runs of ``oases compare`` and ``oases profile``
(rank 0 alone on the fake process group, the other ranks virtual) and the launcher under them."""

import json
import math
import os
import signal
import subprocess
import sys

import pytest
from helpers.variants import TINY_TP4

import megatron.training.arguments  # noqa: F401,E402  isort: skip  (start-up warnings here)

from megatron_oases.cli import main as oases_main
from megatron_oases.launch import run_distributed


def _world_and_backend():
    import torch.distributed as dist

    return dist.get_rank(), dist.get_world_size(), dist.get_backend()


def _die():
    os.kill(os.getpid(), signal.SIGKILL)


@pytest.mark.timeout(120)
def test_run_distributed_one_rank_runs_one_process_on_the_fake_group():
    assert run_distributed(_world_and_backend, 8, timeout=100, one_rank=True) == [(0, 8, "fake")]


@pytest.mark.timeout(120)
def test_a_rank_killed_by_a_signal_fails_the_run_at_once():
    """A rank that dies without reporting (segfault, OOM killer) fails the run within seconds,
    not at the timeout."""
    import time

    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match="died with exit code -9"):
        run_distributed(_die, 2, timeout=100)
    assert time.monotonic() - t0 < 60


def _finite(x, where="results"):
    """Every number in a JSON tree is finite."""
    if isinstance(x, dict):
        for k, v in x.items():
            _finite(v, f"{where}.{k}")
    elif isinstance(x, list):
        for i, v in enumerate(x):
            _finite(v, f"{where}[{i}]")
    elif isinstance(x, float):
        assert math.isfinite(x), where


@pytest.mark.timeout(300)
def test_compare_one_rank_emulates_tmp4_in_one_process(tmp_path):
    """TMP=4 as rank 0 alone: one process, one trace, the TMP group's collectives emulated on the
    4-rank link, no loss check, every number finite; the memory pass runs rank 0 alone too."""
    out = tmp_path / "cmp"
    cmd = [sys.executable, "-m", "megatron_oases", "compare", "--one-rank", "--nproc", "4"]
    cmd += ["--variants", "megatron,oases", "--emulate-link", "rtx3090-pcie"]
    cmd += ["--warmup", "1", "--iters", "1", "--memory-budget", "1", "--out", str(out)]
    cmd += ["--", *TINY_TP4]
    env = dict(os.environ, OASES_HOST_FLOPS="1e11", OMP_NUM_THREADS="1")
    env.pop("OASES_EMULATE_DILATION", None)
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=280, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "4 ranks (rank 0 run alone, the others virtual)" in proc.stdout
    assert "emulator rank 1" not in proc.stdout  # no second process
    report = json.loads((out / "results.json").read_text())
    _finite(report)
    assert report["config"]["one_rank"] is True and report["config"]["nproc"] == 4
    # one process on this host: the host rate is not shared
    assert report["emulation"]["oversubscription_share"] == 1.0
    assert report["loss_check"]["ok"] is None
    assert "not checked" in report["loss_check"]["summary"]
    by_name = {v["name"]: v for v in report["variants"]}
    for name in ("megatron", "oases"):
        v = by_name[name]
        assert v["status"] == "ok" and len(v["trace_files"]) == 1, v
        t = v["trace"]
        assert t["num_ranks"] == 1 and t["comm_us"] > 0 and 0 < t["efficiency"] <= 1.0
        # alone, every blocked microsecond is the link's
        assert t["schedule_exposed_us"] == pytest.approx(t["exposed_us"], rel=1e-6)
        assert len(v["memory"]["ranks"]) == 1 and v["memory"]["peak_bytes_per_rank"] > 0
        assert all(math.isfinite(x) for x in v["losses"])
    # the emulator modelled the 4-rank group: the TMP all-reduces ran on 4 global ranks
    trace = json.loads((out / by_name["megatron"]["trace_files"][0]).read_text())
    sizes = {e["args"].get("group_size") for e in trace["traceEvents"] if e.get("cat") == "comm"}
    assert 4 in sizes, sizes
    md = (out / "results.md").read_text()
    assert "one-rank, timing-only" in md and "rank 0 of 4 run alone" in md


@pytest.mark.timeout(300)
def test_profile_one_rank_measures_degree_8_on_a_small_host(tmp_path):
    """``oases profile --one-rank``: every degree up to 8 from one process; the emulated
    collectives grow with the group; the profile (and its cache key) says it was one rank."""
    out = tmp_path / "p8.json"
    argv = ["profile", "--model", "tiny-cpu", "--set", "num_attention_heads=8"]
    argv += ["--tensor-model-parallel-size", "8", "--emulate-link", "rtx3090-pcie", "--one-rank"]
    argv += ["--nproc", "8", "--repeats", "1", "--cache-dir", str(tmp_path / "cache")]
    argv += ["--timeout", "250", "--out", str(out)]
    assert oases_main(argv) == 0
    data = json.loads(out.read_text())
    assert data["degrees"] == [1, 2, 4, 8]
    assert data["hardware"]["one_rank"] is True and data["hardware"]["world_size"] == 8
    ar = data["comm"]["all_reduce"]
    alpha = [ar[k]["alpha_s"] for k in ("0,1", "0,1,2,3", "0,1,2,3,4,5,6,7")]
    assert 0 < alpha[0] < alpha[1] < alpha[2], alpha  # 2(N-1) ring steps of latency
    for block in ("attention", "mlp"):
        assert set(data["compute"][block]) == {"1", "2", "4", "8"}
        assert all(t > 0 for _, t in data["compute"][block]["8"]["forward_s"])
