"""``PlanSettings``: one frozen, checked value for a run's settings, the same whichever way it is
made (the CLI's flags, a plan file read back, merged with flags or alone)."""

import dataclasses
import json
import math

import pytest
from helpers.variants import h2048_profile

from megatron_oases.errors import OasesConfigError
from megatron_oases.planner.api import make_plan
from megatron_oases.planner.build import build_problem
from megatron_oases.planner.evaluate import evaluated_run
from megatron_oases.planner.prediction import predict
from megatron_oases.planner.settings import PlanSettings
from megatron_oases.search.plan_cli import build_parser
from megatron_oases.validation import plan_differences, samples_per_group

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


def test_settings_are_the_one_way_in(h2048):
    """The entry points take a ``PlanSettings``, not its fields as keywords (nor ``predict``'s
    older positional schedule and batches); the problem hands the run back."""
    run = dict(global_batch_size=128, memory_gb=32, schedule="overlap", recompute="selective")
    plan, problem, _ = make_plan(h2048, PlanSettings(**run))
    assert problem.settings == PlanSettings(**run)  # the problem hands the run back
    assert problem.settings.recompute == plan["recompute"] == "selective"
    with pytest.raises(TypeError):
        make_plan(h2048, **run)
    with pytest.raises(TypeError):
        build_problem(h2048, **run)
    with pytest.raises(TypeError):
        predict(h2048, [4] * 24, "oases", 128, 16)
    with pytest.raises(OasesConfigError, match="auto"):  # choose_plan's, not one schedule
        build_problem(h2048, PlanSettings(global_batch_size=128, schedule="auto"))


def test_predict_takes_settings(h2048):
    settings = PlanSettings(global_batch_size=128, micro_batch_size=16, recompute="full")
    a = predict(h2048, [2] * 12 + [4] * 12, settings)
    b = predict(h2048, [2] * 12 + [4] * 12, dataclasses.replace(settings))
    assert a["iteration_time_s"] == b["iteration_time_s"]
    assert a["peak_memory_bytes"] == b["peak_memory_bytes"]
    other = predict(h2048, [2] * 12 + [4] * 12, dataclasses.replace(settings, schedule="off"))
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
    back = evaluated_run(plan, h2048)
    same = ("global_batch_size", "schedule", "recompute", "recompute_layers", "split")
    same += ("sequence_parallel", "distributed_optimizer", "memory_gb", "margin")
    assert {f: getattr(back, f) for f in same} == {f: getattr(made, f) for f in same}
    assert back.micro_batch_size == problem.meta["micro_batch_size"]
    # the plan alone (the runtime's reading) is the same run, its layout included
    alone = PlanSettings.from_plan(plan, path="p.json")
    assert {f: getattr(alone, f) for f in same if f != "memory_gb"} == {
        f: getattr(made, f) for f in same if f != "memory_gb"
    }
    layout = (h2048.tp, h2048.dp, 1)
    assert (
        alone.tensor_model_parallel_size,
        alone.data_parallel_size,
        alone.pipeline_model_parallel_size,
    ) == layout


def test_a_plan_merged_with_flags_keeps_each_values_source():
    plan = {"version": 1, "tensor_model_parallel_size": 4, "degrees": [4, 4], "schedule": "oases"}
    plan.update(global_batch_size=64, micro_batch_size=8, recompute="full")
    flags = build_parser().parse_args("--memory 20 --grad-sync --global-batch-size 64".split())
    run = PlanSettings.from_plan(plan, flags, path="p.json")
    assert (run.micro_batch_size, run.memory_gb, run.grad_sync) == (8, 20.0, True)
    assert run.source("micro_batch_size") == "plan p.json's micro_batch_size"
    assert run.recorded("micro_batch_size") and run.recorded("schedule")
    assert run.source("global_batch_size") == "--global-batch-size"  # given: the flag's
    assert not run.recorded("global_batch_size") and not run.recorded("memory_gb")
    assert run.source("split") == "--split" and not run.recorded("split")  # the default
    assert run == dataclasses.replace(run, sources=())  # the sources are not the value
    no_recompute = build_parser().parse_args(["--no-recompute"])
    with pytest.raises(OasesConfigError, match="--no-recompute contradicts plan p.json"):
        PlanSettings.from_plan(plan, no_recompute, path="p.json")


