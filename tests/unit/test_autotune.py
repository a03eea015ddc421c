"""``--oases-schedule auto`` without process groups: which candidates a command line allows, the
one-line refusals, the trial's order, drops and choice, and the tuner's step loop on a fake
``train_step`` (a failed candidate dropped, its micro-batches and RNG state handed to the retry;
a resumed choice kept). The multi-rank behaviour is ``tests/e2e/test_autotune_e2e.py``."""

import argparse

import pytest
import torch
from helpers import GPT, RECOMPUTE
from helpers.runs import parse, parse_config

from megatron_oases.errors import OasesConfigError
from megatron_oases.tuning import runtime
from megatron_oases.tuning.candidates import (
    MIN_TRIAL,
    STEPS_PER_CANDIDATE,
    STOCK,
    AutoTune,
    Candidate,
    Trial,
    format_table,
    plan_autotune,
)

TP2 = GPT.format(layers=2) + "--tensor-model-parallel-size 2 --global-batch-size 4 "


def names(config):
    return [c.name for c in config.autotune.candidates]


# ------------------------------------------------------------------------------- candidates


def test_candidates_follow_the_users_flags():
    """Stock and overlap always; cross-pass and oases only under the user's full recompute; 4
    sub-batches only where the micro-batch holds 4; one count where --oases-sub-batches is given;
    no split candidate at TP 1 (nothing to overlap)."""
    keep = parse_config(TP2 + "--micro-batch-size 2 --oases-schedule auto --train-iters 400", 2)
    assert names(keep) == ["off", "overlap"] and keep.overlapped
    full = parse_config(
        TP2 + RECOMPUTE + "--micro-batch-size 4 --oases-schedule auto --train-iters 400", 2
    )
    assert names(full) == [
        "off", "oases", "overlap", "cross-pass", "oases x4", "overlap x4", "cross-pass x4"
    ]  # fmt: skip
    assert full.recompute_granularity == "full"  # candidates never change the recompute setting
    given = parse_config(
        TP2 + "--micro-batch-size 4 --oases-schedule auto --oases-sub-batches 3 --train-iters 400",
        2,
    )
    assert names(given) == ["off", "overlap x3"]
    tp1 = parse_config(
        GPT.format(layers=2) + "--micro-batch-size 2 --oases-schedule auto --train-iters 400", 1
    )
    assert names(tp1) == ["off"] and not tp1.overlapped
    assert "--tensor-model-parallel-size 1" in tp1.autotune.excluded[0][1]


def test_a_split_only_flag_no_candidate_can_run_is_one_line():
    for flags, match in [
        (
            "--micro-batch-size 1 --oases-split sequence --sequence-parallel",
            "--oases-schedule auto with --oases-split sequence: no split schedule can run here: "
            "--oases-split sequence does not support --sequence-parallel",
        ),
        ("--micro-batch-size 2 --oases-cuda-graphs", "needs a CUDA GPU"),
    ]:
        with pytest.raises(OasesConfigError, match=match):
            parse(TP2 + flags + " --oases-schedule auto --train-iters 400", 2)
    # without such a flag a run no split schedule fits is stock, not refused
    one = parse_config(TP2 + "--micro-batch-size 1 --oases-schedule auto --train-iters 400", 2)
    assert names(one) == ["off"] and "cannot be split" in one.autotune.excluded[0][1]


@pytest.mark.parametrize(
    "flags,match",
    [
        ("--train-iters 40 --oases-tune-steps 50", "--oases-tune-steps 50 is longer than the run"),
        ("--train-iters 400 --oases-tune-steps 7", "--oases-tune-steps 7 is too short"),
        ("--train-iters 100", r"at most 5% of --train-iters 100 \(5 steps\)"),
        ("--oases-schedule off --oases-tune-steps 8", "add --oases-schedule auto or drop"),
        ("--oases-schedule overlap --oases-retune", "add --oases-schedule auto or drop"),
    ],
)
def test_a_trial_that_does_not_fit_is_one_line(flags, match):
    schedule = "" if "--oases-schedule" in flags else "--oases-schedule auto "
    with pytest.raises(OasesConfigError, match=match):
        parse(TP2 + "--micro-batch-size 2 " + schedule + flags, 2)


def test_the_default_trial_is_a_few_per_cent_of_the_run():
    config = parse_config(TP2 + "--micro-batch-size 2 --oases-schedule auto --train-iters 1000", 2)
    assert config.autotune.budget == 2 * STEPS_PER_CANDIDATE  # everything: 8 of 1000
    config = parse_config(
        TP2 + RECOMPUTE + "--micro-batch-size 4 --oases-schedule auto --train-iters 200", 2
    )
    assert config.autotune.budget == 10  # 5 % of 200: stock and one schedule fit
    assert [c.name for c in Trial(config.autotune.candidates, 10).tried] == ["off", "oases"]


