"""The ``oases-autotune`` patch: ``--oases-schedule auto``'s trial inside Megatron's own loop.

It wraps ``megatron.training.training.train_step`` (by name, as ``--log-json`` does). Each
iteration of the trial selects the :class:`~.candidates.Trial`'s next candidate on the
``oases-schedule`` patch's :class:`~megatron_oases.schedule.engine.LayerSchedule` (between
iterations: a micro-batch's backward uses what its forward captured), runs Megatron's step and
times it (``torch.cuda.synchronize`` around it on CUDA). One small all-reduce (MAX) over the world,
on a gloo group of its own, gives every rank the slowest rank's time, whether some rank failed, and
a check that all ran the same candidate: every rank and pipeline stage feeds the trial the same
values, so all switch together and reach the same choice. Once chosen, the wrapper only calls
through, except for ``--oases-retune-interval N``'s re-timings: every N iterations after the choice
(:func:`.candidates.next_retune`) the current choice and the runner-up of the last timing
(:func:`.candidates.runner_up`) run the same kind of trial (:meth:`.candidates.Trial.retiming`,
the same agreement, failure handling and replay), and the choice switches where the runner-up is
now clearly faster; the gloo group stays open while a re-timing is still due.

**A failed candidate.** An exception inside the step's forward-backward (on a GPU: out of memory)
under a split candidate is caught. If every rank failed (an OOM strikes the tensor-parallel ranks'
equal shards alike), the candidate is dropped on every rank with one line, its memory freed, and
the same iteration runs again with the next candidate on the same micro-batches (replayed) from
the same RNG state: nothing is lost or skipped. A rank that failed alone cannot be waited out: the
others are inside that step's collectives, which neither gloo nor NCCL can cancel without
rebuilding Megatron's groups. It waits :func:`patience` seconds for them at the agreement, then
stops the run with one line (:class:`~megatron_oases.errors.TrainingStopped`) instead of hanging.
Stock (``off``) failing is the run's own failure and is raised as it is.

**Where the choice goes.** Rank 0 prints the table (:func:`.candidates.format_table`) and the
flags that pin the winner, and one line per re-timing (:func:`.candidates.format_retune`); the
record (:func:`Tuner.record`, with ``"retunes"``: each re-timing's result) goes into ``--log-json``
(``"oases-autotune"``) and into Megatron's ``args`` (attribute :data:`ARGS_KEY`), which every
checkpoint saves; a resumed run reads it back when Megatron checks the checkpoint's arguments
(``check_checkpoint_args``) and keeps the choice unless ``--oases-retune`` is given.
"""

import datetime
import gc
import time

from ..compat import require_call, require_symbol
from ..errors import TrainingStopped
from ..patching import Patch
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

PATCH_NAME = "oases-autotune"
#: Megatron's ``args`` attribute the record travels under into checkpoints (``state_dict['args']``).
ARGS_KEY = "oases_autotune"
#: The ``--log-json`` entry.
LOG_KEY = "oases-autotune"
#: A rank whose candidate failed waits for the others at least this long, or this many times the
#: slowest step so far (:func:`patience`).
FAILED_WAIT_MIN_S = 60.0
FAILED_WAIT_STEPS = 5
#: Where ``train()`` passes them to ``train_step`` (checked at install time).
_DATA, _FORWARD_BACKWARD = 1, 6
_CALL = (
    "forward_step_func, train_data_iterator, model, optimizer, opt_param_scheduler, config, "
    "forward_backward_func"
)
PREFIX = "oases: --oases-schedule auto"


def patience(slowest_step_s):
    """Seconds a failed rank waits for the others at the agreement."""
    return max(FAILED_WAIT_MIN_S, FAILED_WAIT_STEPS * (slowest_step_s or 0.0))


def _one_line(exc):
    lines = [ln for ln in str(exc).strip().splitlines() if ln.strip()]
    return f"{type(exc).__name__}: {lines[0][:200] if lines else ''}".rstrip(": ")


def _rank():
    import torch.distributed as dist

    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def _say(lines):
    if _rank() == 0:
        print("\n".join(lines), flush=True)


def _sync():
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _free_memory():
    import torch

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def _arg(a, k, index, name):
    return a[index] if len(a) > index else k[name]


