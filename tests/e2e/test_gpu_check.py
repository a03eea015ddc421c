"""``benchmarks/gpu/check.sh --dry-run``: the GPU check's every step, on the CPU with tiny shapes,
so that the first lent GPU runs a script that already works end to end."""

import json
import os
import subprocess
import sys
import time

import pytest
from helpers.paths import REPO


#: Its host time per layer is a difference of timed minima: read alone (pyproject's quiet_host).
@pytest.mark.quiet_host
@pytest.mark.timeout(920)
def test_gpu_check_dry_run_runs_every_step(tmp_path):
    out = tmp_path / "gpu"
    env = dict(os.environ, PYTHON=sys.executable)
    env.pop("OASES_EMULATE_DILATION", None)
    env.pop("OASES_HOST_FLOPS", None)
    t0 = time.monotonic()
    proc = subprocess.run(
        [
            "bash",
            os.path.join(REPO, "benchmarks", "gpu", "check.sh"),
            "--dry-run",
            "--budget-s",
            "880",
            "--out",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=900,
        env=env,
    )
    elapsed = time.monotonic() - t0
    log = (out / "check.log").read_text() if (out / "check.log").exists() else ""
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:] + log[-4000:]
    report = json.loads((out / "report.json").read_text())
    assert report["dry_run"] is True
    steps = report["steps"]
    assert list(steps) == ["env", "parity", "timing", "host", "split", "graphs", "python"]
    assert all(s["status"] == "ok" for s in steps.values()), steps
    # parity: every configuration ran and matched stock within its stated tolerance
    parity = steps["parity"]["result"]
    assert set(parity) >= {"gpt-fp32", "gpt-bf16", "gpt-sp-fp32", "llama-fp32"}
    for name, r in parity.items():
        assert r["status"] == "ok", (name, r)
        assert r["worst_rel_diff"] and max(r["worst_rel_diff"].values()) < r["tolerance"]
    assert set(parity["gpt-fp32"]["worst_rel_diff"]) == {"overlap", "cross-pass", "oases"}
    # timing: one-rank rows of both links and both ends of the TMP range, a finite speed-up each
    timing = steps["timing"]["result"]
    assert timing.pop("collective_kernel") == {"kernel": None, "fallback_reason": None}  # CPU
    assert set(timing) == {"rtx3090-pcie-tp8", "h100-nvlink-tp2-busy-mb2"}
    for row in timing.values():
        assert set(row["speedup"]) == {"megatron", "oases", "overlap-norecompute"}, row
        assert all(0 < v < 100 for v in row["speedup"].values())
    # host: calls counted per layer; the split schedule issues more calls than stock
    host = steps["host"]["result"]
    probe = host["probe"]
    assert 0 < probe["megatron"]["aten_calls_per_layer"] < probe["oases"]["aten_calls_per_layer"]
    assert host["host_us_per_call"] > 0
    assert steps["split"]["result"]["half_x2_over_full"] > 0
    # graphs: its eager bookkeeping on the CPU (the capture is the GPU's), at parity with stock
    graphs = steps["graphs"]["result"]
    assert graphs["flag"] == "--oases-cuda-graphs eager"
    fp32 = graphs["parity"]["gpt-fp32"]
    assert fp32["status"] == "ok"
    assert set(fp32["worst_rel_diff"]) == {"oases+graphs", "overlap-keep+graphs"}
    assert set(graphs["host"]) == {"megatron", "oases", "oases+graphs"}
    assert all(r["aten_calls_per_layer"] > 0 for r in graphs["host"].values())
    (row,) = graphs["timing"].values()
    assert set(row["speedup"]) == {"megatron", "oases", "oases+graphs"}
    # the traces come back from the device tool, which drops names with '+'
    assert graphs["traces"] and all("+" not in t for t in graphs["traces"]), graphs["traces"]
    assert all((out / t).exists() for t in graphs["traces"])
    # python: host time per layer by package; the schedule's own frames show, stock's hardly
    python = steps["python"]["result"]
    assert set(python) == {"megatron", "oases", "oases+graphs"}
    for name, r in python.items():
        assert r["host_ms_per_layer"] > 0 and r["host_ms_per_layer_unprofiled"] > 0, (name, r)
        assert all(v > -0.5 for v in r["ms_per_layer_by_package"].values()), (name, r)
    assert python["oases"]["oases_share"] > python["megatron"]["oases_share"]
    assert any("schedule/" in f for f, _, _ in python["oases"]["top_oases_8_layers"])
    md = (out / "report.md").read_text()
    assert "## Host time per layer by package" in md
    assert "dry run on the CPU" in md and "## Parity against stock" in md and "## Host floor" in md
    assert "## CUDA graphs" in md
    # within the budget it was given (each step also has its own limit, its module's LIMIT_S);
    # its wall time is no yardstick beside another test on the 2 CPUs (the suite runs two at a time)
    assert elapsed < 880, f"dry run took {elapsed:.0f} s"


