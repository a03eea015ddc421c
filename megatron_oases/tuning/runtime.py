"""The ``oases-autotune`` patch: ``--oases-schedule auto``'s trial inside Megatron's own loop.

It wraps ``megatron.training.training.train_step`` (by name, as ``--log-json`` does). Each
iteration of the trial selects the :class:`~.candidates.Trial`'s next candidate on the
``oases-schedule`` patch's :class:`~megatron_oases.schedule.megatron.entry.LayerSchedule` (between
iterations: a micro-batch's backward uses what its forward captured), runs Megatron's step and
times it (``torch.cuda.synchronize`` around it on CUDA). Once chosen, the wrapper only calls
through, except for ``--oases-retune-interval N``'s re-timings: every N iterations after the choice
(:func:`.candidates.next_retune`) the current choice and the runner-up of the last timing
(:func:`.candidates.runner_up`) run the same kind of trial (:meth:`.candidates.Trial.retiming`,
the same agreement, failure handling and replay), and the choice switches where the runner-up is
now clearly faster.

Three parts: :class:`Tuner` here is the policy (when a trial or a re-timing runs, what is
selected, where the choice goes); :class:`~.agreement.Agreement` is the world's agreement after
each trial step (one small all-reduce on a gloo group of its own: the slowest rank's time, whether
a rank failed, that all ran the same candidate; open while a re-timing is still due), so every
rank and pipeline stage switches together and reaches the same choice;
:class:`~.step_retry.StepRetry` runs a trial step again after a failure, with ``train_step``'s
arguments bound by name (:class:`~.step_retry.StepCall`).

**A failed candidate.** An exception inside the step's forward-backward (on a GPU: out of memory)
under a split candidate is caught. If every rank failed (an OOM strikes the tensor-parallel ranks'
equal shards alike), the candidate is dropped on every rank with one line, its memory freed, and
the same iteration runs again with the next candidate on the same micro-batches (replayed) from
the same RNG state: nothing is lost or skipped. A rank that failed alone cannot be waited out
(:func:`.agreement.patience`): it stops the run with one line
(:class:`~megatron_oases.errors.TrainingStopped`) instead of hanging. Stock (``off``) failing is
the run's own failure and is raised as it is.

**Where the choice goes.** Rank 0 prints the table (:func:`.candidates.format_table`) and the
flags that pin the winner, and one line per re-timing (:func:`.candidates.format_retune`); the
record (:attr:`Tuner.record`, with ``"retunes"``: each re-timing's result) goes into ``--log-json``
(``"oases-autotune"``) and into Megatron's ``args`` (attribute :data:`ARGS_KEY`), which every
checkpoint saves; a resumed run reads it back when Megatron checks the checkpoint's arguments
(``check_checkpoint_args``) and keeps the choice unless ``--oases-retune`` is given.
"""

import time

from ..compat import require_symbol
from ..patching import Patch
from .agreement import Agreement, rank
from .candidates import (
    MIN_TRIAL,
    STOCK,
    Candidate,
    Trial,
    format_retune,
    format_table,
    next_retune,
    retune_entry,
    runner_up,
)
from .step_retry import StepCall, StepRetry, check_train_step, free_memory, train_step_signature

PATCH_NAME = "oases-autotune"
#: Megatron's ``args`` attribute the record travels under into checkpoints (``state_dict['args']``).
ARGS_KEY = "oases_autotune"
#: The ``--log-json`` entry.
LOG_KEY = "oases-autotune"
PREFIX = "oases: --oases-schedule auto"


def _one_line(exc):
    lines = [ln for ln in str(exc).strip().splitlines() if ln.strip()]
    return f"{type(exc).__name__}: {lines[0][:200] if lines else ''}".rstrip(": ")


def _say(lines):
    if rank() == 0:
        print("\n".join(lines), flush=True)


def _sync():
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()


