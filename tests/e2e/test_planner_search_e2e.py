"""``oases plan --gpus N --verify-top K``: the search's candidates run under the emulator."""

import json
import subprocess
import sys

import pytest


@pytest.mark.timeout(300)
def test_verify_top_runs_the_fastest_candidates_under_the_emulator(tmp_path):
    """``--verify-top 2`` on the tiny model over 2 emulated ranks: each run's measured iteration
    (÷ D) beside its prediction, the table and the rank correlation printed, the runs' logs next
    to the plan file."""
    out = tmp_path / "plan.json"
    cmd = [sys.executable, "-m", "megatron_oases", "plan", "--gpus", "2", "--cluster",
           "rtx3090-pcie", "--model", "tiny-cpu", "--global-batch-size", "4", "--verify-top", "2",
           "--out", str(out)]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=280)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "predicted ms" in proc.stdout and "Spearman" in proc.stdout
    verified = json.loads(out.read_text())["search"]["verified"]
    assert [r["status"] for r in verified["rows"]] == ["ok", "ok"]
    assert all(r["measured_s"] > 0 for r in verified["rows"]) and verified["dilation"] > 1
    assert (tmp_path / "plan-verify").is_dir()
