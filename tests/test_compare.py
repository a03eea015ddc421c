"""``oases compare``: bad input, loss check, memory estimate, and an end-to-end run on a tiny model."""

import json
import os
import subprocess
import sys

import pytest

# Megatron's first import logs library start-up warnings (no CUDA, no APEX): import it here, not in
# the middle of a test that checks its stderr.
import megatron.training.arguments  # noqa: F401,E402  isort: skip

from megatron_oases.cli import main as oases_main
from megatron_oases.compare.report import add_derived, check_losses, format_table
from megatron_oases.compare.variants import VARIANTS, estimate_memory_gb, parse_variants
from megatron_oases.profiler.model_config import parse_offline

PNG = b"\x89PNG\r\n\x1a\n"
TINY = [
    "--tensor-model-parallel-size",
    "2",
    "--num-layers",
    "2",
    "--hidden-size",
    "64",
    "--micro-batch-size",
    "2",
]


def _one_line_error(capsys, argv, *needles):
    assert oases_main(["compare", *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("oases compare: error:") and "\n" not in err, err
    for n in needles:
        assert n in err, err
    return err


def test_bad_input_is_one_line_exit_2(capsys, tmp_path):
    out = ["--out", str(tmp_path / "o")]
    _one_line_error(
        capsys,
        ["--emulate-link", "dgx-9000", *out, "--", *TINY],
        "dgx-9000",
        "rtx3090-pcie",
        "rtx3090-nvlink",
        "h100-nvlink",
    )
    _one_line_error(capsys, ["--variants", "megatron,merak", *out, "--", *TINY], "merak")
    _one_line_error(capsys, ["--variants", "oases+planner", *out, "--", *TINY], "planner")
    _one_line_error(capsys, [*out, "--", *TINY, "--train-iters", "3"], "--train-iters")
    # Checked before anything is launched: the split schedules need micro-batch >= 2.
    _one_line_error(capsys, [*out, "--", *TINY[:-2], "--micro-batch-size", "1"], "micro-batch")
    assert not (tmp_path / "o" / "megatron").exists()


def test_variants_and_flags():
    assert [v.name for v in parse_variants(None)] == [
        "megatron",
        "megatron-norecompute",
        "overlap",
        "cross-pass",
        "oases",
    ]
    assert "--recompute-granularity" in VARIANTS["megatron"].flags
    assert "--recompute-granularity" not in VARIANTS["megatron-norecompute"].flags
    for name in ("overlap", "cross-pass", "oases"):
        assert VARIANTS[name].flags[:2] == ("--oases-schedule", name)
    # Control variant: stock Megatron on sub-batch-sized micro-batches, same tokens per iteration.
    base = parse_offline(TINY + ["--mock-data", "--global-batch-size", "8"], 2, demo=True)
    flags = VARIANTS["megatron-halfmb"].resolved_flags(base)
    assert flags[-4:] == ("--micro-batch-size", "1", "--global-batch-size", "8")


def test_loss_check_flags_disagreement():
    ok = {
        "status": "ok",
        "tokens_per_sec": 100.0,
        "losses": [6.0, 5.9],
        "mean_iteration_s": 1.0,
        "stdev_iteration_s": 0.0,
        "trace": None,
    }
    res = [
        dict(ok, name="megatron", paper="Megatron-LM"),
        dict(ok, name="oases", paper="x", tokens_per_sec=150.0, losses=[6.0, 5.9 * (1 + 5e-4)]),
        dict(ok, name="overlap", paper="y", losses=[6.0, 5.5]),
        {"name": "cross-pass", "paper": "z", "status": "failed"},
    ]
    ref = add_derived(res)
    assert ref["name"] == "megatron" and res[1]["speedup"] == pytest.approx(1.5)
    bad = check_losses(res, ref, 1e-3)
    assert len(bad) == 1 and bad[0].startswith("overlap")
    assert res[1]["loss_agrees"] and not res[2]["loss_agrees"]
    assert "failed" in format_table(res)


def test_memory_estimate_skips_what_cannot_fit():
    small = parse_offline(TINY + ["--mock-data"], 2, demo=True)
    assert estimate_memory_gb(small, recompute=False) < 0.1
    # ~3.4 GB of activations per layer and micro-batch without recompute: 8 layers do not fit.
    long_seq = parse_offline(
        [
            "--tensor-model-parallel-size",
            "2",
            "--num-layers",
            "8",
            "--hidden-size",
            "2048",
            "--num-attention-heads",
            "16",
            "--seq-length",
            "4096",
            "--max-position-embeddings",
            "4096",
            "--micro-batch-size",
            "4",
            "--mock-data",
        ],
        2,
        demo=True,
    )
    assert estimate_memory_gb(long_seq, recompute=False) > 24 > estimate_memory_gb(long_seq, True)


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
    env = dict(os.environ, OASES_HOST_FLOPS="1e11", OMP_NUM_THREADS="1")
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
    report = json.loads((out / "results.json").read_text())
    assert report["emulation"]["dilation"] == pytest.approx(42e12 / 1e11)
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
    # Communication-bound tiny model under the emulated PCIe link: most of the time is exposed.
    assert by_name["megatron"]["trace"]["exposed_share"] > 0.5
    md = (out / "results.md").read_text()
    assert "| megatron |" in md and "| oases |" in md and "emulated" in md
    # Paths in results.json are relative to the output directory; --reanalyze rebuilds from them.
    assert all(not os.path.isabs(f) for v in report["variants"] for f in v["trace_files"])
    (out / "timeline-oases.png").unlink()
    assert oases_main(["compare", "--reanalyze", str(out)]) == 0
    assert (out / "timeline-oases.png").read_bytes().startswith(PNG)
    again = json.loads((out / "results.json").read_text())
    for key in ("exposed_share", "efficiency", "comm_us", "compute_us"):
        assert again["variants"][1]["trace"][key] == pytest.approx(
            report["variants"][1]["trace"][key]
        )