def _with_arg(a, k, index, name, value):
    a, k = list(a), dict(k)
    if len(a) > index:
        a[index] = value
    else:
        k[name] = value
    return a, k


# ------------------------------------------------------------- what a failed attempt must undo


def _rng_state():
    """The generators a step draws from (dropout): CPU, CUDA, Megatron's tracker."""
    import torch
    from megatron.core import tensor_parallel

    tracker = tensor_parallel.get_cuda_rng_tracker()
    state = {
        "cpu": torch.get_rng_state(),
        "tracker": {
            k: v.clone() if isinstance(v, torch.Tensor) else v
            for k, v in tracker.get_states().items()
        },
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def _set_rng_state(state):
    import torch
    from megatron.core import tensor_parallel

    torch.set_rng_state(state["cpu"])
    tensor_parallel.get_cuda_rng_tracker().set_states(state["tracker"])
    if "cuda" in state:
        torch.cuda.set_rng_state(state["cuda"])


def _timers():
    try:
        from megatron.training.global_vars import get_timers

        return getattr(get_timers(), "_timers", {}) or {}
    except (ImportError, AssertionError, AttributeError):
        return {}


def _started_timers():
    return {name for name, t in _timers().items() if getattr(t, "_started", False)}


def _stop_timers(before):
    """Megatron's timers the failed step started and could not stop (the next start asserts)."""
    for name, t in _timers().items():
        if getattr(t, "_started", False) and name not in before:
            t.stop()


def _reset_rerun_state():
    """Megatron's rerun state machine back to before the step (the failed step left it inside
    its initial run, where the next ``train_step`` would skip the forward-backward)."""
    from megatron.core.rerun_state_machine import RerunState, get_rerun_state_machine

    machine = get_rerun_state_machine()
    if machine.state != RerunState.NOT_RUNNING_YET:
        machine.state = RerunState.NOT_RUNNING_YET
        machine.current_iteration -= 1


_RECORDING = None


def _recording_class():
    """A :class:`RerunDataIterator` (Megatron's rerun state machine accepts no other) that keeps
    the micro-batches a trial step fetched, and first hands out those of a failed attempt."""
    global _RECORDING
    if _RECORDING is None:
        from megatron.core.rerun_state_machine import RerunDataIterator

        class Recording(RerunDataIterator):
            def __init__(self, inner, replay=()):
                super().__init__(inner)
                self.replay, self.fetched = list(replay), []

            def __next__(self):
                if self.replay:
                    item = self.replay.pop(0)
                else:
                    replaying = self.replaying  # Megatron's own rerun: not a new micro-batch
                    item = super().__next__()
                    if replaying:
                        return item
                self.fetched.append(item)
                return item

        _RECORDING = Recording
    return _RECORDING


def _recording(data, replay):
    """``data`` (an iterator, a list of them, or None) wrapped to record; ``replay``: what the
    failed attempt fetched (same shape), handed out first."""
    if data is None:
        return None
    if isinstance(data, list):
        replay = replay or [()] * len(data)
        return [_recording(d, r) for d, r in zip(data, replay)]
    return _recording_class()(data, replay or ())


def _fetched(recorded):
    if recorded is None:
        return None
    if isinstance(recorded, list):
        return [_fetched(r) for r in recorded]
    return list(recorded.fetched)


# ---------------------------------------------------------------------------------- the tuner


class Tuner:
    """One run's trial. ``settings``: the config's :class:`~.candidates.AutoTune`; ``selection``:
    the schedule patch's ``LayerSchedule`` (None when only stock can run); ``recorder``:
    ``--log-json``'s, or None; ``tracer``: ``--oases-trace``'s, or None (its schedule label
    becomes the winner's)."""

    def __init__(self, settings, selection=None, recorder=None, tracer=None):
        self.settings, self.selection = settings, selection
        self.recorder, self.tracer = recorder, tracer
        self.trial = None  # the run's first trial
        self.active = None  # the trial or re-timing running now
        self.fixed = None  # the chosen candidate, once chosen
        self.anchor = None  # the trial's last iteration: re-timings are due every N after it
        self.due = None  # the next re-timing's first iteration (None: none)
        self.retune_first = None
        self.iteration = 0  # the iteration running now
        self.record = None
        self.loaded = None  # a resumed checkpoint's record
        self.graphs = {}  # candidate -> its BlockGraphs (``--oases-cuda-graphs`` candidates)
        self.group = None
        self.first_iteration = self.last_iteration = None
        self.slowest = 0.0

    # ----------------------------------------------------------------- Megatron's calls

    def checkpoint_args(self, saved):
        """Megatron checks a resumed checkpoint's arguments: the choice saved with them."""
        record = getattr(saved, ARGS_KEY, None)
        self.loaded = record if isinstance(record, dict) else None

    def train_step(self, real, a, k):
        iteration = self.iteration = (k.get("iteration") or 0) + 1
        if self.fixed is None and self.trial is None:
            self._start(k.get("iteration"))
        if self.active is None and self.due is not None and iteration >= self.due:
            self._start_retune(iteration)
        if self.active is None:
            return real(*a, **k)
        return self._trial_step(real, a, k)

    # ----------------------------------------------------------------------- the trial

    def _start(self, iteration):
        """The first step of this run: keep a resumed choice, or start the trial."""
        s, done = self.settings, iteration or 0
        self.first_iteration = done + 1
        kept = Candidate.from_dict((self.loaded or {}).get("choice"))
        if kept is not None and not s.retune:
            if kept in s.candidates:
                chosen_at = (self.loaded.get("iterations") or [None, None])[-1]
                self.anchor = chosen_at if isinstance(chosen_at, int) else done
                self._fix(kept, dict(self.loaded, how="kept from the checkpoint"), after=done)
                _say(
                    [f"{PREFIX}: kept {kept.name} from the checkpoint (--oases-retune times again)"]
                )
                return
            _say(
                [
                    f"{PREFIX}: the checkpoint's choice, {kept.name}, cannot run with this command "
                    "line; timing the schedules again"
                ]
            )
        if len(s.candidates) == 1:
            why = s.excluded[0][1] if s.excluded else "no split schedule can run here"
            self._fix(STOCK, self._record(STOCK, "only stock can run"))
            _say([f"{PREFIX}: stock Megatron runs: {why}"])
            return
        left = None if s.train_iters is None else s.train_iters - done
        budget = s.budget if left is None else min(s.budget, left)
        if budget < MIN_TRIAL:
            self._fix(STOCK, self._record(STOCK, "too few iterations left"))
            _say([f"{PREFIX}: {left} iterations left, too few to time the schedules; stock runs"])
            return
        self.trial = self.active = Trial(s.candidates, budget)
        self._open_group()

    def _start_retune(self, iteration):
        """``--oases-retune-interval``: the current choice against the last timing's runner-up."""
        self.active = Trial.retiming(self.fixed, runner_up(self.record, self.settings.candidates))
        self.retune_first, self.last_iteration = iteration, None

    def _end(self):
        trial, self.active = self.active, None
        if trial is self.trial:
            self._finish()
        else:
            self._finish_retune(trial)

    def _trial_step(self, real, a, k):
        trial, replay = self.active, None
        iteration = (k.get("iteration") or 0) + 1
        data = _arg(a, k, _DATA, "data_iterator")
        forward_backward = _arg(a, k, _FORWARD_BACKWARD, "forward_backward_func")
        while True:
            candidate = trial.next()
            if candidate is None:  # the trial ended on a failure: this iteration runs the choice
                self._end()
                a2, k2 = _with_arg(a, k, _DATA, "data_iterator", _recording(data, replay))
                return real(*a2, **k2)
            self._select(candidate)
            rng, timers = _rng_state(), _started_timers()
            recorded = _recording(data, replay)
            inside = []

            def forward_backward_func(*x, **y):
                try:
                    return forward_backward(*x, **y)
                except Exception:
                    inside.append(True)
                    raise

            a2, k2 = _with_arg(a, k, _DATA, "data_iterator", recorded)
            a2, k2 = _with_arg(
                a2, k2, _FORWARD_BACKWARD, "forward_backward_func", forward_backward_func
            )
            why, out = None, None
            _sync()
            start = time.perf_counter()
            try:
                out = real(*a2, **k2)
            except Exception as exc:  # noqa: BLE001 - a candidate's failure, judged below
                if candidate.stock or not inside:
                    raise
                why = _one_line(exc)
            if why is None:
                _sync()
            elapsed = time.perf_counter() - start
            slowest, any_failed, all_failed = self._agree(elapsed, why, candidate)
            if not any_failed:
                self.slowest = max(self.slowest, slowest)
                trial.record(candidate, slowest)
                self.last_iteration = iteration
                if trial.next() is None:
                    self._end()
                return out
            if not all_failed:  # some ranks completed the step: the states differ now
                raise TrainingStopped(
                    f"--oases-schedule auto: {candidate.name} failed on some ranks and completed "
                    "on others; resume from the last checkpoint with a pinned schedule (e.g. "
                    f"{STOCK.flags()})"
                )
            self._drop(candidate, self._reasons(why), iteration)
            replay = _fetched(recorded)
            out = recorded = None
            _free_memory()
            _set_rng_state(rng)
            _reset_rerun_state()
            _stop_timers(timers)

    def _select(self, candidate):
        if self.selection is None:
            return
        graphs = None
        if candidate.cuda_graphs:
            from ..schedule.graphs import BlockGraphs

            graphs = self.graphs.get(candidate)
            if graphs is None:
                graphs = self.graphs[candidate] = BlockGraphs(candidate.cuda_graphs)
        self.selection.select(candidate.schedule, candidate.sub_batches, graphs)

    def _drop(self, candidate, reasons, iteration):
        """Every rank failed ``candidate`` in ``iteration`` (``reasons``: each rank's line)."""
        self.active.fail(candidate, reasons[0][1])
        self.graphs.pop(candidate, None)
        ranks = ", ".join(str(r) for r, _ in reasons)
        _say(
            [
                f"{PREFIX}: {candidate.name} failed on rank(s) {ranks} ({reasons[0][1]}): dropped; "
                f"iteration {iteration} runs again with the next candidate"
            ]
        )

    def _finish(self):
        trial = self.trial
        choice = trial.choice
        record = self._record(choice, "timed", trial.rows())
        first, last = self.first_iteration, self.last_iteration or self.first_iteration
        self.anchor = last
        lines = [
            f"{PREFIX}: {trial.steps} trial steps (iterations {first}-{last}); a step's time is "
            "the slowest rank's, the median of its timed steps after one warm-up step",
            *format_table(record["table"]),
            f"{PREFIX} chose {choice.name}; to pin it: {choice.flags()}",
        ]
        self._fix(choice, record)
        _say(lines)

    def _finish_retune(self, trial):
        """A re-timing ended: its result joins the record; the choice switches if it changed."""
        first = self.retune_first
        entry = retune_entry(trial, self.fixed, (first, self.last_iteration or first))
        record = dict(self.record, retunes=[*(self.record.get("retunes") or []), entry])
        choice = trial.choice
        if entry["switched"]:
            record.update(choice=choice.as_dict(), name=choice.name, flags=choice.flags())
            record["how"] = "re-timed"
        self._fix(choice, record)
        _say([f"{PREFIX}: {format_retune(entry)}"])

    def _record(self, choice, how, rows=()):
        return {
            "choice": choice.as_dict(),
            "name": choice.name,
            "flags": choice.flags(),
            "how": how,
            "trial_steps": self.trial.steps if self.trial is not None else 0,
            "iterations": [self.first_iteration, self.last_iteration],
            "table": list(rows),
            "retunes": [],
        }

    def _fix(self, choice, record, after=None):
        """The run goes on with ``choice`` (until a re-timing switches it); the record goes where
        it is kept; the next re-timing is scheduled after iteration ``after`` (default: the one
        running now), and the group stays open for it."""
        self.fixed, self.record = choice, record
        self._select(choice)
        others = [c for c in self.graphs if c != choice]
        for candidate in others:
            del self.graphs[candidate]
        if others:  # their graphs' memory pools (a full collection costs ~0.5 s: only then)
            _free_memory()
        s, self.due = self.settings, None
        if s.retune_interval and runner_up(record, s.candidates) is not None:
            after = self.iteration if after is None else after
            self.due = next_retune(self.anchor, s.retune_interval, after, s.train_iters)
        if self.due is None:
            self._close_group()
        elif self.group is None:
            self._open_group()  # a resumed run that kept its choice
        from megatron.training import get_args

        setattr(get_args(), ARGS_KEY, record)  # saved with every checkpoint from now on
        if self.recorder is not None:
            self.recorder.extra[LOG_KEY] = record
        if self.tracer is not None:
            self.tracer.schedule = choice.schedule

    # --------------------------------------------------------------- the world's agreement

    def _open_group(self):
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_initialized()):
            return
        if dist.get_world_size() == 1 or dist.get_backend() == "fake":
            return
        self.group = dist.new_group(backend="gloo")

    def _close_group(self):
        import torch.distributed as dist

        group, self.group = self.group, None
        if group is not None and dist.is_initialized():
            dist.destroy_process_group(group)

    def close(self):
        """The patch is uninstalled (the job ends)."""
        try:
            self._close_group()
        except (RuntimeError, ValueError):
            pass
        self.graphs.clear()

    def _agree(self, seconds, why, candidate):
        """``(slowest rank's seconds, any rank failed, every rank failed)``."""
        import torch
        import torch.distributed as dist

        failed = 0.0 if why is None else 1.0
        if self.group is None:
            return seconds, bool(failed), bool(failed)
        index = float(self.settings.candidates.index(candidate))
        values = torch.tensor([seconds, failed, -failed, index, -index], dtype=torch.float64)
        work = dist.all_reduce(values, op=dist.ReduceOp.MAX, group=self.group, async_op=True)
        if why is None:
            work.wait()
        else:
            try:
                work.wait(timeout=datetime.timedelta(seconds=patience(self.slowest)))
            except RuntimeError:
                self.group = None  # abandoned: destroying it would wait for the pending op
                raise TrainingStopped(
                    f"--oases-schedule auto: {candidate.name} failed on rank {_rank()} ({why}) "
                    "while the other ranks are still inside that step's collectives; pin a "
                    f"schedule that runs here, e.g. {STOCK.flags()}"
                ) from None
        if values[3] != -values[4]:
            raise RuntimeError(
                "oases: auto: the ranks ran different candidates; pin a schedule with "
                "--oases-schedule and report it"
            )
        return float(values[0]), bool(values[1] > 0), bool(-values[2] > 0)

    def _reasons(self, why):
        """``[(rank, why)]`` of the ranks that failed."""
        import torch.distributed as dist

        if self.group is None:
            return [(_rank(), why)]
        every = [None] * dist.get_world_size(self.group)
        dist.all_gather_object(every, why, group=self.group)
        return [(r, w) for r, w in enumerate(every) if w is not None]


