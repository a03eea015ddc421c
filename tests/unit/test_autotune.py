"""``--oases-schedule auto`` without process groups: which candidates a command line allows, the
one-line refusals, the trial's order, drops and choice, and the tuner's step loop on a fake
``train_step`` (a failed candidate dropped, its micro-batches and RNG state handed to the retry;
a resumed choice kept), ``--oases-retune-interval``'s re-timings (when, against whom, when
they switch, their refusals), and the tuner's parts alone: ``train_step``'s call by name, the
retry, the agreement over a fake world. The multi-rank behaviour is
``tests/e2e/test_autotune_e2e.py``."""

import argparse
import types

import pytest
import torch
from helpers import GPT, RECOMPUTE
from helpers.runs import parse, parse_config

from megatron_oases.errors import OasesConfigError
from megatron_oases.tuning import runtime
from megatron_oases.tuning.candidates import (
    EXTRA_ROUNDS,
    MIN_TRIAL,
    NOISE_STEPS,
    RETUNE_STEPS,
    STEPS_PER_CANDIDATE,
    STOCK,
    AutoTune,
    Candidate,
    Trial,
    format_retune,
    format_table,
    next_retune,
    noise,
    plan_autotune,
    retune_entry,
    runner_up,
    within_noise,
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
        ("--train-iters 100", "at most 5% of --train-iters 100: 5 steps"),
        ("--oases-schedule off --oases-tune-steps 8", "add --oases-schedule auto or drop"),
        ("--oases-schedule overlap --oases-retune", "add --oases-schedule auto or drop"),
        (
            "--oases-schedule off --oases-retune-interval 20",
            "--oases-retune-interval 20 has no effect under --oases-schedule off: .*; add "
            "--oases-schedule auto or drop",
        ),
        ("--train-iters 400 --oases-retune-interval 0", "N must be a positive number"),
        ("--train-iters 400 --oases-retune-interval -5", "N must be a positive number"),
        ("--train-iters 400 --oases-retune-interval 7", "--oases-retune-interval 7 is too short"),
        (
            "--train-iters 400 --oases-retune-interval 394",
            "--oases-retune-interval 394 leaves no room for a re-timing in --train-iters 400.*"
            "use at most 393",
        ),
    ],
)
def test_a_trial_that_does_not_fit_is_one_line(flags, match):
    schedule = "" if "--oases-schedule" in flags else "--oases-schedule auto "
    with pytest.raises(OasesConfigError, match=match):
        parse(TP2 + "--micro-batch-size 2 " + schedule + flags, 2)


def test_auto_under_train_samples_is_decided_on_megatrons_iteration_count():
    """``--train-samples`` instead of ``--train-iters`` (issue 60.5): the trial is planned on the
    iterations Megatron derives (``update_train_iters``: samples // global batch), not on an
    unknown length (the trial ran past a short run's end, never deciding, saying nothing)."""
    from megatron.training.training import update_train_iters

    base = TP2 + "--micro-batch-size 2 --oases-schedule auto --lr-decay-samples 64 "
    args = parse(base + "--train-samples 4002", 2)
    config = parse_config(base + "--train-samples 4002", 2)
    update_train_iters(args)  # what Megatron's loop will run
    assert args.train_iters == 1000 == config.autotune.train_iters
    assert config.autotune.budget == 2 * STEPS_PER_CANDIDATE + NOISE_STEPS
    # a run too short for the default trial: one line naming the samples and their iterations
    with pytest.raises(OasesConfigError) as err:
        parse(base + "--train-samples 64", 2)
    assert "--train-samples 64 (16 iterations at --global-batch-size 4)" in str(err.value)
    assert "\n" not in str(err.value)
    with pytest.raises(OasesConfigError, match="use at most 16, or pin"):
        parse(base + "--train-samples 64 --oases-tune-steps 20", 2)
    assert parse_config(base + "--train-samples 64 --oases-tune-steps 8", 2).autotune.budget == 8
    with pytest.raises(OasesConfigError, match="leaves no room for a re-timing in --train-samples"):
        parse(base + "--train-samples 4002 --oases-retune-interval 999", 2)


