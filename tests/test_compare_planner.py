"""``oases compare``: the ``oases+planner`` variant (schedule oases with compare's --oases-plan)."""

import json
import os
import sys

import pytest

# Megatron's first import logs library start-up warnings (no CUDA, no APEX): import it here, not in
# the middle of a test that checks its stderr.
import megatron.training.arguments  # noqa: F401,E402  isort: skip

from megatron_oases.cli import main as oases_main
from megatron_oases.compare.variants import VARIANTS, parse_variants
from megatron_oases.formats.plan import save_plan, uniform_plan

TINY = [
    "--tensor-model-parallel-size",
    "2",
    "--num-layers",
    "2",
    "--hidden-size",
    "64",
    "--num-attention-heads",
    "4",
    "--seq-length",
    "32",
    "--max-position-embeddings",
    "32",
    "--vocab-size",
    "128",
    "--micro-batch-size",
    "4",  # a degree-1 layer gets micro-batch/2 samples, split again into two sub-batches
    "--global-batch-size",
    "4",
]


def _plan(tmp_path, degrees=(1, 2)):
    plan = uniform_plan(len(degrees), 2, 2, schedule="oases", global_batch_size=4)
    plan["degrees"] = list(degrees)
    path = tmp_path / "plan.json"
    save_plan(plan, str(path))
    return str(path)


def _one_line_error(capsys, argv, *needles):
    assert oases_main(["compare", *argv]) == 2
    raw = capsys.readouterr().err
    # Megatron's first import may print library warnings; the error itself is one line.
    lines = [
        ln
        for ln in raw.splitlines()
        if ln.strip() and "Warning" not in ln and not ln.strip().startswith("warnings.warn")
    ]
    assert len(lines) == 1 and lines[0].startswith("oases compare: error:"), raw
    err = lines[0]
    for n in needles:
        assert n in err, err


def test_planner_variant_is_available_and_needs_a_plan(capsys, tmp_path):
    (v,) = parse_variants("oases+planner")
    assert v.available and v.needs_plan
    assert VARIANTS["oases+planner"].resolved_flags(None, "p.json")[-2:] == (
        "--oases-plan",
        "p.json",
    )
    assert "--oases-plan" not in VARIANTS["oases"].resolved_flags(
        None, "p.json"
    )  # that variant only
    out = ["--out", str(tmp_path / "o")]
    _one_line_error(capsys, ["--variants", "oases+planner", *out, "--", *TINY], "--oases-plan")
    plan = _plan(tmp_path)
    # given to the planner variant only: not among the shared train flags, not without the variant
    _one_line_error(
        capsys,
        ["--variants", "oases+planner", *out, "--", *TINY, "--oases-plan", plan],
        "--oases-plan",
    )
    _one_line_error(
        capsys, ["--variants", "oases", "--oases-plan", plan, *out, "--", *TINY], "oases+planner"
    )
    # a plan that does not fit the model fails before anything is launched
    bad = _plan(tmp_path, degrees=(1, 2, 2))
    _one_line_error(
        capsys, ["--variants", "oases+planner", "--oases-plan", bad, *out, "--", *TINY], "layers"
    )
    assert not (tmp_path / "o" / "oases+planner").exists()


@pytest.mark.timeout(120)
def test_planner_variant_runs_and_is_reported(tmp_path):
    plan = _plan(tmp_path)
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
