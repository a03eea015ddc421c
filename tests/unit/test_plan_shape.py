"""A plan records the model it was made for and nothing it does not know: a run of another layer
shape is refused, of another sequence length or vocabulary warned of; a plan written before plans
recorded the shape loads with a note; an unknown key is refused, the known ones named (a mistyped
optional key was ignored in silence, and a plan for hidden size 2048 ran a 1024 model unwarned)."""

import glob
import json
import os
from pathlib import Path

import pytest

from megatron_oases.cli import main as oases
from megatron_oases.errors import OasesConfigError
from megatron_oases.formats.plan import (
    MODEL_SHAPE,
    PLAN_FILE_KEYS,
    load_plan,
    save_plan,
    uniform_plan,
    validate_plan,
)
from megatron_oases.formats.profile import load_profile

ROOT = Path(__file__).resolve().parents[2]
#: The demo model of :func:`helpers.runs.parse_config` (``with_defaults(demo=True)``, mock data):
#: the shape a plan for it records.
DEMO_SHAPE = dict(num_layers=2, hidden_size=64, num_attention_heads=4, ffn_hidden_size=256)
DEMO_SHAPE.update(seq_length=32, padded_vocab_size=512)


def _plan(**extra):
    plan = uniform_plan(2, 2, schedule="overlap")
    plan["model_shape"] = dict(DEMO_SHAPE)
    plan.update(extra)
    return plan


def _written(tmp_path, plan, name="plan.json"):
    path = tmp_path / name
    path.write_text(json.dumps(plan))
    return str(path)


def _stderr_lines(capsys):
    return [ln for ln in capsys.readouterr().err.splitlines() if ln.startswith("oases: ")]


# ------------------------------------------------------------------------------- unknown keys
def test_an_unknown_plan_key_is_one_line_naming_the_near_miss_and_the_known_keys(tmp_path):
    path = _written(tmp_path, _plan(micro_batch=4))  # for micro_batch_size: was ignored
    with pytest.raises(OasesConfigError) as err:
        load_plan(path)
    line = str(err.value)
    assert "\n" not in line and line.startswith(f"{path}: unknown key 'micro_batch'")
    assert "(did you mean 'micro_batch_size'?)" in line
    assert "a plan's keys are " + ", ".join(PLAN_FILE_KEYS) in line


def test_many_unknown_keys_are_named_up_to_five():
    plan = _plan(**{f"note{i}": i for i in range(7)})
    with pytest.raises(OasesConfigError, match=r"unknown keys 'note0', .*'note4' and 2 more; "):
        validate_plan(plan, source="p.json")


def test_an_unknown_or_bad_shape_key_is_refused():
    with pytest.raises(
        OasesConfigError, match="unknown key 'hidden'; model_shape's keys are num_layers, "
    ):
        validate_plan(_plan(model_shape={"hidden": 64}), source="p.json")
    with pytest.raises(OasesConfigError, match="model_shape.seq_length must be a positive integer of at most"):
        validate_plan(_plan(model_shape={"seq_length": 0}), source="p.json")
    with pytest.raises(OasesConfigError, match="model_shape must be a mapping or null"):
        validate_plan(_plan(model_shape=[64]), source="p.json")


def test_save_plan_refuses_an_unknown_key(tmp_path):
    with pytest.raises(OasesConfigError, match="unknown key 'commment'"):
        save_plan(_plan(commment="x"), str(tmp_path / "p.json"))
    assert not (tmp_path / "p.json").exists()


def test_the_committed_plans_still_load(tmp_path):
    """Plans written before plans recorded a shape (benchmarks/results/validation/plans)."""
    paths = sorted(glob.glob(str(ROOT / "benchmarks" / "**" / "*.json"), recursive=True))
    paths += sorted(glob.glob(str(ROOT / "tests" / "**" / "*.json"), recursive=True))
    plans = []
    for path in paths:
        with open(path) as f:
            data = json.load(f)
        if isinstance(data, dict) and {"version", "degrees"} <= set(data) and "comm" not in data:
            plans.append(path)
    assert len(plans) >= 18, plans
    for path in plans:
        assert "model_shape" not in load_plan(path)


# ----------------------------------------------------------------------- written with the shape
@pytest.fixture(scope="module")
def made(tmp_path_factory):
    d = tmp_path_factory.mktemp("shape")
    prof, plan = str(d / "p.json"), str(d / "plan.json")
    argv = ["profile", "--model", "tiny-cpu", "--analytic", "--cluster", "rtx3090-pcie"]
    assert oases(argv + ["--set", "num_layers=8", "--out", prof]) == 0
    assert (
        oases(["plan", "--profile", prof, "--global-batch-size", "8", "--quiet", "--out", plan])
        == 0
    )
    return load_profile(prof), load_plan(plan), prof, plan