def test_auto_under_a_batch_size_schedule_and_train_samples_names_train_iters():
    """``--step-batch-size-schedule``: Megatron counts the iterations only by stepping through
    the schedule as it trains; auto asks for the length in iterations."""
    flags = (
        GPT.format(layers=2) + "--tensor-model-parallel-size 2 --micro-batch-size 2 "
        "--oases-schedule auto --train-samples 4000 --lr-decay-samples 64 "
        "--step-batch-size-schedule '0:2 100:4'"
    )
    with pytest.raises(
        OasesConfigError, match="--step-batch-size-schedule.*--train-iters N"
    ) as err:
        parse(flags, 2)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize(
    "flags,match",
    [
        (
            "--train-iters 3",
            "--train-iters 3 is too short for --oases-schedule auto: its trial takes at least 8 "
            r"iterations .*; use --train-iters 160 or more \(or --train-iters 8 or more with "
            r"--oases-tune-steps 8\), or pin a schedule with --oases-schedule",
        ),
        (
            "--train-iters 3 --oases-tune-steps 8",
            "--train-iters 3 is too short for --oases-schedule auto: .*use --train-iters 8 or more",
        ),
        ("--train-iters 100", r"add --oases-tune-steps N \(8 <= N <= 100\)"),
    ],
)
def test_a_run_too_short_for_any_trial_names_what_to_do(flags, match):
    """auto with ``--train-iters 3`` suggested ``--oases-tune-steps N (8 <= N <= 3)``, an empty
    range (issue 60.6): a run shorter than the shortest trial says to lengthen it or pin."""
    with pytest.raises(OasesConfigError, match=match) as err:
        parse(TP2 + "--micro-batch-size 2 --oases-schedule auto " + flags, 2)
    assert "<= 3)" not in str(err.value) and "at most 3" not in str(err.value)


def test_the_retune_interval_reaches_the_settings():
    base = TP2 + "--micro-batch-size 2 --oases-schedule auto --train-iters 400"
    assert parse_config(base, 2).autotune.retune_interval is None
    for n in (RETUNE_STEPS + 1, 400 - RETUNE_STEPS):  # the bounds the refusals leave
        config = parse_config(base + f" --oases-retune-interval {n}", 2)
        assert config.autotune.retune_interval == n


def test_the_default_trial_is_a_few_per_cent_of_the_run():
    config = parse_config(TP2 + "--micro-batch-size 2 --oases-schedule auto --train-iters 1000", 2)
    # everything, and room to time the best two again: 14 of 1000
    assert config.autotune.budget == 2 * STEPS_PER_CANDIDATE + NOISE_STEPS
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


def test_within_noise_is_the_medians_closer_than_their_spread():
    # 8 % apart, each 5-10 % spread over 3 steps (issue 62.3's quiet host): not told apart
    assert within_noise([1.00, 1.05, 1.10], [1.08, 1.13, 1.03])
    apart, spread = noise([1.00, 1.05, 1.10], [1.08, 1.13, 1.03])
    assert apart == pytest.approx(0.03) and spread == pytest.approx(2 * (2 * 0.05**2 / 3) ** 0.5)
    assert not within_noise([1.00, 1.01, 0.99], [1.20, 1.21, 1.19])  # 20 % apart, 1 % spread
    assert not within_noise([1.0, 1.0, 1.0], [1.0, 1.0, 1.0])  # no spread: nothing to settle
    assert not within_noise([1.0], [1.1])  # one step: no spread measured
    # more steps at the same spread narrow it: the same medians are told apart
    assert within_noise([1.0, 1.1, 0.9], [1.06, 1.16, 0.96])
    assert not within_noise([1.0, 1.1, 0.9] * 6, [1.06, 1.16, 0.96] * 6)


