"""One iteration's ``train_step`` under ``--oases-schedule auto``, attempted again after a
candidate failed on every rank, so that nothing is lost or skipped.

:class:`StepCall` holds the call as Megatron's ``train()`` made it, bound once by name through
Megatron's ``train_step`` signature (:data:`PARAMETERS`, checked at install time), so that an argument is
replaced by its name and the call keeps its shape (a wrapper below reads ``iteration`` from the
keywords). :class:`StepRetry` runs the attempts: each one's data iterator records the
micro-batches it fetches and first hands out those of the failed attempt before it; its
forward-backward notes whether the failure came from inside it; and what a failed attempt left
behind is undone: its memory, the RNG states (dropout), Megatron's rerun state machine and the
timers it started.
"""

import ast
import functools
import gc
import inspect

#: ``train_step``'s parameters the tuner reads or replaces, by name.
PARAMETERS = ("data_iterator", "forward_backward_func", "iteration")


@functools.cache
def train_step_signature():
    """Megatron's ``train_step`` signature, as Megatron's source defines it: by the time the tuner
    installs, the symbol may be a wrapper that forwards ``*args, **kwargs`` (``--log-json``'s,
    ``--oases-trace``'s, a test's), and ``train()`` still calls it with Megatron's arguments. Where
    no source ships, the symbol's own."""
    from megatron.training import training

    try:
        tree = ast.parse(inspect.getsource(training))
    except (OSError, TypeError, SyntaxError):
        tree = ast.Module(body=[], type_ignores=[])
    for node in tree.body:
        if isinstance(node, ast.FunctionDef) and node.name == "train_step":
            return _signature(node.args)
    return inspect.signature(training.train_step)


def _signature(args):
    """An :class:`inspect.Signature` with the names and kinds of a ``def``'s ``args`` (a default
    stands in for each default value: binding never applies them)."""
    P, given = inspect.Parameter, "<default>"
    positional = args.posonlyargs + args.args
    defaults = [P.empty] * (len(positional) - len(args.defaults)) + [given] * len(args.defaults)
    params = [
        P(
            a.arg,
            P.POSITIONAL_ONLY if i < len(args.posonlyargs) else P.POSITIONAL_OR_KEYWORD,
            default=d,
        )
        for i, (a, d) in enumerate(zip(positional, defaults))
    ]
    if args.vararg is not None:
        params.append(P(args.vararg.arg, P.VAR_POSITIONAL))
    params += [
        P(a.arg, P.KEYWORD_ONLY, default=P.empty if d is None else given)
        for a, d in zip(args.kwonlyargs, args.kw_defaults)
    ]
    if args.kwarg is not None:
        params.append(P(args.kwarg.arg, P.VAR_KEYWORD))
    return inspect.Signature(params)


def check_train_step():
    """At install: Megatron's ``train_step`` still has :data:`PARAMETERS` (one line otherwise)."""
    from ..compat import SUPPORTED_SPEC, megatron_core_version
    from ..errors import OasesConfigError

    missing = [p for p in PARAMETERS if p not in train_step_signature().parameters]
    if missing:
        raise OasesConfigError(
            f"this megatron-core ({megatron_core_version()}) changed the signature (missing "
            f"{', '.join(missing)}): megatron.training.training.train_step; megatron-oases "
            f"supports megatron-core {SUPPORTED_SPEC}"
        )


class StepCall:
    """One call of ``train_step``: its arguments by name (``signature``: Megatron's) and which of
    them came by position, which by keyword."""

    def __init__(self, signature, a, k):
        self.arguments = signature.bind(*a, **k).arguments
        self.keywords = list(k)
        self.positional = [n for n in self.arguments if n not in k]

    def get(self, name):
        return self.arguments.get(name)

    def replaced(self, **values):
        """``(args, kwargs)`` of the same call with ``values`` (by name) replacing its arguments."""
        arguments = {**self.arguments, **values}
        kwargs = {n: arguments[n] for n in arguments if n not in self.positional}
        return tuple(arguments[n] for n in self.positional), kwargs


class StepRetry:
    """The attempts of one iteration's ``train_step`` (``call``: a :class:`StepCall`)."""

    def __init__(self, call):
        self.call = call
        self.replay = None  # what the failed attempt fetched, handed out first by the next one
        self.failed_inside = False  # the last attempt raised inside its forward-backward
        self._recorded = self._rng = self._timers = None

    def attempt(self):
        """``(args, kwargs)`` of the next attempt, after a snapshot of what it may have to undo."""
        self._rng, self._timers = rng_state(), started_timers()
        self._recorded = recording(self.call.get("data_iterator"), self.replay)
        self.failed_inside = False
        forward_backward = self.call.get("forward_backward_func")

        def forward_backward_func(*x, **y):
            try:
                return forward_backward(*x, **y)
            except Exception:
                self.failed_inside = True
                raise

        return self.call.replaced(
            data_iterator=self._recorded, forward_backward_func=forward_backward_func
        )

    def plain(self):
        """``(args, kwargs)`` of a plain call (the trial ended on a failed attempt): the failed
        attempt's micro-batches first."""
        return self.call.replaced(
            data_iterator=recording(self.call.get("data_iterator"), self.replay)
        )

    def undo(self):
        """The last attempt failed on every rank: keep its micro-batches for the next, free its
        memory, and put the RNG, the rerun state machine and the timers back as before it."""
        self.replay, self._recorded = fetched(self._recorded), None
        free_memory()
        set_rng_state(self._rng)
        reset_rerun_state()
        stop_timers(self._timers)


def free_memory():
    import torch

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


# ------------------------------------------------------------- what a failed attempt must undo


def rng_state():
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


def set_rng_state(state):
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


def started_timers():
    return {name for name, t in _timers().items() if getattr(t, "_started", False)}


def stop_timers(before):
    """Megatron's timers the failed step started and could not stop (the next start asserts)."""
    for name, t in _timers().items():
        if getattr(t, "_started", False) and name not in before:
            t.stop()


def reset_rerun_state():
    """Megatron's rerun state machine back to before the step (the failed step left it inside
    its initial run, where the next ``train_step`` would skip the forward-backward)."""
    from megatron.core.rerun_state_machine import RerunState, get_rerun_state_machine

    machine = get_rerun_state_machine()
    if machine.state != RerunState.NOT_RUNNING_YET:
        machine.state = RerunState.NOT_RUNNING_YET
        machine.current_iteration -= 1


# ------------------------------------------------------------------ the recording data iterator

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


def recording(data, replay):
    """``data`` (an iterator, a list of them, or None) wrapped to record; ``replay``: what the
    failed attempt fetched (same shape), handed out first."""
    if data is None:
        return None
    if isinstance(data, list):
        replay = replay or [()] * len(data)
        return [recording(d, r) for d, r in zip(data, replay)]
    return _recording_class()(data, replay or ())


def fetched(recorded):
    """What ``recorded`` (:func:`recording`'s) handed out, in its shape."""
    if recorded is None:
        return None
    if isinstance(recorded, list):
        return [fetched(r) for r in recorded]
    return list(recorded.fetched)