def test_candidates_are_checked_by_the_schedule_rules():
    """A candidate is eligible exactly when pinning it passes the validation rules."""
    args = parse(TP2 + RECOMPUTE + "--micro-batch-size 2 --train-iters 400", 2)
    args.oases_schedule, args.oases_tune_steps = "auto", None
    tune = plan_autotune(args)
    assert [c.name for c in tune.candidates] == ["off", "oases", "overlap", "cross-pass"]
    assert [n for n, _ in tune.excluded] == ["oases x4", "overlap x4", "cross-pass x4"]
    assert all("micro-batch 2 cannot be split" in why for _, why in tune.excluded)


def test_a_candidate_pins_with_its_flags():
    assert STOCK.flags() == "--oases-schedule off"
    c = Candidate("oases", 4, "capture")
    assert c.name == "oases x4 +graphs"
    assert c.flags() == "--oases-schedule oases --oases-sub-batches 4 --oases-cuda-graphs"
    assert Candidate.from_dict(c.as_dict()) == c and Candidate.from_dict({"x": 1}) is None


# ------------------------------------------------------------------------------------ trial

A, B, C = STOCK, Candidate("overlap"), Candidate("oases")


def run(trial, times, fail=()):
    """Drive ``trial`` with per-candidate step times (a list per candidate, consumed in order);
    ``fail``: candidates whose first step fails. Returns the candidates of the iterations."""
    times = {c: list(t) for c, t in times.items()}
    seen, failing = [], set(fail)
    while (c := trial.next()) is not None:
        if c in failing:
            failing.discard(c)
            trial.fail(c, "injected")
            continue
        seen.append(c)
        trial.record(c, times[c].pop(0))
    return seen


def test_candidates_run_interleaved_and_the_median_decides():
    trial = Trial([A, B, C], 3 * STEPS_PER_CANDIDATE)
    t = {A: [9, 1.00, 1.01, 0.99], B: [9, 0.95, 0.80, 0.96], C: [9, 0.97, 0.98, 0.90]}
    seen = run(trial, t)
    assert seen == [A, B, C] * 4  # a warm-up round (untimed), then three timed rounds
    assert trial.choice == B and trial.median(B) == 0.95  # medians: A 1.00, B 0.95, C 0.97
    rows = trial.rows()
    assert [r["status"] for r in rows] == ["", "chosen", ""] and rows[1]["timed"] == 3
    assert rows[1]["vs_stock"] == pytest.approx(0.95)
    assert "chosen" in format_table(rows)[2]


def test_a_clearly_slower_candidate_is_dropped_after_two_rounds():
    trial = Trial([A, B, C], 3 * STEPS_PER_CANDIDATE)
    seen = run(trial, {A: [1, 1.0, 1.0, 1.0], B: [1, 0.95, 0.95, 0.95], C: [1, 1.5, 1.6]})
    assert seen == [A, B, C, A, B, C, A, B, C, A, B]  # C gets no third timed step
    assert trial.out[C] == ("dropped", "slower") and trial.choice == B
    assert trial.steps == len(seen)


def test_stock_stays_unless_beaten_by_more_than_noise():
    trial = Trial([A, B], 2 * STEPS_PER_CANDIDATE)
    run(trial, {A: [1, 1.00, 1.00, 1.00], B: [1, 0.99, 0.99, 0.99]})
    assert trial.choice == A


def test_a_failed_candidate_is_dropped_and_the_iteration_runs_again():
    trial = Trial([A, B, C], 3 * STEPS_PER_CANDIDATE)
    seen = run(trial, {A: [1, 1, 1, 1], C: [1, 0.95, 0.95, 0.95]}, fail=[B])
    assert seen == [A, C] * 4  # B's failed attempt is no iteration: C takes it over
    assert trial.out[B] == ("failed", "injected") and trial.choice == C
    only = Trial([A, B], 2 * STEPS_PER_CANDIDATE)
    assert run(only, {A: [1]}, fail=[B]) == [A] and only.choice == A  # nothing left to time


def test_the_budget_decides_how_many_are_tried():
    trial = Trial([A, B, C], 2 * STEPS_PER_CANDIDATE + 3)
    assert trial.tried == [A, B] and trial.untried == [C]
    run(trial, {A: [1, 1, 1, 1], B: [1, 2, 2, 2]})
    assert trial.steps <= 2 * STEPS_PER_CANDIDATE
    assert [r["status"] for r in trial.rows()] == ["chosen", "dropped: slower", "not tried: budget"]


# ------------------------------------------------------------------- the tuner's step loop


class Selection:
    """The schedule patch's LayerSchedule, as the tuner sees it."""

    schedule, parts, graphs = "off", 2, None

    def select(self, schedule, parts=2, graphs=None):
        self.schedule, self.parts, self.graphs = schedule, parts, graphs