def test_the_best_two_within_noise_are_timed_again_within_the_budget():
    """The medians of B and C are 1 % apart with ~5 % spread: the trial times those two again
    (A, slower, not), up to :data:`EXTRA_ROUNDS` rounds, and its table says the choice is still
    within noise when the extra steps did not settle it."""
    close = {
        A: [1, 1.10, 1.11, 1.09],
        B: [1] + [1.00, 1.05, 0.95] * 2,
        C: [1] + [0.99, 1.04, 0.94] * 2,
    }
    trial = Trial([A, B, C], 3 * STEPS_PER_CANDIDATE + NOISE_STEPS)
    seen = run(trial, {k: list(v) for k, v in close.items()})
    assert seen == [A, B, C] * 4 + [C, B] * EXTRA_ROUNDS  # the two, fastest median first
    assert trial.steps == 3 * STEPS_PER_CANDIDATE + NOISE_STEPS and trial.extra == EXTRA_ROUNDS
    assert trial.choice == C and trial.noise["runner_up"] == "overlap"  # C: oases
    assert trial.noise["apart"] == pytest.approx(0.01 / 0.99)
    row = next(r for r in trial.rows() if r["status"] == "chosen")
    assert row["timed"] == 3 + EXTRA_ROUNDS and row["within_noise"] == trial.noise
    lines = format_table(trial.rows())
    assert "chosen (within noise)" in lines[3] and lines[-1].startswith(
        "  the choice is within noise: oases and overlap differ by 1.0 %"
    )
    # the budget caps the extra rounds: one left, one round
    short = Trial([A, B, C], 3 * STEPS_PER_CANDIDATE + 2)
    assert run(short, {k: list(v) for k, v in close.items()})[12:] == [C, B]
    assert short.steps == 3 * STEPS_PER_CANDIDATE + 2 and short.noise is not None
    # no room at all: chosen as before, said to be within noise
    exact = Trial([A, B, C], 3 * STEPS_PER_CANDIDATE)
    assert len(run(exact, {k: list(v) for k, v in close.items()})) == 12 and exact.choice == C
    assert exact.noise["runner_up"] == "overlap"


def test_timing_again_can_settle_the_choice():
    """After the third round B and C are within noise; the extra rounds show C steadily faster,
    its spread narrows, the trial stops timing as soon as they are told apart and chooses C,
    not within noise."""
    trial = Trial([A, B, C], 3 * STEPS_PER_CANDIDATE + NOISE_STEPS)
    times = {
        A: [1, 1.05, 1.05, 1.05],
        B: [1, 1.0, 1.1, 0.9, 1.0, 1.0],
        C: [1, 0.9, 1.0, 0.85, 0.9, 0.9],
    }
    seen = run(trial, times)
    assert seen[12:] == [C, B, C, B] and trial.extra == 2  # told apart after two more rounds
    assert trial.choice == C and trial.noise is None
    assert all(r["within_noise"] is None for r in trial.rows())
    assert "within noise" not in "\n".join(format_table(trial.rows()))


def test_a_retiming_does_not_time_again():
    """A re-timing keeps its incumbent unless clearly slower: it neither races on nor reports
    noise."""
    trial = Trial.retiming(B, C)
    run(trial, {B: [1.0, 1.05, 0.95, 1.0], C: [1, 0.99, 1.04, 0.94]})
    assert trial.choice == B and trial.noise is None and trial.extra == 0


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
    # the budget's 12 steps at most: the steps overlap's failure left may time the best two
    # again where they are within noise (the fake steps' times are real)
    drive(tuner, step, 12, iter(range(1000)))
    schedules = [s for s, _, _ in step.calls]
    assert schedules[:4] == ["off", "overlap", "oases", "off"]  # overlap failed, oases retried
    failed, retry = step.calls[1], step.calls[2]
    assert retry[1] == failed[1] == [2, 3]  # the same micro-batches, none skipped
    assert retry[2] == failed[2]  # the same random draws (dropout masks)
    consumed = [b for _, batches, _ in step.calls[:1] + step.calls[2:] for b in batches]
    assert consumed == list(range(24))  # in order, each once
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


# ------------------------------------------------------------------------------- re-timing


