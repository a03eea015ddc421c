"""What ``--oases-schedule auto`` tries, for how long, and how it decides.

Every schedule computes the same loss and gradients as stock Megatron (the parity tests), so a
trial step is an ordinary training step that happens to run under one candidate: the trial costs
only the difference in speed. A *candidate* is a schedule with its sub-batch count and CUDA-graph
mode (:class:`Candidate`); the candidates of a run are those whose command line (the user's, with
``--oases-schedule`` and those two flags set) passes the rules of
:mod:`megatron_oases.validation` (:func:`plan_autotune`): a candidate ineligible under the user's
flags is simply not tried.

:class:`Trial` runs them interleaved (A B C A B C ...), each first for one warm-up step, then
timed; a candidate clearly slower than the best after two timed rounds is dropped, the others get
a third, and the lowest median wins (stock unless beaten by more than :data:`STOCK_MARGIN`). Where
the best two are then within noise of each other (:func:`within_noise`: their medians closer than
their measured spread allows telling apart), the trial times those two again, one step each per
round, while its budget has steps left (at most :data:`EXTRA_ROUNDS` rounds; the default budget
keeps :data:`NOISE_STEPS` for them), and its table says when the choice is still within noise.

``--oases-retune-interval N`` re-times the last timing's best two (:func:`runner_up`) every N
iterations after the choice (:func:`next_retune`): the same :class:`Trial` with the current choice
as its ``incumbent`` (warm already, so only the runner-up takes a warm-up step), kept unless
clearly slower (:func:`clearly_slower`, the trial's drop rule).

Pure Python: no torch, no process group (``tests/unit/test_autotune.py``).
"""

import copy
import math
import statistics
from dataclasses import dataclass
from typing import Optional

from ..errors import OasesConfigError
from ..validation import (  # noqa: F401  (AUTO: the runtime's value, re-exported)
    AUTO,
    SUB_BATCHES,
    check_before_megatron,
    check_oases_args,
    check_sharded_data_parallel,
)

#: Split schedules tried, in this order, and the ones that need Megatron's full recompute (a
#: candidate never changes the recompute setting: they are tried only where the user has it).
SPLIT_ORDER = ("oases", "overlap", "cross-pass")
#: Sub-batch counts tried where ``--oases-sub-batches`` is not given (each where the micro-batch,
#: or under ``--oases-split sequence`` the sequence, has enough to cut).
SUB_BATCH_CHOICES = (SUB_BATCHES, 4)
#: Per tried candidate: one untimed warm-up step (compilation, graph capture, first allocations),
#: then up to :data:`TIMED_STEPS` timed ones (their median decides).
WARMUP_STEPS = 1
TIMED_STEPS = 3
STEPS_PER_CANDIDATE = WARMUP_STEPS + TIMED_STEPS
#: After this many timed rounds a candidate clearly slower than the best is dropped: its faster
#: step slower by more than :data:`DROP_MARGIN` than the best candidate's slower one.
DROP_AFTER = 2
DROP_MARGIN = 0.10
#: Stock stays unless a schedule's median beats it by more than this (noise is not a gain).
STOCK_MARGIN = 0.02
#: Two candidates are within noise when their medians differ by less than this many standard
#: errors of the difference (each candidate's timed steps: standard deviation ÷ √n).
NOISE_Z = 2.0
#: Where the best two are within noise after the timed rounds, at most this many more rounds of
#: those two (one step each), within the budget; the default budget keeps room for them.
EXTRA_ROUNDS = TIMED_STEPS
NOISE_STEPS = 2 * EXTRA_ROUNDS
#: The default trial takes at most this share of ``--train-iters``.
TUNE_SHARE = 0.05
#: The shortest trial: stock and one schedule.
MIN_TRIAL = 2 * STEPS_PER_CANDIDATE
#: A re-timing's steps at most: the runner-up's warm-up, then both timed (the current choice runs
#: warm); ``--oases-retune-interval`` must be longer.
RETUNE_STEPS = 2 * STEPS_PER_CANDIDATE - WARMUP_STEPS


