"""``oases compare`` end to end on a tiny model (2 emulated-link ranks): the table, plots and
results, ``--reanalyze``, and the memory-budget variants."""

import json
import os
import subprocess
import sys

import pytest
from helpers.variants import COMPARE_TINY as TINY

# Megatron's first import logs library start-up warnings (no CUDA, no APEX): import it here, not in
# the middle of a test that checks its stderr.
import megatron.training.arguments  # noqa: F401,E402  isort: skip

from megatron_oases.cli import main as oases_main

PNG = b"\x89PNG\r\n\x1a\n"


@pytest.mark.timeout(240)
def test_compare_end_to_end_tiny_model(tmp_path):
    out = tmp_path / "cmp"
    cmd = [
        sys.executable,
        "-m",
        "megatron_oases",
        "compare",
        "--variants",
        "megatron,oases",
        "--emulate-link",
        "rtx3090-pcie",
        "--warmup",
        "1",
        "--iters",
        "2",
        "--out",
        str(out),
        "--",
        *TINY,
    ]
    env = dict(os.environ, OASES_HOST_FLOPS="1e11", OASES_HOST_MEM_GBS="5", OMP_NUM_THREADS="1")
    env.pop("OASES_EMULATE_DILATION", None)
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=230, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    # Progress while it runs, then the table.
    assert "[1/2] megatron" in proc.stdout and "[2/2] oases" in proc.stdout
    assert "iteration 3/3 (timed)" in proc.stdout and "tokens/s" in proc.stdout
    for name in (
        "results.json",
        "results.md",
        "throughput.png",
        "timeline-megatron.png",
        "timeline-oases.png",
    ):
        assert (out / name).exists(), name
    for png in ("throughput.png", "timeline-megatron.png", "timeline-oases.png"):
        assert (out / png).read_bytes().startswith(PNG)
    assert not (out / ".oases-lock").exists()  # the run's lock on --out goes with it
    report = json.loads((out / "results.json").read_text())
    # D: the roofline of one layer of TINY's shape (device_model), printed with its parts
    emu = report["emulation"]
    assert emu["host_gemm_ms"] / emu["target_gemm_ms"] == pytest.approx(42e12 / 1e11)
    host_ms, target_ms = emu["host_gemm_ms"] + emu["host_memory_ms"], emu["target_gemm_ms"]
    target_ms += emu["target_memory_ms"]
    assert emu["dilation"] == pytest.approx(host_ms / target_ms) == emu["roofline_dilation"]
    assert emu["host_memory_gbs"] == 5.0 and emu["target_memory_gbs"] == 796
    assert "target GEMM" in proc.stdout and "target GEMM" in (out / "results.md").read_text()
    assert report["loss_check"]["ok"] and report["loss_check"]["reference"] == "megatron"
    by_name = {v["name"]: v for v in report["variants"]}
    for name in ("megatron", "oases"):
        v = by_name[name]
        assert (
            v["status"] == "ok" and len(v["iteration_time_s"]) == 3 and v["timed_iterations"] == 2
        )
        assert v["tokens_per_sec"] == pytest.approx(2 * 32 / v["mean_iteration_s"])
        t = v["trace"]
        assert t["num_ranks"] == 2 and 0 < t["exposed_share"] < 1 and 0 < t["efficiency"] <= 1.0
        assert v["loss_max_rel_diff"] <= 1e-3
    assert by_name["megatron"]["speedup"] == 1.0
    # The host pass: aten calls counted per variant; the split schedule issues more per layer;
    # the tiny model's GPU time (emulated time / D) is far below its issue time: host-bound.
    hosts = {n: by_name[n]["host"] for n in ("megatron", "oases")}
    assert 0 < hosts["megatron"]["aten_calls_per_layer"] < hosts["oases"]["aten_calls_per_layer"]
    for name, h in hosts.items():
        v = by_name[name]
        assert h["host_us_per_call"] == 12.0  # the profile's (measured on an H100 machine's host)
        assert h["issue_ms_per_iteration"] == pytest.approx(h["aten_calls_per_iteration"] * 12e-3)
        d = emu["dilation"]  # the roofline D, not the GEMM-only 420
        assert h["device_ms_per_iteration"] == pytest.approx(1e3 * v["mean_iteration_s"] / d)
        assert h["host_bound"] is True and h["host_floor_s"] == pytest.approx(
            h["issue_ms_per_iteration"] * d / 1e3
        )
    assert "host pass (untimed, rank 0 alone" in proc.stdout
    # Communication-bound tiny model under the emulated PCIe link: most of the time is exposed.
    assert by_name["megatron"]["trace"]["exposed_share"] > 0.5
    md = (out / "results.md").read_text()
    assert "| megatron |" in md and "| oases |" in md and "emulated" in md
    # Paths in results.json are relative to the output directory; --reanalyze rebuilds from them.
    assert all(not os.path.isabs(f) for v in report["variants"] for f in v["trace_files"])
    assert "aten calls/layer" in md and "host floor ms" in md and "**yes**" in md
    (out / "timeline-oases.png").unlink()
    assert oases_main(["compare", "--reanalyze", str(out)]) == 0
    assert (out / "timeline-oases.png").read_bytes().startswith(PNG)
    again = json.loads((out / "results.json").read_text())
    for key in ("exposed_share", "efficiency", "comm_us", "compute_us"):
        assert again["variants"][1]["trace"][key] == pytest.approx(
            report["variants"][1]["trace"][key]
        )
    # a run without counts gets them afterwards (they do not depend on timing), the same counts
    for v in again["variants"]:
        del v["host"]
    (out / "results.json").write_text(json.dumps(again))
    assert oases_main(["compare", "--reanalyze", str(out), "--host-pass"]) == 0
    recounted = json.loads((out / "results.json").read_text())
    for v, old in zip(recounted["variants"], report["variants"]):
        assert v["host"]["aten_calls_per_layer"] == old["host"]["aten_calls_per_layer"]
        assert v["host"]["aten_calls_per_iteration"] == old["host"]["aten_calls_per_iteration"]
    assert "--host-pass" in recounted["host_recounted"]