def test_retimings_are_due_every_n_iterations_after_the_choice():
    # the trial chose at iteration 9: re-timings start at 18, 26, 34, ... (each < N steps long)
    assert next_retune(9, 8, after=9) == 18
    assert next_retune(9, 8, after=17) == 18
    assert next_retune(9, 8, after=18) == 26  # one started at 18: the next on the grid
    assert next_retune(9, 8, after=22) == 26
    assert next_retune(9, 8, after=40) == 42  # a resumed run keeps the grid
    assert next_retune(9, 8, after=17, train_iters=24) == 18  # 18-24: RETUNE_STEPS fit
    assert next_retune(9, 8, after=17, train_iters=23) is None  # would not end by the run's end
    assert next_retune(9, None, after=9) is None


def row(candidate, median, status=""):
    return {
        "candidate": candidate.name,
        **candidate.as_dict(),
        "median_s": median,
        "status": status,
    }


def test_the_runner_up_is_the_other_of_the_last_timings_best_two():
    D = Candidate("cross-pass")
    table = [
        row(A, 0.43, "dropped: slower"),
        row(C, 0.40, "dropped: slower"),  # dropped ones count: conditions change
        row(B, None, "failed: RuntimeError: OOM"),
        row(D, 0.11, "chosen"),
    ]
    record = {"choice": D.as_dict(), "table": table, "retunes": []}
    assert runner_up(record, (A, B, C, D)) == C
    assert runner_up(record, (A, B, D)) == A  # oases cannot run under this command line
    failed = dict(record, table=[row(A, 0.3, "failed: RuntimeError: x"), row(D, 0.1, "chosen")])
    assert runner_up(failed, (A, B, C, D)) is None  # a failed candidate is not raced again
    # after a re-timing, its pair is the last timing's best two
    retimed = Trial.retiming(D, C)
    run(retimed, {D: [0.5, 0.5], C: [9, 0.1, 0.1]})
    entry = retune_entry(retimed, D, (18, 22))
    assert entry["switched"] and entry["name"] == "oases"
    again = dict(record, choice=C.as_dict(), retunes=[entry])
    assert runner_up(again, (A, B, C, D)) == D
    assert runner_up({"choice": STOCK.as_dict(), "table": []}, (A, B)) is None


def test_a_retiming_warms_up_the_runner_up_only_and_keeps_the_choice_unless_clearly_slower():
    # B runs (warm): C takes one warm-up step, then both are timed, interleaved
    kept = Trial.retiming(B, C)
    seen = run(kept, {B: [1.00, 1.00, 1.00], C: [9, 0.95, 0.92, 0.94]})
    assert seen == [C, B, C, B, C, B, C] and len(seen) == RETUNE_STEPS
    assert kept.median(C) < kept.median(B)  # faster in median, not clearly: no switch
    assert (
        kept.choice == B
        and kept.times[B] == [1.0, 1.0, 1.0]
        and kept.times[C] == [0.95, 0.92, 0.94]
    )
    # clearly faster (its slowest step more than 10 % below the choice's fastest): a switch,
    # decided after two timed rounds like the trial's drop
    switched = Trial.retiming(B, C)
    assert run(switched, {B: [1.0, 1.0], C: [9, 0.5, 0.5]}) == [C, B, C, B, C]
    assert switched.choice == C and switched.out[B] == ("dropped", "slower")
    # stock as the choice is kept against a 5 % faster schedule (the first trial would switch)
    stock = Trial.retiming(A, B)
    run(stock, {A: [1.0, 1.0, 1.0], B: [9, 0.95, 0.95, 0.95]})
    assert stock.choice == A
    # a runner-up that fails is dropped; the choice runs that iteration again
    failing = Trial.retiming(B, C)
    assert run(failing, {B: []}, fail=[C]) == [] and failing.choice == B
    entry = retune_entry(failing, B, (18, 18))
    assert not entry["switched"] and entry["table"][1]["status"] == "failed: injected"