@dataclass(frozen=True)
class Candidate:
    """One schedule setting a trial step runs: ``schedule`` (``off`` = stock), ``sub_batches``
    (``--oases-sub-batches``) and ``cuda_graphs`` (``--oases-cuda-graphs``' mode or None)."""

    schedule: str = "off"
    sub_batches: int = SUB_BATCHES
    cuda_graphs: Optional[str] = None

    @property
    def stock(self):
        return self.schedule == "off"

    @property
    def name(self):
        if self.stock:
            return "off"
        name = self.schedule
        if self.sub_batches != SUB_BATCHES:
            name += f" x{self.sub_batches}"
        if self.cuda_graphs:
            name += " +graphs" if self.cuda_graphs == "capture" else f" +graphs-{self.cuda_graphs}"
        return name

    def flags(self):
        """The flags that pin this candidate in place of ``--oases-schedule auto``."""
        if self.stock:
            return "--oases-schedule off"
        flags = f"--oases-schedule {self.schedule} --oases-sub-batches {self.sub_batches}"
        if self.cuda_graphs == "capture":
            flags += " --oases-cuda-graphs"
        elif self.cuda_graphs:
            flags += f" --oases-cuda-graphs {self.cuda_graphs}"
        return flags

    def as_dict(self):
        return {
            "schedule": self.schedule,
            "sub_batches": self.sub_batches,
            "cuda_graphs": self.cuda_graphs,
        }

    @classmethod
    def from_dict(cls, d):
        """From :meth:`as_dict` (a checkpoint's record); None if it is not one."""
        try:
            return cls(str(d["schedule"]), int(d["sub_batches"]), d.get("cuda_graphs") or None)
        except (KeyError, TypeError, ValueError, AttributeError):
            return None


STOCK = Candidate()


@dataclass(frozen=True)
class AutoTune:
    """``--oases-schedule auto``'s settings, checked once (:func:`plan_autotune`): the eligible
    ``candidates`` in trial order (stock first), ``budget`` (the trial's steps at most),
    ``retune`` (``--oases-retune``: time again on a resumed run), ``retune_interval``
    (``--oases-retune-interval``: re-time the best two every that many iterations; None: never),
    ``train_iters`` (the run's length, for what is left of it on a resume; None: unknown) and
    ``excluded`` (``(name, reason)`` of each split candidate that cannot run here)."""

    candidates: tuple = (STOCK,)
    budget: int = 0
    retune: bool = False
    retune_interval: Optional[int] = None
    train_iters: Optional[int] = None
    excluded: tuple = ()

    @property
    def splits(self):
        """Whether a split schedule is among the candidates (the schedule patch is needed)."""
        return any(not c.stock for c in self.candidates)


def _given(args, name):
    return getattr(args, name, None) is not None


def pinned(args, candidate):
    """``args`` as the command line that pins ``candidate`` (a shallow copy): what the rules of
    :mod:`megatron_oases.validation` check for it."""
    view = copy.copy(args)
    view.oases_schedule = candidate.schedule
    view.oases_sub_batches = candidate.sub_batches
    view.oases_cuda_graphs = candidate.cuda_graphs
    return view


def check_candidate(args, candidate, plan=None, cuda_available=None, te_installed=None):
    """Raise the :class:`OasesConfigError` that pinning ``candidate`` on this command line would
    raise (the rules of :mod:`megatron_oases.validation`, as ``OasesConfig.from_args`` runs them
    on Megatron-validated ``args``), or return."""
    view, schedule = pinned(args, candidate), candidate.schedule
    if not candidate.stock and args.tensor_model_parallel_size == 1:
        raise OasesConfigError(
            f"--oases-schedule {schedule} at --tensor-model-parallel-size 1 has no "
            "tensor-parallel communication to overlap; use --tensor-model-parallel-size 2 or more"
        )
    check_sharded_data_parallel(view, schedule, cuda_available=bool(cuda_available))
    check_before_megatron(view, schedule, te_installed=te_installed)
    check_oases_args(view, schedule, plan, cuda_available=cuda_available, te_installed=te_installed)