@pytest.mark.timeout(180)
def test_compare_memory_budget_tiny_model(tmp_path):
    """--memory-budget: the memory pass's keys, no recompute above full recompute, the per-budget
    picks (also after --reanalyze with other budgets), the table and the chart."""
    out = tmp_path / "mem"
    variants = ["megatron", "overlap-norecompute"]
    cmd = [
        sys.executable,
        "-m",
        "megatron_oases",
        "compare",
        "--variants",
        ",".join(variants),
        "--warmup",
        "1",
        "--iters",
        "1",
        "--memory-budget",
        "0.0001,1",
        "--out",
        str(out),
        "--",
        *TINY,
    ]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=170, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    # the host and memory passes' fork server imports Megatron after the entry point's filters
    for text in ("UserWarning", "Transformer Engine and Apex", "No CUDA runtime"):
        assert text not in proc.stderr, proc.stderr[-3000:]
    assert "memory pass (untimed, no link emulation): 2 variant(s)" in proc.stdout
    assert "fastest stock that fits" in proc.stdout and "memory.png" in proc.stdout
    assert (out / "memory.png").read_bytes().startswith(PNG)
    report = json.loads((out / "results.json").read_text())
    by_name = {v["name"]: v for v in report["variants"]}
    for name in variants:
        m = by_name[name]["memory"]
        assert m["peak_bytes_per_rank"] == m["state_bytes"] + m["activation_bytes"] > 0, m
        assert len(m["ranks"]) == 2 and m["state_bytes"] == 16 * m["params"]
        # what is live at the peak: the largest groups, named by the functions that created them
        live = m["live_at_peak"]
        assert 0 < len(live) <= 12 and m["peak_site"] not in ("", "?"), m
        assert 0 < sum(g["bytes"] for g in live) <= m["activation_bytes"], live
        assert [g["bytes"] for g in live] == sorted((g["bytes"] for g in live), reverse=True)
        assert any(g["site"] != "?" for g in live), live
    peak = {n: by_name[n]["memory"]["peak_bytes_per_rank"] / 1e9 for n in variants}
    act = {n: by_name[n]["memory"]["activation_bytes"] for n in variants}
    assert act["overlap-norecompute"] > 1.3 * act["megatron"], act  # all activations kept
    # Nothing fits 0.1 MB; 1 GB fits both sides.
    tps = {n: by_name[n]["tokens_per_sec"] for n in variants}
    assert report["memory_budget"] == [
        {"budget_gb": 0.0001, "stock": None, "oases": None, "speedup": None},
        {
            "budget_gb": 1.0,
            "stock": "megatron",
            "oases": "overlap-norecompute",
            "speedup": pytest.approx(tps["overlap-norecompute"] / tps["megatron"]),
        },
    ]
    md = (out / "results.md").read_text()
    assert "## At equal memory" in md and "| 0.0001 | none fits |" in md and "memory.png" in md
    assert "### What is live at the activation peak" in md
    assert "`megatron`: activations" in md and "`overlap-norecompute`: activations" in md
    # Between full recompute and no recompute only stock with full recompute fits.
    # (budgets chosen anew after the run, from the measured peaks)
    between = round((peak["megatron"] + peak["overlap-norecompute"]) / 2, 6)
    argv = ["compare", "--reanalyze", str(out), "--memory-budget", f"{between}"]
    assert oases_main(argv) == 0
    again = json.loads((out / "results.json").read_text())["memory_budget"]
    assert again == [{"budget_gb": between, "stock": "megatron", "oases": None, "speedup": None}]
    assert "budgets chosen after the run" in (out / "results.md").read_text()