def test_a_retiming_is_one_line():
    trial = Trial.retiming(B, C)
    run(trial, {B: [0.2, 0.2], C: [9, 0.1, 0.1]})
    line = format_retune(retune_entry(trial, B, (18, 22)))
    assert line == (
        "re-timed the best two at iterations 18-22 (5 steps, medians): overlap 200.0 ms "
        "(dropped: slower), oases 100.0 ms: switched to oases; to pin it: --oases-schedule oases "
        "--oases-sub-batches 2"
    )
    kept = Trial.retiming(B, C)
    run(kept, {B: [0.1, 0.1], C: [9, 0.2, 0.2]})
    assert format_retune(retune_entry(kept, B, (26, 30))).endswith(
        "overlap 100.0 ms, oases 200.0 ms (dropped: slower): kept overlap"
    )


class TimedStep(FakeStep):
    """:class:`FakeStep` whose steps take ``durations[schedule]`` seconds on the tuner's clock."""

    def __init__(self, selection, durations, monkeypatch, fail=()):
        super().__init__(selection, fail)
        self.durations, self.now = durations, 0.0
        monkeypatch.setattr(runtime, "time", types.SimpleNamespace(perf_counter=lambda: self.now))

    def __call__(self, *a, **k):
        self.now += self.durations[self.selection.schedule]
        return super().__call__(*a, **k)


def test_retimings_race_the_best_two_and_switch_every_rank_together(
    megatron_args, capsys, monkeypatch
):
    settings = AutoTune(candidates=(A, B, C), budget=12, retune_interval=8, train_iters=40)
    selection = Selection()
    step = TimedStep(selection, {"off": 1.0, "overlap": 0.5, "oases": 0.6}, monkeypatch)
    tuner = runtime.Tuner(settings, selection)
    data = iter(range(1000))
    drive(tuner, step, 9, data)  # the trial: a warm-up round, two timed; A and C dropped
    assert tuner.fixed == B and tuner.anchor == 9 and tuner.due == 18
    step.durations.update(overlap=1.0)  # conditions change: oases is now clearly faster
    for i in range(9, 40):
        tuner.train_step(step, step.args(data), {"iteration": i})
    ran = [s for s, _, _ in step.calls]
    assert ran[9:17] == ["overlap"] * 8  # iterations 10-17 run the choice
    # 18-22: oases' warm-up, then both interleaved; overlap clearly slower after two rounds
    assert ran[17:22] == ["oases", "overlap", "oases", "overlap", "oases"]
    assert ran[22:25] == ["oases"] * 3  # 23-25: the new choice
    # 26-30: overlap (now the runner-up) against oases: kept; 34-40: again (7 steps fit)
    assert ran[25:30] == ["overlap", "oases", "overlap", "oases", "overlap"]
    assert ran[33:40] == ["overlap", "oases", "overlap", "oases", "overlap"] + ["oases"] * 2
    consumed = [b for _, batches, _ in step.calls for b in batches]
    assert consumed == list(range(80))  # every re-timing step is a training step, in order
    record = megatron_args.oases_autotune  # what the next checkpoint keeps
    assert record["name"] == "oases" and record["how"] == "re-timed"
    assert record["choice"] == C.as_dict() and record["flags"] == C.flags()
    assert record["iterations"] == [1, 9] and len(record["table"]) == 3  # the trial's, as it was
    retunes = record["retunes"]
    assert [(r["iterations"], r["switched"], r["name"]) for r in retunes] == [
        ([18, 22], True, "oases"),
        ([26, 30], False, "oases"),
        ([34, 38], False, "oases"),
    ]
    assert [r["candidate"] for r in retunes[0]["table"]] == ["overlap", "oases"]
    out = capsys.readouterr().out
    assert out.count("re-timed the best two") == 3
    assert "at iterations 18-22 (5 steps, medians): overlap 1000.0 ms (dropped: slower), " in out
    assert "switched to oases; to pin it: --oases-schedule oases --oases-sub-batches 2" in out
    assert tuner.due is None  # 42-48 would not end by iteration 40