def make_patch(config, built=None):
    """``oases-autotune`` for ``--oases-schedule auto`` (``config.autotune``), else None.
    ``built``: the patches built before it; it selects on the ``oases-schedule`` patch's
    ``LayerSchedule`` and writes into ``golden-values``' recorder and ``oases-trace``'s tracer."""
    settings = getattr(config, "autotune", None)
    if settings is None:
        return None
    from megatron.training import checkpointing, training

    built = built or {}
    selection = getattr(built.get("oases-schedule"), "layer_schedule", None)
    if settings.splits and selection is None:
        raise RuntimeError("oases: --oases-schedule auto needs the oases-schedule patch first")
    recorder = getattr(built.get("golden-values"), "recorder", None)
    tracer = getattr(built.get("oases-trace"), "tracer", None)
    tuner = Tuner(settings, selection, recorder, tracer)
    step = require_symbol(training, "train_step", called_by=[training.train])
    require_call(training.train, _CALL)
    check = require_symbol(
        checkpointing, "check_checkpoint_args", called_by=[checkpointing.load_checkpoint]
    )

    def train_step(*a, **k):
        return tuner.train_step(step, a, k)

    def check_checkpoint_args(checkpoint_args, *rest, **kwargs):
        tuner.checkpoint_args(checkpoint_args)
        return check(checkpoint_args, *rest, **kwargs)

    patch = Patch(
        PATCH_NAME,
        [
            (training, "train_step", train_step),
            (checkpointing, "check_checkpoint_args", check_checkpoint_args),
        ],
        after_uninstall=tuner.close,
    )
    patch.tuner = tuner
    return patch
