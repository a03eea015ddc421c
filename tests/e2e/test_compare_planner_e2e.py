"""``oases compare``: a run of the ``oases+planner`` variant (schedule oases with compare's
--oases-plan), and how it is reported."""

import json
import os
import sys

import pytest
from helpers.plans import compare_plan
from helpers.variants import COMPARE_PLANNER_TINY as TINY

# Megatron's first import logs library start-up warnings (no CUDA, no APEX): import it here, not in
# the middle of a test that checks its stderr.
import megatron.training.arguments  # noqa: F401,E402  isort: skip

from megatron_oases.cli import main as oases_main


@pytest.mark.timeout(120)
def test_planner_variant_runs_and_is_reported(tmp_path):
    plan = compare_plan(tmp_path)
    out = tmp_path / "cmp"
    argv = ["compare", "--variants", "oases+planner", "--oases-plan", plan, "--warmup", "0"]
    argv += ["--iters", "1", "--out", str(out), "--", *TINY]
    assert oases_main(argv) == 0
    raw = (out / "results.json").read_text()
    report = json.loads(raw)
    by_name = {r["name"]: r for r in report["variants"]}
    r = by_name["oases+planner"]
    assert r["status"] == "ok", r
    flags = r["flags"]
    assert flags[flags.index("--oases-schedule") + 1] == "oases"
    # the plan it ran with is kept beside results.json, which names it relative to its directory
    assert flags[flags.index("--oases-plan") + 1] == "oases-plan.json"
    assert report["config"]["oases_plan"] == "oases-plan.json"
    assert json.loads((out / "oases-plan.json").read_text()) == json.loads(open(plan).read())
    assert report["loss_check"]["ok"], report["loss_check"]
    _assert_no_absolute_path(raw, report, tmp_path)
    assert all((out / f).is_file() for f in r["trace_files"]) and (out / r["timeline"]).is_file()


def _assert_no_absolute_path(raw, report, tmp_path):
    """results.json names nothing by its place on this machine: no absolute path in any string,
    argument list or command line (``--flag=PATH`` included)."""
    assert str(tmp_path) not in raw and sys.prefix not in raw and sys.executable not in raw

    def strings(v):
        if isinstance(v, dict):
            for x in v.values():
                yield from strings(x)
        elif isinstance(v, list):
            for x in v:
                yield from strings(x)
        elif isinstance(v, str):
            yield v

    for text in strings(report):
        for token in text.replace("'", " ").replace('"', " ").split():
            path = token.split("=", 1)[-1]
            assert not os.path.isabs(path), f"absolute path {path!r} in results.json: {text!r}"