def test_a_plan_of_an_impossible_run_is_one_line_naming_the_file():
    """Read at training start (no flags), a hand-edited plan whose recorded run cannot be
    planned names the plan, not a flag of ``oases plan`` the user never typed."""
    plan = {"version": 1, "tensor_model_parallel_size": 2, "degrees": [2], "schedule": "oases"}
    with pytest.raises(OasesConfigError, match="plan p.json records a run that cannot be"):
        PlanSettings.from_plan(dict(plan, recompute="none"), path="p.json")


def test_settings_of_another_layout_than_the_profiles_are_refused(h2048):
    settings = PlanSettings(global_batch_size=128, data_parallel_size=h2048.dp * 2)
    with pytest.raises(OasesConfigError, match="data-parallel size of 16, but the profile has 8"):
        build_problem(h2048, settings)
    build_problem(h2048, dataclasses.replace(settings, data_parallel_size=h2048.dp))


@pytest.mark.parametrize(
    "fields, message",
    [
        (dict(memory_gb=math.nan), "--memory must be positive and finite"),
        (dict(memory_gb=math.inf), "--memory must be positive and finite"),
        (dict(memory_gb=1e300), "at most 100000 GB"),
        (dict(margin=math.nan), "--margin must be ≥ 0 and finite"),
        (dict(margin=1e300), "--margin must be ≥ 0 and finite"),
        (dict(granule=math.nan), "--granule-mb must be from"),
        (dict(granule=math.inf), "--granule-mb must be from"),
        (dict(host_us_per_call=math.nan), "--host-us-per-call must be >= 0"),
        (dict(host_us_per_call=math.inf), "--host-us-per-call must be >= 0"),
        (dict(global_batch_size=0), "--global-batch-size must be a positive integer"),
        (dict(global_batch_size=10**23), "--global-batch-size must be a positive integer"),
        (dict(micro_batch_size=0), "--micro-batch-size must be a positive integer"),
        (dict(micro_batch_size=2.5), "--micro-batch-size must be a positive integer"),
    ],
)
def test_numbers_are_finite_positive_and_bounded(fields, message):
    with pytest.raises(OasesConfigError, match=message) as info:
        PlanSettings(**{"global_batch_size": 128, **fields})
    assert "\n" not in str(info.value)


def test_the_samples_per_group_rule():
    """A degree-d layer's groups each take m·d/T of a TMP domain's micro-batch of m samples."""
    assert samples_per_group(8, 2, 4) == 4 and isinstance(samples_per_group(8, 2, 4), int)
    assert samples_per_group(2, 1, 4) == 0.5  # not whole: the fraction, for messages
    assert samples_per_group(1, 4, 4) == 1


def _oases_plan(argv, capsys):
    """``oases plan ARGV``'s exit status and stderr lines (its one error line where it fails)."""
    from megatron_oases.cli import main as oases

    capsys.readouterr()
    rc = oases(["plan", *argv])
    return rc, capsys.readouterr().err.strip().splitlines()


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--memory", "nan"], "--memory must be positive and finite"),
        (["--memory", "inf"], "--memory must be positive and finite"),
        (["--margin", "nan"], "--margin must be ≥ 0 and finite"),
        (["--granule-mb", "nan"], "--granule-mb must be from"),
        (["--granule-mb", "inf"], "--granule-mb must be from"),
        (["--host-us-per-call", "nan"], "--host-us-per-call must be >= 0"),
        (["--time-limit", "nan", "--solver", "ilp"], "--time-limit must be positive and finite"),
        (["--max-rows", "-1"], "--max-rows must be ≥ 0"),
        (["--micro-batch-size", "0"], "--micro-batch-size must be a positive integer"),
        (["--pin", "0-99999999999999=4"], "bad --pin '0-99999999999999=4'"),
        (["--global-batch-size", "99999999999999999999999"], "--global-batch-size must be a"),
    ],
)
def test_numeric_flags_are_finite_positive_bounded_one_line(
    tmp_path, capsys, h2048, extra, message
):
    prof = tmp_path / "profile.json"
    prof.write_text(json.dumps(h2048.data))
    argv = ["--profile", str(prof), "--global-batch-size", "128", "--memory", "24", "--quiet"]
    rc, err = _oases_plan(argv + extra, capsys)
    assert rc == 2 and len(err) == 1 and message in err[0], err


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    "extra, message",
    [
        (["--gpus", "99999999999999999999999"], "--gpus must be at most 65536"),
        (["--gpus", "4", "--memory", "nan"], "--memory must be positive and finite"),
        (["--gpus", "4", "--set", "num_layers=99999999999999999999"], "at most 1024 layers"),
    ],
)
def test_the_cluster_search_bounds_its_numbers(capsys, extra, message):
    """``--gpus`` was searched linearly (a huge N never returned), ``--memory nan`` was a
    traceback, a huge ``--set num_layers`` never returned: one line each, before the search."""
    argv = ["--cluster", "rtx3090-pcie", "--model", "h2048-l24", "--global-batch-size", "64"]
    rc, err = _oases_plan(argv + extra, capsys)
    assert rc == 2 and len(err) == 1 and message in err[0], err