class Switch:
    """Candidates selected on the schedule patch's ``LayerSchedule`` (``selection``; None when only
    stock can run), each ``--oases-cuda-graphs`` candidate with its own BlockGraphs, captured once
    and kept until it is dropped or another is chosen."""

    def __init__(self, selection):
        self.selection, self.graphs = selection, {}

    def select(self, candidate):
        if self.selection is None:
            return
        graphs = None
        if candidate.cuda_graphs:
            from ..schedule.megatron.graphs import BlockGraphs

            graphs = self.graphs.get(candidate)
            if graphs is None:
                graphs = self.graphs[candidate] = BlockGraphs(candidate.cuda_graphs)
        self.selection.select(candidate.schedule, candidate.sub_batches, graphs)

    def drop(self, candidate):
        self.graphs.pop(candidate, None)

    def keep(self, choice):
        """``choice`` runs on: the others' graphs and their memory pools go (a full collection
        costs ~0.5 s: only then)."""
        self.select(choice)
        others = [c for c in self.graphs if c != choice]
        for candidate in others:
            del self.graphs[candidate]
        if others:
            free_memory()


class Tuner:
    """One run's trial. ``settings``: the config's :class:`~.candidates.AutoTune`; ``selection``:
    the schedule patch's ``LayerSchedule`` (None when only stock can run); ``recorder``:
    ``--log-json``'s, or None; ``tracer``: ``--oases-trace``'s, or None (its schedule label
    becomes the winner's); ``signature``: ``train_step``'s (default: Megatron's)."""

    def __init__(self, settings, selection=None, recorder=None, tracer=None, signature=None):
        self.settings, self.selection = settings, selection
        self.recorder, self.tracer, self.signature = recorder, tracer, signature
        self.switch, self.agreement = Switch(selection), Agreement()
        self.trial = None  # the run's first trial
        self.active = None  # the trial or re-timing running now
        self.fixed = self.record = None  # the chosen candidate and its record, once chosen
        self.anchor = None  # the trial's last iteration: re-timings are due every N after it
        self.due = None  # the next re-timing's first iteration (None: none)
        self.loaded = None  # a resumed checkpoint's record
        self.iteration = 0  # the iteration running now
        self.first_iteration = self.last_iteration = self.retune_first = None

    def checkpoint_args(self, saved):
        """Megatron checks a resumed checkpoint's arguments: the choice saved with them."""
        record = getattr(saved, ARGS_KEY, None)
        self.loaded = record if isinstance(record, dict) else None

    def train_step(self, real, a, k):
        """Megatron's ``train_step`` (``real``) called with ``a``, ``k`` by ``train()``."""
        self.signature = self.signature or train_step_signature()
        call = StepCall(self.signature, a, k)
        done = call.get("iteration") or 0
        self.iteration = done + 1
        if self.fixed is None and self.trial is None:
            self._start(done)
        if self.active is None and self.due is not None and self.iteration >= self.due:
            self.active = Trial.retiming(
                self.fixed, runner_up(self.record, self.settings.candidates)
            )
            self.retune_first, self.last_iteration = self.iteration, None
        if self.active is None:
            return real(*a, **k)
        return self._trial_step(real, StepRetry(call))

    def close(self):
        """The patch is uninstalled (the job ends)."""
        try:
            self.agreement.close()
        except (RuntimeError, ValueError):
            pass
        self.switch.graphs.clear()

    def _start(self, done):
        """The first step of this run: keep a resumed choice, or start the trial."""
        s, self.first_iteration = self.settings, done + 1
        kept = Candidate.from_dict((self.loaded or {}).get("choice"))
        if kept is not None and not s.retune and kept in s.candidates:
            chosen_at = (self.loaded.get("iterations") or [None, None])[-1]
            self.anchor = chosen_at if isinstance(chosen_at, int) else done
            self._fix(kept, dict(self.loaded, how="kept from the checkpoint"), after=done)
            _say([f"{PREFIX}: kept {kept.name} from the checkpoint (--oases-retune times again)"])
            return
        if kept is not None and not s.retune:
            _say(
                [
                    f"{PREFIX}: the checkpoint's choice, {kept.name}, cannot run with this command "
                    "line; timing the schedules again"
                ]
            )
        left = None if s.train_iters is None else s.train_iters - done
        budget = s.budget if left is None else min(s.budget, left)
        if len(s.candidates) == 1:
            why = s.excluded[0][1] if s.excluded else "no split schedule can run here"
            self._fix(STOCK, self._record(STOCK, "only stock can run"))
            _say([f"{PREFIX}: stock Megatron runs: {why}"])
        elif budget < MIN_TRIAL:
            self._fix(STOCK, self._record(STOCK, "too few iterations left"))
            _say([f"{PREFIX}: {left} iterations left, too few to time the schedules; stock runs"])
        else:
            self.trial = self.active = Trial(s.candidates, budget)
            self.agreement.open()

    def _trial_step(self, real, retry):
        """One iteration under the active trial: attempts until one completes on every rank."""
        trial = self.active
        while True:
            candidate = trial.next()
            if candidate is None:  # the trial ended on a failure: this iteration runs the choice
                self._end()
                a, k = retry.plain()
                return real(*a, **k)
            self.switch.select(candidate)
            a, k = retry.attempt()
            out, why, seconds = _attempt(real, a, k, candidate, retry)
            index = self.settings.candidates.index(candidate)
            slowest, failed = self.agreement.agree(seconds, why, candidate, index)
            if not failed:
                trial.record(candidate, slowest)
                self.last_iteration = self.iteration
                if trial.next() is None:
                    self._end()
                return out
            self._drop(candidate, self.agreement.reasons(why))
            a = k = None
            retry.undo()

    def _drop(self, candidate, reasons):
        """Every rank failed ``candidate`` (``reasons``: each rank's line)."""
        self.active.fail(candidate, reasons[0][1])
        self.switch.drop(candidate)
        ranks = ", ".join(str(r) for r, _ in reasons)
        _say(
            [
                f"{PREFIX}: {candidate.name} failed on rank(s) {ranks} ({reasons[0][1]}): dropped; "
                f"iteration {self.iteration} runs again with the next candidate"
            ]
        )

    def _end(self):
        """The trial or re-timing ended: its choice is fixed, with one table or one line."""
        trial, self.active = self.active, None
        if trial is self.trial:
            record = self._record(trial.choice, "timed", trial.rows())
            self.anchor = self.last_iteration or self.first_iteration
            lines = _trial_lines(trial, record, self.first_iteration, self.anchor)
        else:
            first = self.retune_first
            iterations = (first, self.last_iteration or first)
            record, lines = _retimed(self.record, trial, self.fixed, iterations)
        self._fix(trial.choice, record)
        _say(lines)

    def _record(self, choice, how, rows=()):
        steps = self.trial.steps if self.trial is not None else 0
        return _record(choice, how, steps, [self.first_iteration, self.last_iteration], rows)

    def _fix(self, choice, record, after=None):
        """The run goes on with ``choice`` (until a re-timing switches it); the record goes where
        it is kept; the next re-timing is scheduled after iteration ``after`` (default: the one
        running now), and the agreement's group stays open for it."""
        self.fixed, self.record = choice, record
        self.switch.keep(choice)
        s, self.due = self.settings, None
        if s.retune_interval and runner_up(record, s.candidates) is not None:
            after = self.iteration if after is None else after
            self.due = next_retune(self.anchor, s.retune_interval, after, s.train_iters)
        if self.due is None:
            self.agreement.close()
        else:
            self.agreement.open()  # a resumed run that kept its choice opens it here
        _publish(choice, record, self.recorder, self.tracer)