def split_candidates(args, cuda_available=False):
    """Every split candidate worth a look under ``args``, in trial order: each sub-batch count
    (``--oases-sub-batches``' if given, else :data:`SUB_BATCH_CHOICES`), on CUDA with and
    without graphs (``--oases-cuda-graphs``' mode if given), each schedule of
    :data:`SPLIT_ORDER` (``cross-pass`` and ``oases`` only under full recompute)."""
    full = getattr(args, "recompute_granularity", None) == "full"
    schedules = [s for s in SPLIT_ORDER if full or s == "overlap"]
    given_parts = getattr(args, "oases_sub_batches", None)
    parts = (given_parts,) if given_parts is not None else SUB_BATCH_CHOICES
    given_graphs = getattr(args, "oases_cuda_graphs", None)
    graphs = (given_graphs,) if given_graphs else ((None, "capture") if cuda_available else (None,))
    return [Candidate(s, n, g) for n in parts for g in graphs for s in schedules]


def default_budget(candidates, train_iters):
    """The trial's steps when ``--oases-tune-steps`` is not given: enough for every candidate
    and for timing the best two again where they are within noise (:data:`NOISE_STEPS`), at most
    :data:`TUNE_SHARE` of the run."""
    full = STEPS_PER_CANDIDATE * len(candidates) + NOISE_STEPS
    if train_iters is None:
        return full
    return min(full, int(TUNE_SHARE * train_iters))


def plan_autotune(args, plan=None, cuda_available=None, te_installed=None):
    """The :class:`AutoTune` of Megatron-validated ``args`` under ``--oases-schedule auto`` (stock
    checked by the caller). One line, before training, where ``auto`` cannot do what it was
    asked: no split schedule can run with a split-only flag the user gave (``--oases-split
    sequence``, ``--oases-sub-batches``, ``--oases-cuda-graphs``: the first candidate's reason),
    or a trial that does not fit (``--oases-tune-steps`` too short or longer than the run; the
    default trial more than :data:`TUNE_SHARE` of the run; a run shorter than any trial), or a
    re-timing that does not (:func:`check_retune_interval`). The run's length is
    ``--train-iters``, or the iterations Megatron derives from ``--train-samples``
    (:class:`RunLength`). Without a split candidate and without such a flag, ``auto``
    runs stock (``excluded`` says why)."""
    eligible, excluded, first_error = [STOCK], [], None
    for candidate in split_candidates(args, cuda_available):
        try:
            check_candidate(args, candidate, plan, cuda_available, te_installed)
        except OasesConfigError as exc:
            excluded.append((candidate.name, str(exc)))
            first_error = first_error or exc
            continue
        eligible.append(candidate)
    asked = [
        flag
        for flag, given in (
            ("--oases-split sequence", getattr(args, "oases_split", "batch") == "sequence"),
            ("--oases-sub-batches", _given(args, "oases_sub_batches")),
            ("--oases-cuda-graphs", _given(args, "oases_cuda_graphs")),
        )
        if given
    ]
    if len(eligible) == 1 and asked and first_error is not None:
        raise OasesConfigError(
            f"--oases-schedule auto with {asked[0]}: no split schedule can run here: {first_error}"
        )
    steps = getattr(args, "oases_tune_steps", None)
    interval = getattr(args, "oases_retune_interval", None)
    length = RunLength.of(args) if len(eligible) > 1 or interval is not None else None
    train_iters = getattr(length, "iterations", getattr(args, "train_iters", None))
    check_retune_interval(interval, train_iters, length)
    budget = 0
    if len(eligible) > 1:
        budget = _check_budget(steps, eligible, length)
    return AutoTune(
        candidates=tuple(eligible),
        budget=budget,
        retune=bool(getattr(args, "oases_retune", False)),
        retune_interval=interval,
        train_iters=train_iters,
        excluded=tuple(excluded),
    )