def _megatron_args(**overrides):
    import argparse

    args = dict(micro_batch_size=4, global_batch_size=64, recompute_granularity="full")
    args.update(recompute_method="uniform", recompute_num_layers=1)
    args.update(pipeline_model_parallel_size=1, data_parallel_size=8, sequence_parallel=False)
    args.update(use_distributed_optimizer=False)
    return argparse.Namespace(**{**args, **overrides})


def test_the_plan_versus_run_warning_compares_the_layout_sp_and_optimizer():
    """The plan's PP, DP, SP and distributed-optimizer fields were not compared with the run."""
    plan = {"version": 1, "tensor_model_parallel_size": 4, "degrees": [2, 4], "schedule": "oases"}
    plan.update(micro_batch_size=4, global_batch_size=64, recompute="full")
    plan.update(pipeline_model_parallel_size=2, data_parallel_size=4)
    plan.update(sequence_parallel=True, distributed_optimizer=True)
    planned = PlanSettings.from_plan(plan, path="p.json")
    assert plan_differences(planned, _megatron_args(), "oases") == [
        ("--pipeline-model-parallel-size", 2, 1),
        ("--sequence-parallel", "on", "off"),
        ("--use-distributed-optimizer", "on", "off"),
        ("data-parallel size", 4, 8),
    ]
    same = _megatron_args(
        pipeline_model_parallel_size=2,
        data_parallel_size=4,
        sequence_parallel=True,
        use_distributed_optimizer=True,
    )
    assert plan_differences(planned, same, "oases") == []
    # what a plan does not record is not compared (a hand-written plan: degrees only)
    bare = PlanSettings.from_plan({"version": 1, "tensor_model_parallel_size": 4, "degrees": [4]})
    assert plan_differences(bare, _megatron_args(), "overlap") == []


def test_the_plan_versus_run_warning_is_one_line_naming_both(tmp_path, capsys, monkeypatch):
    from megatron_oases.config import _warn_plan_differences

    monkeypatch.setenv("RANK", "0")
    plan = {"version": 1, "tensor_model_parallel_size": 4, "degrees": [2, 4], "schedule": "oases"}
    plan.update(data_parallel_size=4, distributed_optimizer=True)
    plan["model_shape"] = {"num_layers": 2}  # a plan without one gets a note too (test_plan_shape)
    capsys.readouterr()
    _warn_plan_differences("p.json", plan, _megatron_args(), "oases")
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    assert "was made for --use-distributed-optimizer on, data-parallel size 4" in err[0]
    assert "this run has --use-distributed-optimizer off, data-parallel size 8" in err[0]


def test_memory_beyond_the_solvers_counts_is_one_line_not_a_fit(h2048):
    """A model of absurd sizes (``--set seq_length=2**60``) needed more granules than an int64
    holds: the wrapped counts made every plan fit (a "winner" of 10^30 GB per GPU)."""
    from megatron_oases.planner.api import solve

    problem = build_problem(h2048, PlanSettings(global_batch_size=128, memory_gb=24))
    problem.mem_add = problem.mem_add * 1e20
    with pytest.raises(OasesConfigError, match="beyond what the planner counts"):
        solve(problem)