def _attempt(real, a, k, candidate, retry):
    """One timed attempt of the step: ``(its result, this rank's line if it failed inside the
    forward-backward under a split candidate, seconds)``; any other failure is raised."""
    why = out = None
    _sync()
    start = time.perf_counter()
    try:
        out = real(*a, **k)
    except Exception as exc:  # noqa: BLE001 - a candidate's failure, judged by the caller
        if candidate.stock or not retry.failed_inside:
            raise
        why = _one_line(exc)
    if why is None:
        _sync()
    return out, why, time.perf_counter() - start


def _record(choice, how, trial_steps, iterations, rows=()):
    """The record of a choice (``--log-json``'s entry, the checkpoint's ``args`` attribute)."""
    return {
        "choice": choice.as_dict(),
        "name": choice.name,
        "flags": choice.flags(),
        "how": how,
        "trial_steps": trial_steps,
        "iterations": iterations,
        "table": list(rows),
        "retunes": [],
    }


def _trial_lines(trial, record, first, last):
    return [
        f"{PREFIX}: {trial.steps} trial steps (iterations {first}-{last}); a step's time is the "
        "slowest rank's, the median of its timed steps after one warm-up step",
        *format_table(record["table"]),
        f"{PREFIX} chose {trial.choice.name}; to pin it: {trial.choice.flags()}",
    ]