def test_oases_plan_records_the_models_shape(made):
    profile, plan, _, _ = made
    assert plan["model_shape"] == {key: profile.shape[key] for key in MODEL_SHAPE}
    assert plan["model_shape"]["num_layers"] == len(plan["degrees"]) == 8


def test_evaluate_refuses_a_profile_of_another_shape(made, tmp_path):
    from megatron_oases.planner.evaluate import evaluate_plan

    profile, plan, prof, path = made
    other = dict(plan, model_shape=dict(plan["model_shape"], hidden_size=2048))
    with pytest.raises(OasesConfigError) as err:
        evaluate_plan(other, profile, None, path, prof)
    hidden = profile.shape["hidden_size"]
    assert f"plan {path} was made for a model of --hidden-size 2048 but profile {prof} is of " in (
        str(err.value)
    ) and f"--hidden-size {hidden};" in str(err.value)
    evaluate_plan(plan, profile, None, path, prof)  # its own profile: predicted


# --------------------------------------------------------------------------------- at run time
def _config(tmp_path, plan, extra=""):
    from helpers.runs import parse_config

    path = _written(tmp_path, plan)
    argv = f"--tensor-model-parallel-size 2 --mock-data --oases-schedule overlap {extra}"
    return parse_config(f"{argv} --oases-plan {path}", world_size=2), path


@pytest.mark.parametrize(
    "flags, named",
    [
        (
            "--hidden-size 128 --ffn-hidden-size 256",
            "--hidden-size 64; this run has --hidden-size 128",
        ),
        (  # Megatron's FFN follows the hidden size: both named
            "--hidden-size 128",
            "--hidden-size 64, --ffn-hidden-size 256; this run has --hidden-size 128, "
            "--ffn-hidden-size 512",
        ),
        (
            "--num-attention-heads 8",
            "--num-attention-heads 4; this run has --num-attention-heads 8",
        ),
        ("--ffn-hidden-size 128", "--ffn-hidden-size 256; this run has --ffn-hidden-size 128"),
    ],
)
def test_a_run_of_another_layer_shape_is_refused(tmp_path, monkeypatch, flags, named):
    monkeypatch.setenv("RANK", "0")
    with pytest.raises(OasesConfigError) as err:
        _config(tmp_path, _plan(), flags)
    line = str(err.value)
    assert "\n" not in line and "was made for a model of " + named in line
    assert "re-plan for this model" in line


def test_the_same_shape_runs_without_a_word(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("RANK", "0")
    capsys.readouterr()
    _config(tmp_path, _plan())
    assert _stderr_lines(capsys) == []


@pytest.mark.parametrize(
    "flags, named",
    [
        ("--seq-length 16", "made for --seq-length 32; this run has --seq-length 16"),
        (
            "--vocab-size 1000",
            "made for padded vocabulary 512; this run has padded vocabulary 1024",
        ),
    ],
)
def test_another_sequence_or_vocabulary_is_one_warning(tmp_path, monkeypatch, capsys, flags, named):
    monkeypatch.setenv("RANK", "0")
    capsys.readouterr()
    _config(tmp_path, _plan(), flags)
    lines = _stderr_lines(capsys)
    assert len(lines) == 1 and lines[0].startswith("oases: warning: --oases-plan ")
    assert named in lines[0]


def test_a_plan_without_a_shape_loads_with_one_note(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("RANK", "0")
    plan = _plan()
    del plan["model_shape"]
    capsys.readouterr()
    _config(tmp_path, plan, "--hidden-size 128")  # not known: not compared
    lines = _stderr_lines(capsys)
    assert len(lines) == 1 and lines[0].startswith("oases: note: --oases-plan ")
    assert "records no model shape" in lines[0]
    monkeypatch.setenv("RANK", "1")  # once per job: rank 0 says it
    _config(tmp_path, plan)
    assert _stderr_lines(capsys) == []


def test_the_runtime_refuses_an_unknown_key(tmp_path, monkeypatch):
    monkeypatch.setenv("RANK", "0")
    with pytest.raises(OasesConfigError, match="unknown key 'shedule' \\(did you mean 'schedule'"):
        _config(tmp_path, _plan(shedule="oases"))


def test_the_runtime_reads_no_planner_code():
    """The runtime's plan reading (config.py) imports the plan format, not the planner."""
    import subprocess
    import sys

    code = (
        "import sys, megatron_oases.config as c, megatron_oases.formats.plan as p;"
        "c._warn_plan_differences('p.json', p.uniform_plan(2, 2), object(), 'off');"
        "print(sorted(m for m in sys.modules if m.startswith('megatron_oases.planner')))"
    )
    env = dict(os.environ, RANK="1")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "[]"
