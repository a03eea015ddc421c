"""``PlanSettings``: one frozen, checked value for a run's settings, the same whichever way it is
made (the CLI, keywords, a plan file read back)."""

import dataclasses

import pytest
from helpers.variants import h2048_profile

from megatron_oases.errors import OasesConfigError
from megatron_oases.planner.api import make_plan
from megatron_oases.planner.build import build_problem
from megatron_oases.planner.cli import build_parser
from megatron_oases.planner.evaluate import EvaluateFlags, evaluated_run
from megatron_oases.planner.prediction import predict
from megatron_oases.planner.settings import PlanSettings

TIMES = ("solve_time_s", "build_time_s")


@pytest.fixture(scope="module")
def h2048():
    return h2048_profile("rtx3090-nvlink")


def _untimed(plan):
    return {k: v for k, v in plan.items() if k not in TIMES}


def test_settings_are_frozen_and_normalised():
    s = PlanSettings(global_batch_size=128, pins=[([0, 1], 4)], degrees=[2, 4], recompute=True)
    assert (s.recompute, s.split, s.schedule) == ("full", "batch", "oases")
    assert s.pins == (((0, 1), 4),) and s.degrees == (2, 4)
    assert PlanSettings(global_batch_size=8, recompute=False, schedule="off").recompute == "none"
    with pytest.raises(dataclasses.FrozenInstanceError):
        s.schedule = "off"
    assert hash(s) == hash(dataclasses.replace(s))  # a value: usable as a key


@pytest.mark.parametrize(
    "fields, message",
    [
        (dict(schedule="oases", recompute="none"), "--schedule oases"),
        (dict(schedule="cross-pass", recompute="selective"), "--recompute full"),
        (dict(recompute="partial"), "unknown recompute setting 'partial'"),
        (dict(split="rows"), "--split"),
        (dict(margin=-0.1), "--margin must be ≥ 0"),
        (dict(memory_gb=0), "--memory must be positive"),
        (dict(max_switches=-1), "--max-switches must be ≥ 0"),
        (dict(host_us_per_call=-1.0), "--host-us-per-call must be >= 0"),
        (dict(schedule="auto", recompute="full"), "auto chooses the recompute setting"),
    ],
)
def test_bad_settings_are_one_line_when_made(fields, message):
    with pytest.raises(OasesConfigError, match=message) as info:
        PlanSettings(global_batch_size=128, **fields)
    assert "\n" not in str(info.value)


def test_from_args_is_the_cli_flags():
    argv = "--profile p.json --global-batch-size 64 --micro-batch-size 8 --memory 20 --schedule "
    argv += "overlap --no-recompute --degrees 4,2 --pin 0-1=4 --margin 0.2 --granule-mb 2"
    s = PlanSettings.from_args(build_parser().parse_args(argv.split()))
    assert (s.global_batch_size, s.micro_batch_size, s.memory_gb) == (64, 8, 20.0)
    assert (s.schedule, s.recompute, s.split) == ("overlap", "none", "batch")
    assert s.degrees == (2, 4) and s.pins == (((0, 1), 4),)
    assert (s.margin, s.granule) == (0.2, 2 * (1 << 20))
    auto = build_parser().parse_args("--global-batch-size 8 --schedule auto".split())
    assert PlanSettings.from_args(auto).split is None  # both splits are tried
    bad = build_parser().parse_args("--global-batch-size 8 --schedule auto --no-recompute".split())
    with pytest.raises(OasesConfigError, match="drop --no-recompute"):
        PlanSettings.from_args(bad)


def test_keywords_and_settings_make_the_same_plan(h2048):
    run = dict(global_batch_size=128, memory_gb=32, schedule="overlap", recompute="selective")
    by_keywords, problem, _ = make_plan(h2048, **run)
    by_settings, _, _ = make_plan(h2048, PlanSettings(**run))
    assert _untimed(by_keywords) == _untimed(by_settings)
    assert problem.settings == PlanSettings(**run)  # the problem hands the run back
    assert problem.settings.recompute == by_keywords["recompute"] == "selective"
    with pytest.raises(OasesConfigError, match="auto"):  # choose_plan's, not one schedule
        build_problem(h2048, PlanSettings(global_batch_size=128, schedule="auto"))


def test_predict_takes_settings_or_keywords(h2048):
    settings = PlanSettings(global_batch_size=128, micro_batch_size=16, recompute="full")
    a = predict(h2048, [2] * 12 + [4] * 12, settings=settings)
    b = predict(h2048, [2] * 12 + [4] * 12, "oases", 128, 16, recompute="full")
    assert a["iteration_time_s"] == b["iteration_time_s"]
    assert a["peak_memory_bytes"] == b["peak_memory_bytes"]
    other = predict(
        h2048, [2] * 12 + [4] * 12, settings=dataclasses.replace(settings, schedule="off")
    )
    assert other["iteration_time_s"] != a["iteration_time_s"]


def test_a_plan_reads_back_as_the_settings_that_made_it(h2048):
    made = PlanSettings(
        global_batch_size=128,
        memory_gb=32,
        schedule="cross-pass",
        recompute="full",
        recompute_layers=20,
        distributed_optimizer=True,
    )
    plan, problem, _ = make_plan(h2048, made)
    back = evaluated_run(plan, h2048, EvaluateFlags())
    same = ("global_batch_size", "schedule", "recompute", "recompute_layers", "split")
    same += ("sequence_parallel", "distributed_optimizer", "memory_gb", "margin")
    assert {f: getattr(back, f) for f in same} == {f: getattr(made, f) for f in same}
    assert back.micro_batch_size == problem.meta["micro_batch_size"]