def test_a_resumed_run_keeps_the_retiming_grid(megatron_args, monkeypatch):
    trial = Trial([A, B, C], 12)
    run(trial, {A: [1, 1, 1], B: [1, 0.5, 0.5], C: [1, 0.6, 0.6]})
    saved = argparse.Namespace(
        oases_autotune={"choice": B.as_dict(), "iterations": [1, 9], "table": trial.rows()}
    )
    settings = AutoTune(candidates=(A, B, C), budget=12, retune_interval=8, train_iters=40)
    selection = Selection()
    step = TimedStep(selection, {"off": 1.0, "overlap": 0.5, "oases": 0.6}, monkeypatch)
    tuner = runtime.Tuner(settings, selection)
    tuner.checkpoint_args(saved)
    data = iter(range(1000))
    for i in range(20, 28):  # resumed after iteration 20: the grid of 9 + 8k + 1 gives 26
        tuner.train_step(step, step.args(data), {"iteration": i})
    assert tuner.fixed == B and tuner.record["how"] == "kept from the checkpoint"
    assert [s for s, _, _ in step.calls] == ["overlap"] * 5 + ["oases", "overlap", "oases"]
    plain = runtime.Tuner(AutoTune(candidates=(A, B, C), budget=12, train_iters=40), selection)
    plain.checkpoint_args(saved)
    plain.train_step(step, step.args(data), {"iteration": 20})
    assert plain.due is None  # without --oases-retune-interval: never


def test_a_runner_up_failing_in_a_retiming_leaves_the_choice(megatron_args, capsys, monkeypatch):
    settings = AutoTune(candidates=(A, B, C), budget=12, retune_interval=8, train_iters=40)
    selection = Selection()
    step = TimedStep(selection, {"off": 1.0, "overlap": 0.5, "oases": 0.6}, monkeypatch)
    tuner = runtime.Tuner(settings, selection)
    data = iter(range(1000))
    drive(tuner, step, 9, data)
    step.fail = {"oases"}  # fails in its warm-up step at iteration 18, on every rank
    for i in range(9, 26):
        tuner.train_step(step, step.args(data), {"iteration": i})
    ran = [s for s, _, _ in step.calls]
    assert ran[17:19] == ["oases", "overlap"]  # the failed attempt, then 18 again with the choice
    assert step.calls[17][1] == step.calls[18][1]  # on the same micro-batches
    assert ran[19:] == ["overlap"] * 8  # no re-timing before 26; oases failed: none after either
    assert tuner.fixed == B and tuner.due is None
    entry = megatron_args.oases_autotune["retunes"][0]
    assert entry["steps"] == 0 and not entry["switched"]
    assert entry["table"][1]["status"].startswith("failed: RuntimeError: CUDA out of memory")
    out = capsys.readouterr().out
    assert "oases failed on rank(s) 0" in out
    assert "re-timed the best two at iteration 18 (0 steps, medians): overlap -, oases - " in out


# ------------------------------------------- the tuner's parts: train_step's call, retry, agreement


def test_a_step_call_replaces_arguments_by_name_and_keeps_the_calls_shape():
    """``train_step``'s arguments are found by name through Megatron's signature, wherever
    ``train()`` put them, and the call keeps its shape (``--oases-trace`` reads ``iteration`` from
    the keywords)."""
    from megatron_oases.tuning.step_retry import PARAMETERS, StepCall, train_step_signature

    signature = train_step_signature()
    assert set(PARAMETERS) <= set(signature.parameters)
    fs, data, fb = object(), iter(()), object()
    call = StepCall(signature, (fs, data, "m", "o", "s", "c", fb), {"iteration": 4})
    assert call.get("data_iterator") is data and call.get("forward_backward_func") is fb
    assert call.get("iteration") == 4 and call.get("pg_collection") is None
    a, k = call.replaced(data_iterator="D", forward_backward_func="F")
    assert a == (fs, "D", "m", "o", "s", "c", "F") and k == {"iteration": 4}
    rest = dict(model="m", optimizer="o", opt_param_scheduler="s", config="c")
    by_keyword = StepCall(
        signature, (fs,), dict(rest, data_iterator=data, forward_backward_func=fb)
    )
    a, k = by_keyword.replaced(data_iterator="D")
    assert a == (fs,) and k["data_iterator"] == "D" and k["forward_backward_func"] is fb
    with pytest.raises(TypeError):  # a call Megatron's train_step would refuse too
        StepCall(signature, (fs, data), {"no_such_argument": 1})


