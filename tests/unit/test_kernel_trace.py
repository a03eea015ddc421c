"""The overlap figures of a CUDA kernel trace (:mod:`megatron_oases.instrument.kernel_trace`),
on a synthetic trace of known answers and on a trace recorded on the H100 (2026-11-26), and the
GPU check's faithful step's own logic (rows, budget, micro-batch doubling) without Megatron."""

import importlib
import os
import sys

import pytest
from helpers.paths import REPO

from megatron_oases.instrument import kernel_trace as kt

RECORDED = os.path.join(
    REPO, "tests/fixtures/h100-2026-11-26-trace-rtx3090-pcie-oases-graphs.json.gz"
)


def test_synthetic_trace_figures():
    a = kt.analyse(kt.synthetic_trace())
    assert (a["spin_kernels"], a["compute_kernels"]) == (2, 2)
    assert a["busy_share"] == pytest.approx(400 / 600)
    assert a["spin_us"] == 200 and a["spin_overlapped_us"] == 100
    assert a["spin_overlapped_share"] == pytest.approx(0.5)
    assert a["concurrent_streams_us"] == 100
    assert a["largest_gap_us"] == 50 and a["idle_gaps_over_100us"] == 0
    waits = a["stream_waits"]
    assert [w["waits_on"] for w in waits] == ["input#1", "spin#1", "input#2", "spin#2", "other"]
    assert waits[1]["spin_running_when_reached"] is False and waits[1]["stalled_us"] == 0
    assert waits[3]["spin_running_when_reached"] is True and waits[3]["stalled_us"] == 150
    assert waits[3]["stream"] == 7 and waits[3]["spin_stream"] == 93
    assert a["stream_wait_summary"] == {
        "by_kind": {"input": 2, "spin": 2, "other": 1},
        "on_spins_that_stalled": 1,
        "stalled_us": 150,
    }


def test_recorded_h100_trace_shows_no_overlap():
    """The review's figures of python/'s oases+graphs trace: 7.0 % busy, 0.51 ms of spin, none
    of it beside compute, 189 gaps over 100 µs (70.2 ms), the largest 15.8 ms; it predates the
    labels, so every stream wait is 'other'."""
    a = kt.analyse(RECORDED)
    assert a["spin_kernels"] == 30
    assert a["busy_share"] == pytest.approx(0.070, abs=0.001)
    assert a["spin_us"] == pytest.approx(507, abs=1)
    assert a["spin_overlapped_us"] == 0 and a["concurrent_streams_us"] == 0
    assert a["idle_gaps_over_100us"] == 189
    assert a["idle_gaps_over_100us_total_us"] == pytest.approx(70_160, abs=10)
    assert a["largest_gap_us"] == pytest.approx(15_823, abs=1)
    assert a["stream_wait_summary"]["by_kind"] == {"other": 148}


def test_an_empty_trace_has_no_figures():
    assert kt.analyse({"traceEvents": []})["window_us"] == 0.0


@pytest.fixture(scope="module")
def faithful():
    """The GPU check's faithful step (benchmarks/gpu/steps/faithful.py; its package ``steps``
    sits beside the driver, check.py)."""
    gpu = os.path.join(REPO, "benchmarks", "gpu")
    sys.path.insert(0, gpu)
    try:
        return importlib.import_module("steps.faithful")
    finally:
        sys.path.remove(gpu)


def test_rows_parse_and_refuse(faithful):
    assert faithful.parse_rows("rtx4090-pcie:4:64, h100-nvlink:16:256:1") == [
        ("rtx4090-pcie", 4, 64, None),
        ("h100-nvlink", 16, 256, 1.0),
    ]
    for bad in ("rtx4090-pcie:4", "x:0:2", "x:2:two", "x:2:2:0"):
        with pytest.raises(ValueError, match="profile:TP:micro-batch"):
            faithful.parse_rows(bad)
    # the priority order, the two-node H100 row last with no dilation
    rows = faithful.parse_rows(",".join(faithful.FAITHFUL_ROWS))
    assert rows[0] == ("rtx4090-pcie", 4, 64, None) and rows[-1] == ("h100-nvlink", 16, 256, 1.0)


def _fake_row(busy, seconds, clock):
    def faithful_row(s, profile, tp, mb, d, iters, dry, graphs):
        clock[0] += seconds
        b = busy(profile, mb)
        return {"profile": profile, "tp": tp, "micro_batch": mb, "min_busy_share": b,
                "counts": b is not None and b >= check_busy_min(), "variants": {}, "speedup": {}}  # fmt: skip

    return faithful_row


def check_busy_min():
    return 0.85


def test_faithful_keeps_the_priority_order_within_its_budget(faithful, monkeypatch):
    """Rows run in order until the next would not fit; a row below the busy minimum is rerun
    once at twice the micro-batch, and the report says so."""
    clock = [0.0]
    monkeypatch.setattr(faithful.time, "time", lambda: clock[0])
    busy = {("rtx4090-pcie", 64): 0.6, ("rtx4090-pcie", 128): 0.9}
    monkeypatch.setattr(
        faithful, "faithful_row", _fake_row(lambda p, mb: busy.get((p, mb), 0.95), 100, clock)
    )
    monkeypatch.setattr(faithful, "fake_group", lambda tp: None)
    saved = []
    out = faithful.run(
        False,
        save=saved.append,
        rows="rtx4090-pcie:4:64,rtx3090-pcie:2:32,rtx4090-pcie:2:32,nope-pcie:2:2,l40s-pcie:2:32",
        deadline_s=450,
    )
    # 100 s a row: the first twice (doubled), then two more; 50 s left for the last
    assert list(out["rows"]) == [
        "rtx4090-pcie-tp4-mb128",
        "rtx3090-pcie-tp2-mb32",
        "rtx4090-pcie-tp2-mb32",
    ]
    first = out["rows"]["rtx4090-pcie-tp4-mb128"]
    assert first["doubled_from"] == {"micro_batch": 64, "min_busy_share": 0.6}
    assert "speedup" in first["prediction"] and first["prediction"]["all_reduce_ms"] > 0
    skipped = " ".join(out["skipped"])
    assert "nope-pcie:2:2: not run" in skipped
    assert "l40s-pcie:2:32: not run: 50 s of the step's budget left, a row took 100 s" in skipped
    assert saved and saved[-1] is out
