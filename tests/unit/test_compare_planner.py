"""``oases compare``: the ``oases+planner`` variant (schedule oases with compare's --oases-plan):
available, and refused without a valid plan. A run of it: ``tests/e2e/test_compare_planner_e2e.py``.
"""

# Megatron's first import logs library start-up warnings (no CUDA, no APEX): import it here, not in
# the middle of a test that checks its stderr.
import megatron.training.arguments  # noqa: F401,E402  isort: skip

from helpers.plans import compare_plan
from helpers.variants import COMPARE_PLANNER_TINY as TINY

from megatron_oases.cli import main as oases_main
from megatron_oases.compare.variants import VARIANTS, parse_variants


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
    plan = compare_plan(tmp_path)
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
    bad = compare_plan(tmp_path, degrees=(1, 2, 2))
    _one_line_error(
        capsys, ["--variants", "oases+planner", "--oases-plan", bad, *out, "--", *TINY], "layers"
    )
    assert not (tmp_path / "o" / "oases+planner").exists()