def test_the_tuner_hands_train_step_its_call_as_train_made_it(megatron_args):
    """Through the trial and after it: ``iteration`` stays a keyword, the rest positional."""
    selection = Selection()
    step = FakeStep(selection)
    seen = []

    def real(*a, **k):
        seen.append((len(a), sorted(k)))
        return step(*a, **k)

    tuner = runtime.Tuner(AutoTune(candidates=(A, B), budget=8, train_iters=20), selection)
    data = iter(range(1000))
    for i in range(10):
        tuner.train_step(real, step.args(data), {"iteration": i})
    assert tuner.fixed is not None  # 8 trial steps, then 2 after the choice
    assert seen == [(7, ["iteration"])] * 10


def test_a_retried_step_replays_its_micro_batches_and_random_state(megatron_args):
    """:class:`StepRetry` alone: the failed attempt's micro-batches come first in the next
    attempt (an iterator, or a list of them: one per model chunk), the RNG is back, a failure
    outside the forward-backward is told apart from one inside."""
    from megatron_oases.tuning.step_retry import StepCall, StepRetry, train_step_signature

    chunks = [iter(range(0, 100)), iter(range(100, 200))]
    args = (None, chunks, None, None, None, None, lambda data_iterator: data_iterator)
    retry = StepRetry(StepCall(train_step_signature(), args, {}))
    a, _ = retry.attempt()
    first = [next(a[1][0]), next(a[1][0]), next(a[1][1])]
    draw = torch.rand(3)
    assert not retry.failed_inside
    retry.undo()
    a, _ = retry.attempt()
    again = [next(a[1][0]), next(a[1][0]), next(a[1][1]), next(a[1][1])]
    assert again == first + [101] and torch.equal(torch.rand(3), draw)

    def failing(data_iterator):
        raise RuntimeError("out of memory")

    retry = StepRetry(StepCall(train_step_signature(), args[:6] + (failing,), {}))
    a, k = retry.attempt()
    with pytest.raises(RuntimeError):
        a[6](data_iterator=a[1])
    assert retry.failed_inside
    retry.attempt()
    assert not retry.failed_inside  # noted per attempt


def test_the_agreement_decodes_the_worlds_max():
    """One rank's values and their MAX over the world: the slowest time, whether any and whether
    every rank failed, whether all ran the same candidate."""
    from megatron_oases.tuning.agreement import decode, encode

    def world(*ranks):
        return decode(torch.tensor([encode(*r) for r in ranks]).max(dim=0).values.tolist())

    assert world((0.5, None, 2), (0.75, None, 2)) == (0.75, False, False, True)
    assert world((0.5, "oom", 2), (0.75, None, 2))[1:3] == (True, False)
    assert world((0.5, "oom", 2), (0.75, "oom", 2))[1:3] == (True, True)
    assert world((0.5, None, 1), (0.5, None, 2))[3] is False
    assert world((0.5, None, 0), (0.5, None, 0))[3] is True


class FakeWorld:
    """``torch.distributed``'s all-reduce as the agreement calls it, with one other rank whose
    values are ``other`` (:func:`encode`'s); ``hangs``: the other rank never arrives."""

    def __init__(self, monkeypatch, other, hangs=False):
        import torch.distributed as dist

        self.other, self.hangs, self.timeouts = other, hangs, []
        monkeypatch.setattr(dist, "all_reduce", self.all_reduce)

    def all_reduce(self, values, op=None, group=None, async_op=False):
        world = self

        class Work:
            def wait(self, timeout=None):
                world.timeouts.append(timeout)
                if world.hangs:
                    raise RuntimeError("timed out")
                values.copy_(torch.maximum(values, torch.tensor(world.other, dtype=values.dtype)))

        return Work()