@dataclass(frozen=True)
class RunLength:
    """The run's length in iterations, as Megatron's loop counts them, for the trial's plan:
    ``--train-iters``, or under ``--train-samples`` the samples over the global batch (Megatron's
    ``update_train_iters``, run only once training starts; ``train_iters`` is None until then).
    ``samples``/``global_batch_size``: the sample-based flags it came from (None: iterations)."""

    iterations: Optional[int]
    samples: Optional[int] = None
    global_batch_size: Optional[int] = None

    @classmethod
    def of(cls, args):
        """From Megatron-validated ``args``; ``iterations`` None where neither flag is given. A
        ``--step-batch-size-schedule`` under ``--train-samples`` is one line: Megatron counts
        those iterations only by stepping through the schedule."""
        iters, samples = getattr(args, "train_iters", None), getattr(args, "train_samples", None)
        batch = getattr(args, "global_batch_size", None)
        if iters or not samples or not batch:
            return cls(iters)
        if getattr(args, "step_batch_size_schedule", None) is not None:
            raise OasesConfigError(
                "--oases-schedule auto cannot plan its trial under --train-samples with "
                "--step-batch-size-schedule (the iterations are known only as the batch size "
                "steps up); give the run's length as --train-iters N, or pin a schedule with "
                "--oases-schedule"
            )
        return cls(samples // batch, samples, batch)

    def __str__(self):
        if self.samples is None:
            return f"--train-iters {self.iterations}"
        return (
            f"--train-samples {self.samples} ({self.iterations} iterations at "
            f"--global-batch-size {self.global_batch_size})"
        )

    def at_least(self, iterations):
        """The flag that makes the run ``iterations`` long."""
        if self.samples is None:
            return f"--train-iters {iterations}"
        return f"--train-samples {iterations * self.global_batch_size}"


def _shortest_default_run():
    """The fewest iterations whose default trial (:data:`TUNE_SHARE` of them) holds
    :data:`MIN_TRIAL` steps."""
    n = MIN_TRIAL
    while int(TUNE_SHARE * n) < MIN_TRIAL:
        n += 1
    return n


def _check_budget(steps, candidates, length=None):
    """The trial's steps: ``--oases-tune-steps`` checked, or :func:`default_budget`; one line
    naming the fix where they do not fit the run (``length``, a :class:`RunLength`; None or
    its iterations None: unknown). A run shorter than the shortest trial says to lengthen it
    or to pin a schedule (an ``N`` in ``8 <= N <= 3`` does not exist)."""
    train_iters = None if length is None else length.iterations
    if steps is not None and steps < MIN_TRIAL:
        raise OasesConfigError(
            f"--oases-tune-steps {steps} is too short: timing stock and one schedule takes "
            f"{MIN_TRIAL} steps (a warm-up and {TIMED_STEPS} timed steps each); use "
            f"{MIN_TRIAL} or more"
        )
    if train_iters is not None and train_iters < MIN_TRIAL:
        longer = length.at_least(MIN_TRIAL)
        if steps is None:
            default = length.at_least(_shortest_default_run())
            longer = f"{default} or more (or {longer} or more with --oases-tune-steps {MIN_TRIAL})"
        else:
            longer += " or more"
        raise OasesConfigError(
            f"{length} is too short for --oases-schedule auto: its trial takes at least "
            f"{MIN_TRIAL} iterations (stock and one schedule, a warm-up and {TIMED_STEPS} timed "
            f"steps each); use {longer}, or pin a schedule with --oases-schedule"
        )
    if steps is not None:
        if train_iters is not None and steps > train_iters:
            raise OasesConfigError(
                f"--oases-tune-steps {steps} is longer than the run, {length}; use at most "
                f"{train_iters}, or pin a schedule with --oases-schedule"
            )
        return steps
    budget = default_budget(candidates, train_iters)
    if budget < MIN_TRIAL:
        share = f"{TUNE_SHARE:.0%}"
        raise OasesConfigError(
            f"--oases-schedule auto times the schedules on the run's first iterations, by default "
            f"at most {share} of {length}: {budget} steps, fewer than the {MIN_TRIAL} it "
            f"needs; add --oases-tune-steps N ({MIN_TRIAL} <= N <= {train_iters}) or pin a "
            "schedule with --oases-schedule"
        )
    return budget


def check_retune_interval(interval, train_iters, length=None):
    """``--oases-retune-interval N``: a positive number of iterations, longer than a re-timing
    (:data:`RETUNE_STEPS`, so that one ends before the next is due), and short enough that a
    re-timing fits in the run's ``train_iters`` at all (``length``: how the line names them, a
    :class:`RunLength`; None: ``--train-iters``)."""
    if interval is None:
        return
    if interval < 1:
        raise OasesConfigError(
            f"--oases-retune-interval {interval}: N must be a positive number of iterations; use "
            f"{RETUNE_STEPS + 1} or more, or drop --oases-retune-interval"
        )
    if interval <= RETUNE_STEPS:
        raise OasesConfigError(
            f"--oases-retune-interval {interval} is too short: re-timing the best two takes up to "
            f"{RETUNE_STEPS} steps (the runner-up's warm-up and {TIMED_STEPS} timed steps each), "
            f"which must end before the next is due; use {RETUNE_STEPS + 1} or more"
        )
    if train_iters is not None and interval + RETUNE_STEPS > train_iters:
        raise OasesConfigError(
            f"--oases-retune-interval {interval} leaves no room for a re-timing in "
            f"{length or RunLength(train_iters)}: it starts {interval} iterations after the "
            f"choice and takes up to {RETUNE_STEPS} steps; use at most "
            f"{max(train_iters - RETUNE_STEPS, 0)}, or drop --oases-retune-interval"
        )


def clearly_slower(times, best_times):
    """Whether timed steps ``times`` are clearly slower than ``best_times``: even the fastest of
    them slower by more than :data:`DROP_MARGIN` than the slowest of ``best_times`` (the trial
    drops such a candidate; a re-timing switches away from such a choice)."""
    return min(times) > max(best_times) * (1 + DROP_MARGIN)


def noise(times_a, times_b):
    """``(apart, spread)`` of two candidates' timed steps: the difference of their medians and
    :data:`NOISE_Z` standard errors of it (``sqrt(var_a/n_a + var_b/n_b)``), in seconds; None
    with fewer than two steps on a side."""
    if len(times_a) < 2 or len(times_b) < 2:
        return None
    var = statistics.variance(times_a) / len(times_a) + statistics.variance(times_b) / len(times_b)
    apart = abs(statistics.median(times_a) - statistics.median(times_b))
    return apart, NOISE_Z * math.sqrt(var)


def within_noise(times_a, times_b):
    """Whether two candidates' timed steps cannot be told apart: their medians differ by less
    than their measured spread (:func:`noise`). More steps narrow the spread, so timing the two
    again can settle it; identical steps never are."""
    measured = noise(times_a, times_b)
    return measured is not None and measured[0] < measured[1]


def next_retune(chosen_at, interval, after, train_iters=None):
    """The first iteration of the next re-timing, on the grid ``chosen_at + k * interval + 1``
    (``k >= 1``; ``chosen_at``: the trial's last iteration) after iteration ``after``; None where
    there is none (no interval) or it would not end by ``train_iters``."""
    if not interval:
        return None
    k = max(1, (after - chosen_at - 1) // interval + 1)
    start = chosen_at + k * interval + 1
    if train_iters is not None and start + RETUNE_STEPS - 1 > train_iters:
        return None
    return start


def runner_up(record, candidates):
    """The candidate a re-timing races against ``record``'s choice (the tuner's record: the
    trial's table, and its re-timings'): the other of the last timing's best two, the lowest
    median among its timed candidates that did not fail, dropped ones included; None where there
    is none among ``candidates`` (those that can run)."""
    choice = Candidate.from_dict(record.get("choice"))
    retunes = record.get("retunes") or []
    rows = retunes[-1].get("table", []) if retunes else record.get("table") or []
    best = None
    for row in rows:
        candidate = Candidate.from_dict(row)
        median = row.get("median_s")
        if candidate is None or candidate == choice or candidate not in candidates:
            continue
        if median is None or str(row.get("status", "")).startswith("failed"):
            continue
        if best is None or median < best[0]:
            best = (median, candidate)
    return None if best is None else best[1]


class Trial:
    """The trial of ``candidates`` (stock first) within ``budget`` steps: as many candidates, in
    their order, as :data:`STEPS_PER_CANDIDATE` steps each fit (the rest are "not tried").

    The caller asks :meth:`next` for each iteration's candidate and reports its time
    (:meth:`record`, the slowest rank's seconds) or its failure (:meth:`fail`: the candidate is
    dropped and the same iteration runs again with the next one). When :meth:`next` returns None
    the trial is over and :attr:`choice` is set. Every rank feeds it the same agreed values, so
    every rank reaches the same choice.

    ``incumbent`` (a re-timing, :meth:`retiming`): the candidate running until now. It is warm, so
    its steps are all timed and the first round is the others' warm-up; it stays the choice
    unless :func:`clearly_slower` than another (the drop rule), not merely slower in median.

    Without an incumbent, where the best two are :func:`within_noise` after the timed rounds,
    those two run more rounds (:data:`EXTRA_ROUNDS` at most, while ``budget`` has two steps
    left); :attr:`noise` then says whether the choice is still within noise of the runner-up."""

    def __init__(self, candidates, budget, incumbent=None):
        self.budget = budget
        self.racing = ()  # the best two, timed again while within noise
        self.extra = 0  # rounds they ran
        self.noise = None  # the choice within noise: {"runner_up", "apart", "spread"}
        fit, used = 0, 0
        for c in candidates:
            used += STEPS_PER_CANDIDATE - (WARMUP_STEPS if c == incumbent else 0)
            if used > budget:
                break
            fit += 1
        fit = max(1, fit)
        self.tried, self.untried = list(candidates[:fit]), list(candidates[fit:])
        self.incumbent = incumbent
        self.times = {c: [] for c in self.tried}  # timed seconds per candidate
        self.warmed = {incumbent} & set(self.tried)
        self.out = {}  # candidate -> ("dropped" | "failed", why)
        self.steps = 0  # iterations the trial ran (a failed attempt is not one)
        self.choice = None
        self._round = [c for c in self.tried if c not in self.warmed] or list(self.tried)
        if len(self.tried) == 1:
            self.choice = self.tried[0]

    @classmethod
    def retiming(cls, choice, runner_up):
        """``--oases-retune-interval``'s re-timing of the current ``choice`` against
        ``runner_up``: :data:`RETUNE_STEPS` steps at most, interleaved after the runner-up's
        warm-up."""
        return cls([choice, runner_up], RETUNE_STEPS, incumbent=choice)

    def alive(self):
        return [c for c in self.tried if c not in self.out]

    def next(self):
        """The candidate of the next iteration; None once the trial is over."""
        while self.choice is None:
            self._round = [c for c in self._round if c not in self.out]
            if self._round:
                return self._round[0]
            self._end_round()
            self._round = [c for c in self.racing if c not in self.out] or self.alive()
        return None

    def record(self, candidate, seconds):
        """``candidate`` (the one :meth:`next` gave) ran its step in ``seconds``."""
        self._take(candidate)
        self.steps += 1
        if candidate in self.warmed:
            self.times[candidate].append(float(seconds))
        else:
            self.warmed.add(candidate)

    def fail(self, candidate, why):
        """``candidate`` failed (on every rank): dropped; :meth:`next` gives the one to retry
        the same iteration with."""
        self._take(candidate)
        self.out[candidate] = ("failed", why)
        if len(self.alive()) == 1:
            self.choice = self.alive()[0]

    def _take(self, candidate):
        if not self._round or self._round[0] != candidate:
            raise RuntimeError(f"oases: auto: {candidate.name} was not the trial's next candidate")
        self._round.pop(0)

    def _end_round(self):
        alive = self.alive()
        if len(alive) <= 1:
            self.choice = alive[0] if alive else STOCK
            return
        if not self.racing:
            timed = min(len(self.times[c]) for c in alive)
            if timed == 0:
                return  # the warm-up round
            if timed == DROP_AFTER:
                best = min(alive, key=lambda c: statistics.median(self.times[c]))
                for c in alive:
                    if c is not best and clearly_slower(self.times[c], self.times[best]):
                        self.out[c] = ("dropped", "slower")
            alive = self.alive()
            if len(alive) > 1 and timed < TIMED_STEPS:
                return
        pair = self._best_two(alive)
        room = self.budget - self.steps >= len(pair) and self.extra < EXTRA_ROUNDS
        if self.incumbent is None and len(pair) == 2 and within_noise(*map(self.times.get, pair)):
            if room:  # time the two again: more steps narrow the spread
                self.racing, self.extra = pair, self.extra + 1
                return
        self.racing = ()
        self.choice = self._best(alive)
        self.noise = self._noise(alive)

    def _best_two(self, alive):
        """The two alive candidates of lowest median (fewer where fewer were timed)."""
        timed = sorted((c for c in alive if self.times[c]), key=self.median)
        return tuple(timed[:2])

    def _noise(self, alive):
        """:attr:`noise` of the choice against the fastest other alive candidate by median."""
        if self.incumbent is not None:
            return None
        others = [c for c in alive if c != self.choice and self.times[c]]
        if not others or not self.times[self.choice]:
            return None
        other = min(others, key=self.median)
        mine, theirs = self.times[self.choice], self.times[other]
        if not within_noise(mine, theirs):
            return None
        apart, spread = noise(mine, theirs)
        best = min(self.median(self.choice), self.median(other))
        return {"runner_up": other.name, "apart": apart / best, "spread": spread / best}

    def median(self, candidate):
        times = self.times.get(candidate) or []
        return statistics.median(times) if times else None

    def _best(self, alive):
        if self.incumbent in alive:
            mine = self.times[self.incumbent]
            faster = [c for c in alive if clearly_slower(mine, self.times[c])]
            return min(faster, key=self.median) if faster else self.incumbent
        best = min(alive, key=self.median)
        stock = next((c for c in alive if c.stock), None)
        if stock is not None and self.median(stock) <= self.median(best) * (1 + STOCK_MARGIN):
            return stock
        return best

    def rows(self):
        """The table: ``{candidate, median_s, vs_stock, timed, status}`` per candidate, the
        tried ones first; ``status``: ``chosen``, ``dropped: slower``, ``failed: why``, ``not
        tried: budget`` or empty (timed, not the fastest)."""
        stock = self.median(STOCK)
        rows = []
        for c in self.tried + self.untried:
            median = self.median(c)
            if c == self.choice:
                status = "chosen"
            elif c in self.out:
                status = "{}: {}".format(*self.out[c])
            elif c in self.untried:
                status = "not tried: budget"
            else:
                status = ""
            rows.append(
                {
                    "candidate": c.name,
                    **c.as_dict(),
                    "median_s": median,
                    "vs_stock": median / stock if median is not None and stock else None,
                    "timed": len(self.times.get(c, [])),
                    "status": status,
                    "within_noise": self.noise if c == self.choice else None,
                }
            )
        return rows


def format_table(rows):
    """:meth:`Trial.rows` as the lines rank 0 prints."""
    lines = [f"  {'candidate':<22} {'median':>10} {'vs stock':>9}  {'timed':>5}  status"]
    for r in rows:
        median = "-" if r["median_s"] is None else f"{1000 * r['median_s']:.1f} ms"
        ratio = "-" if r["vs_stock"] is None else f"{r['vs_stock']:.3f}"
        status = r["status"] + (" (within noise)" if r.get("within_noise") else "")
        lines.append(f"  {r['candidate']:<22} {median:>10} {ratio:>9}  {r['timed']:>5}  {status}")
    close = [r for r in rows if r.get("within_noise")]
    if close:
        r, n = close[0], close[0]["within_noise"]
        lines.append(
            f"  the choice is within noise: {r['candidate']} and {n['runner_up']} differ by "
            f"{100 * n['apart']:.1f} %, less than their measured spread ({100 * n['spread']:.1f} "
            f"%, {NOISE_Z:g} standard errors) after {r['timed']} timed steps; either is as good "
            "on this evidence (pin one, or time longer with --oases-tune-steps)"
        )
    return lines


def retune_entry(trial, was, iterations):
    """A finished re-timing ``trial`` of the choice ``was`` over ``iterations`` (first, last), as
    the record keeps it (``"retunes"``)."""
    choice = trial.choice
    return {
        "iterations": list(iterations),
        "steps": trial.steps,
        "was": was.name,
        "name": choice.name,
        "flags": choice.flags(),
        "switched": choice != was,
        "table": trial.rows(),
    }


def format_retune(entry):
    """:func:`retune_entry` as the one line rank 0 prints."""
    times = []
    for r in entry["table"]:
        median = "-" if r["median_s"] is None else f"{1000 * r['median_s']:.1f} ms"
        status = r["status"] if r["status"] not in ("", "chosen") else ""
        times.append(f"{r['candidate']} {median}" + (f" ({status})" if status else ""))
    first, last = entry["iterations"]
    where = f"iterations {first}-{last}" if last != first else f"iteration {first}"
    steps = f"{entry['steps']} step" + ("" if entry["steps"] == 1 else "s")
    if entry["switched"]:
        verdict = f"switched to {entry['name']}; to pin it: {entry['flags']}"
    else:
        verdict = f"kept {entry['name']}"
    return f"re-timed the best two at {where} ({steps}, medians): {', '.join(times)}: {verdict}"