@pytest.mark.timeout(900)
def test_gpu_check_faithful_dry_run(tmp_path):
    """``--steps env,faithful``: every variant of a row in two passes, the speed-ups against the
    fair baseline and the best stock variant beside the roofline prediction, the first row's
    traces analysed (the CPU's hold no kernels: a synthetic one runs through the analysis too),
    and a row that cannot run is one line, not a failure."""
    out = tmp_path / "gpu"
    env = dict(os.environ, PYTHON=sys.executable)
    for k in ("OASES_EMULATE_DILATION", "OASES_HOST_FLOPS", "OASES_HOST_MEM_GBS"):
        env.pop(k, None)
    cmd = ["bash", os.path.join(REPO, "benchmarks", "gpu", "check.sh"), "--dry-run"]
    cmd += ["--steps", "env,faithful", "--rows", "rtx4090-pcie:4:2:1,no-such-gpu:2:2"]
    cmd += ["--out", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=880, env=env)
    log = (out / "check.log").read_text() if (out / "check.log").exists() else ""
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:] + log[-4000:]
    report = json.loads((out / "report.json").read_text())
    env_result = report["steps"]["env"]["result"]
    assert env_result["memory_gbs"] > 0  # the emulator's host memory rate on a GPU
    f = report["steps"]["faithful"]["result"]
    assert f["host_rates"]["memory_gbs"] == env_result["memory_gbs"]
    (key,) = f["rows"]
    assert key == "rtx4090-pcie-tp4-mb2"
    row = f["rows"][key]
    labels = ["megatron", "megatron-norecompute", "oases", "overlap-norecompute", "oases+graphs"]
    assert list(row["variants"]) == labels
    for label, v in row["variants"].items():
        assert "error" not in v, (label, v)
        assert len(v["iteration_s"]) == 4 and v["median_s"] > 0  # 2 timed x 2 passes
        assert v["dilation"] == 1.0  # forced by the row; the emulator's own line read back
        assert v["busy_share"] is None  # no CUDA
    sp = row["speedup"]
    assert sp["overlap-norecompute"]["fair"] == pytest.approx(
        row["variants"]["megatron-norecompute"]["median_s"]
        / row["variants"]["overlap-norecompute"]["median_s"]
    )
    assert sp["oases"]["fair"] == pytest.approx(
        row["variants"]["megatron"]["median_s"] / row["variants"]["oases"]["median_s"]
    )
    assert row["counts"] is False  # no busy share measured: the row cannot count
    pred = row["prediction"]
    assert pred["roofline_d"] > 0 and "D = " in pred["roofline_d_parts"]
    ideal, serial = pred["speedup"]["oases"]["fair_ideal"], pred["speedup"]["oases"]["fair_serial"]
    assert ideal >= serial > 0
    assert any("no-such-gpu:2:2: not run" in line for line in f["skipped"])
    for label in ("megatron", "oases"):
        t = f["traces"][label]
        assert "error" not in t, t
        assert (out / t["file"]).exists() and "+" not in t["file"]
        assert t["analysis"]["kernels"] == 0
        assert t["synthetic_analysis"]["spin_overlapped_share"] == pytest.approx(0.5)
    md = (out / "report.md").read_text()
    assert "## Faithful one-rank rows" in md and "### Kernel traces of the first row" in md
    assert "Prediction model:" in md and "vs fair" in md and "skipped: no-such-gpu" in md