def test_the_agreement_stops_a_run_the_ranks_cannot_agree_on(monkeypatch):
    from megatron_oases.errors import TrainingStopped
    from megatron_oases.tuning.agreement import FAILED_WAIT_MIN_S, Agreement, encode, patience

    alone = Agreement()  # no group: a rank agrees with itself
    assert alone.agree(0.25, None, B, 1) == (0.25, False) and alone.slowest == 0.25
    assert alone.agree(9.0, "oom", B, 1) == (9.0, True) and alone.slowest == 0.25
    assert alone.reasons("oom") == [(0, "oom")]
    agreement = Agreement()
    agreement.group = object()  # a world of two, by FakeWorld
    FakeWorld(monkeypatch, encode(0.5, None, 1))
    assert agreement.agree(0.25, None, B, 1) == (0.5, False) and agreement.slowest == 0.5
    FakeWorld(monkeypatch, encode(0.5, "oom", 1))
    assert agreement.agree(0.0, "oom", B, 1) == (0.5, True)  # every rank failed: retried
    with pytest.raises(TrainingStopped, match="overlap failed on some ranks and completed"):
        agreement.agree(0.25, None, B, 1)
    FakeWorld(monkeypatch, encode(0.5, None, 2))
    with pytest.raises(RuntimeError, match="the ranks ran different candidates"):
        agreement.agree(0.25, None, B, 1)
    world = FakeWorld(monkeypatch, encode(0.5, None, 1), hangs=True)
    with pytest.raises(TrainingStopped, match="overlap failed on rank 0 .*still inside"):
        agreement.agree(0.0, "oom", B, 1)  # failed alone: waits, then stops
    assert world.timeouts[0].total_seconds() == patience(0.5) == FAILED_WAIT_MIN_S
    assert agreement.group is None  # abandoned, not destroyed (that would wait too)
    assert patience(20.0) == 100.0  # five of the slowest steps where that is longer


def test_train_step_is_bound_by_megatrons_names_under_a_wrapper_installed_before(
    megatron_args, monkeypatch
):
    """``--log-json``'s wrapper, a test's, a user's: installed on ``train_step`` before the
    tuner's, each forwards ``*args, **kwargs`` and names nothing it wraps; the install-time check
    and the binding still see Megatron's parameters (read from Megatron's source)."""
    import inspect

    from megatron.training import training

    from megatron_oases.errors import OasesConfigError
    from megatron_oases.patching import Patch
    from megatron_oases.tuning import step_retry

    original = training.train_step

    def train_step(forward_step_func, *a, **k):
        return original(forward_step_func, *a, **k)

    wrapper = Patch("test-wrapper", [(training, "train_step", train_step)])
    step_retry.train_step_signature.cache_clear()
    wrapper.install()
    try:
        step_retry.check_train_step()
        signature = step_retry.train_step_signature()
        assert list(signature.parameters) == list(inspect.signature(original).parameters)
        selection = Selection()
        step = FakeStep(selection)
        tuner = runtime.Tuner(AutoTune(candidates=(A, B), budget=8, train_iters=20), selection)
        drive(tuner, step, 1, iter(range(10)))  # binds under the wrapper
        assert tuner.signature is signature and len(step.calls) == 1
    finally:
        wrapper.uninstall()
    older = inspect.Signature([inspect.Parameter("data", inspect.Parameter.POSITIONAL_OR_KEYWORD)])
    monkeypatch.setattr(step_retry, "train_step_signature", lambda: older)
    with pytest.raises(OasesConfigError, match="changed the signature \\(missing data_iterator, "):
        step_retry.check_train_step()


def test_a_signature_read_from_source_has_the_defs_names_and_kinds():
    """What :func:`~megatron_oases.tuning.step_retry.train_step_signature` builds from a ``def``
    is what Python's own signature of it would be (names, kinds, which have defaults)."""
    import ast
    import inspect

    from megatron_oases.tuning.step_retry import _signature

    source = "def f(a, /, b, c=1, *rest, d, e=2, **more): pass"
    space = {}
    exec(source, space)

    def shape(signature):
        return [(p.name, p.kind, p.default is p.empty) for p in signature.parameters.values()]

    built = _signature(ast.parse(source).body[0].args)
    assert shape(built) == shape(inspect.signature(space["f"]))
