"""``evaluate_plan``: ``oases plan --evaluate`` without the command line (its flags as any object
with some of their names, or none)."""

import math
from types import SimpleNamespace

import pytest

from megatron_oases.cli import main as oases
from megatron_oases.errors import OasesConfigError
from megatron_oases.formats.plan import load_plan
from megatron_oases.formats.profile import load_profile
from megatron_oases.planner.evaluate import evaluate_plan


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    d = tmp_path_factory.mktemp("evaluate")
    prof, plan = str(d / "p.json"), str(d / "plan.json")
    argv = ["profile", "--model", "tiny-cpu", "--analytic", "--cluster", "rtx3090-pcie"]
    assert oases(argv + ["--set", "num_layers=8", "--out", prof]) == 0
    argv = ["plan", "--profile", prof, "--global-batch-size", "8", "--quiet"]
    assert oases(argv + ["--distributed-optimizer", "--out", plan]) == 0
    return load_profile(prof), load_plan(plan), prof, plan


def test_evaluate_plan_predicts_the_plan_as_made(made):
    profile, plan, prof, path = made
    out = evaluate_plan(plan, profile, None, path, prof)
    run = out["run"]  # the plan's run, read back as one PlanSettings
    assert run.distributed_optimizer is True
    assert run.schedule == plan["schedule"]
    assert run.global_batch_size == plan["global_batch_size"] and out["problem"].settings == run
    assert math.isclose(
        out["iteration_time_s"], plan["predicted"]["iteration_time_s"], rel_tol=1e-9
    )
    peak = plan["predicted"]["peak_memory_bytes_per_rank"]
    assert math.isclose(out["prediction"]["peak_memory_bytes"], peak, rel_tol=1e-9)
    assert out["fits"] is True
    assert len(out["ks"]) == len(plan["degrees"])


def test_evaluate_plan_refuses_a_contradicting_setting(made):
    profile, plan, prof, path = made
    other = "off" if plan["schedule"] != "off" else "oases"
    with pytest.raises(OasesConfigError, match=f"--schedule {other} contradicts plan"):
        evaluate_plan(plan, profile, SimpleNamespace(schedule=other), path, prof)
    bad = dict(plan, degrees=plan["degrees"][:-1])
    with pytest.raises(OasesConfigError, match="layer degrees but profile"):
        evaluate_plan(bad, profile, None, path, prof)
