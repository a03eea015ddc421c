"""``oases compare``: the ``oases+planner`` variant (schedule oases with compare's --oases-plan)."""

import json

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
    report = json.loads((out / "results.json").read_text())
    by_name = {r["name"]: r for r in report["variants"]}
    r = by_name["oases+planner"]
    assert r["status"] == "ok", r
    flags = r["flags"]
    assert flags[flags.index("--oases-schedule") + 1] == "oases"
    assert flags[flags.index("--oases-plan") + 1] == plan
    assert report["config"]["oases_plan"] == plan
    assert report["loss_check"]["ok"], report["loss_check"]