def _retimed(record, trial, fixed, iterations):
    """``record`` with the re-timing ``trial`` (of ``fixed`` and the runner-up) in its
    ``"retunes"``, its choice switched where the re-timing switched; and its one line."""
    entry = retune_entry(trial, fixed, iterations)
    record = dict(record, retunes=[*(record.get("retunes") or []), entry])
    if entry["switched"]:
        choice = trial.choice
        record.update(choice=choice.as_dict(), name=choice.name, flags=choice.flags())
        record["how"] = "re-timed"
    return record, [f"{PREFIX}: {format_retune(entry)}"]


def _publish(choice, record, recorder, tracer):
    """The choice where it is kept: Megatron's ``args`` (saved with every checkpoint from now on),
    ``--log-json``'s record, ``--oases-trace``'s schedule label."""
    from megatron.training import get_args

    setattr(get_args(), ARGS_KEY, record)
    if recorder is not None:
        recorder.extra[LOG_KEY] = record
    if tracer is not None:
        tracer.schedule = choice.schedule


def make_tuner(config, selection, recorder=None, tracer=None):
    """The run's :class:`Tuner` for ``--oases-schedule auto`` (``config.autotune``), else None:
    it selects each iteration's candidate on ``selection`` (the run's ``LayerSchedule``; None
    when only stock can run) and writes its choice into ``recorder`` (``--log-json``) and
    ``tracer`` (``--oases-trace``), each the runtime's or None."""
    settings = getattr(config, "autotune", None)
    if settings is None:
        return None
    if settings.splits and selection is None:
        raise RuntimeError("oases: --oases-schedule auto needs the run's schedule selection")
    return Tuner(settings, selection, recorder, tracer, train_step_signature())


def make_patch(config, tuner):
    """``oases-autotune``: ``tuner`` (:func:`make_tuner`) on Megatron's ``train_step`` and its
    record on the checkpoint's args check, for ``--oases-schedule auto``; else None."""
    if tuner is None:
        return None
    from megatron.training import checkpointing, training

    step = require_symbol(training, "train_step", called_by=[training.train])
    check_train_step()
    check = require_symbol(
        checkpointing, "check_checkpoint_args", called_by=[checkpointing.load_checkpoint]
    )

    def train_step(*a, **k):
        return tuner.train_step(step, a, k)

    def check_checkpoint_args(checkpoint_args, *rest, **kwargs):
        tuner.checkpoint_args(checkpoint_args)
        return check(checkpoint_args, *rest, **kwargs)

    return Patch(
        PATCH_NAME,
        [
            (training, "train_step", train_step),
            (checkpointing, "check_checkpoint_args", check_checkpoint_args),
        ],
        after_uninstall=tuner.close,
    )