class FakeStep:
    """Megatron's ``train_step`` on fake data: two micro-batches per step; ``fail`` (schedule
    names) raise inside the forward-backward after both micro-batches were fetched and a random
    number was drawn (dropout)."""

    def __init__(self, selection, fail=()):
        self.selection, self.fail = selection, set(fail)
        self.calls = []  # (schedule, micro-batches, random draw) per call

    def forward_backward(self, data_iterator):
        """Megatron's forward_backward_func, as ``train()`` hands it to ``train_step``."""
        batches = [next(data_iterator), next(data_iterator)]
        draw = torch.rand(()).item()
        self.calls.append((self.selection.schedule, batches, draw))
        if self.selection.schedule in self.fail:
            self.fail.discard(self.selection.schedule)
            raise RuntimeError("CUDA out of memory (injected)\nsecond line")
        return batches

    def __call__(self, fs, data, model, opt, sched, config, forward_backward, iteration=None):
        return ({"lm loss": forward_backward(data_iterator=data)},)

    def args(self, data):
        return (None, data, None, None, None, None, self.forward_backward)


@pytest.fixture
def megatron_args(monkeypatch):
    """Megatron's global args (what the tuner writes its record into) and a fresh rerun state
    machine, put back afterwards."""
    import megatron.training
    from megatron.core import rerun_state_machine

    args = argparse.Namespace()
    monkeypatch.setattr(megatron.training, "get_args", lambda: args)
    monkeypatch.setattr(rerun_state_machine, "_GLOBAL_RERUN_STATE_MACHINE", None)
    return args


def drive(tuner, step, iterations, data):
    out = []
    for i in range(iterations):
        out.append(tuner.train_step(step, step.args(data), {"iteration": i}))
    return out


def test_a_failed_candidate_retries_the_step_on_its_micro_batches(megatron_args, capsys):
    settings = AutoTune(candidates=(A, B, C), budget=12, train_iters=20)
    selection = Selection()
    step = FakeStep(selection, fail=["overlap"])
    tuner = runtime.Tuner(settings, selection)
    drive(tuner, step, 10, iter(range(1000)))
    schedules = [s for s, _, _ in step.calls]
    assert schedules[:4] == ["off", "overlap", "oases", "off"]  # overlap failed, oases retried
    failed, retry = step.calls[1], step.calls[2]
    assert retry[1] == failed[1] == [2, 3]  # the same micro-batches, none skipped
    assert retry[2] == failed[2]  # the same random draws (dropout masks)
    consumed = [b for _, batches, _ in step.calls[:1] + step.calls[2:] for b in batches]
    assert consumed == list(range(20))  # in order, each once
    assert tuner.fixed is not None and tuner.trial.out[B][0] == "failed"
    record = megatron_args.oases_autotune  # saved with every checkpoint from here on
    assert record["choice"] == tuner.fixed.as_dict() and record["how"] == "timed"
    out = capsys.readouterr().out
    assert out.count("overlap failed on rank(s) 0 (RuntimeError: CUDA out of memory") == 1
    assert "iteration 2 runs again with the next candidate" in out
    assert f"to pin it: {tuner.fixed.flags()}" in out


def test_stock_failing_is_the_runs_own_failure(megatron_args):
    selection = Selection()
    tuner = runtime.Tuner(AutoTune(candidates=(A, B), budget=8, train_iters=20), selection)
    with pytest.raises(RuntimeError, match="CUDA out of memory"):
        drive(tuner, FakeStep(selection, fail=["off"]), 1, iter(range(100)))


def test_a_resumed_run_keeps_its_choice_unless_retuned(megatron_args, capsys):
    saved = argparse.Namespace(oases_autotune={"choice": C.as_dict(), "how": "timed"})
    settings = AutoTune(candidates=(A, B, C), budget=12, train_iters=40)
    selection = Selection()
    kept = runtime.Tuner(settings, selection)
    kept.checkpoint_args(saved)
    step = FakeStep(selection)
    drive(kept, step, 2, iter(range(100)))
    assert kept.fixed == C and kept.trial is None and [s for s, _, _ in step.calls] == ["oases"] * 2
    assert "kept oases from the checkpoint" in capsys.readouterr().out
    assert megatron_args.oases_autotune["choice"] == C.as_dict()  # the next save keeps it too
    retuned = runtime.Tuner(AutoTune(candidates=(A, B, C), budget=12, retune=True), Selection())
    retuned.checkpoint_args(saved)
    drive(retuned, FakeStep(retuned.selection), 1, iter(range(100)))
    assert retuned.trial is not None and retuned.fixed is None
    gone = runtime.Tuner(AutoTune(candidates=(A, B), budget=8), Selection())  # oases not allowed
    gone.checkpoint_args(saved)
    drive(gone, FakeStep(gone.selection), 1, iter(range(100)))
    assert gone.trial is not None and "cannot run with this command line" in capsys.readouterr().out


def test_too_few_iterations_left_run_stock(megatron_args, capsys):
    selection = Selection()
    tuner = runtime.Tuner(AutoTune(candidates=(A, B), budget=8, train_iters=20), selection)
    step = FakeStep(selection)
    tuner.train_step(step, step.args(iter(range(10))), {"iteration": 15})
    assert 20 - 15 < MIN_TRIAL
    assert tuner.fixed == STOCK and "5 iterations left" in capsys.readouterr().out
