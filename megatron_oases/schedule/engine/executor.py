"""Two-sub-batch executor: the paper's Algorithms 1 and 2 over generic op programs.

Each sub-batch has a *program*, a list of :class:`Compute` and :class:`Comm` ops. The executor
runs sub-batch x's computes until its next collective, starts that collective asynchronously and
switches to the other sub-batch, whose compute then hides x's transfer. Collectives are queued:
the link runs them in issue order (NCCL's stream, the emulator's channel) and the host blocks only
when a sub-batch needs its own pending result. Under SP a block's two collectives are separated by
a short op that runs at a yield point inside the other sub-batch's long op (:class:`Interleave`).
On GPUs collectives run on the TP group's NCCL stream, computes on the default stream
(``CUDA_DEVICE_MAX_CONNECTIONS=1`` keeps launch order = issue order).
"""

import contextlib

import torch

from .comm import start_collective


class Compute:
    """``early``: needs neither the sub-batch's collective before it nor the ops between them (a
    recomputation from a saved input), so when the sub-batch resumes, the executor runs it
    *before* waiting for that collective: the transfer then also hides behind the sub-batch's
    own work, which matters where the other sub-batch had little to run (its loss backward).
    Only ops of the resuming sub-batch move, within its own stretch, so no more activations
    are alive at once than in program order.

    ``light``: a short op (layernorm, bias-dropout-add, their backward) that may run at another
    sub-batch's yield point (see :class:`Interleave`)."""

    __slots__ = ("fn", "labels", "early", "light")
    is_comm = False  # the executor's test, an attribute read rather than isinstance()

    def __init__(self, fn, early=False, light=False, **labels):
        self.fn, self.labels, self.early, self.light = fn, labels, early, light


#: The collectives a :class:`Comm` can run. The sequence-parallel ones work on dim 0 of [s, b, h].
KINDS = ("all_reduce", "all_gather", "reduce_scatter")


class Comm:
    """A ``kind`` collective of ``get()`` on ``group``: all-reduce in place, or all-gather /
    reduce-scatter along the sequence dim into a new tensor; ``done(result)`` runs when it has
    completed. An all-gather's ``get()`` may return a tuple of same-shaped tensors: they travel
    in one collective, and ``done`` gets the tuple of gathered tensors. ``reduce_op``: the
    reduction of an all-reduce (None: a sum, which a column linear may have started early).

    ``switch=False``: the sub-batch's next computes do not need this result, so it keeps running
    them instead of handing over to the other sub-batch; its results are then taken, in issue
    order, where it next waits (a block's output cut into pieces, see
    tail pieces in :mod:`.forward`)."""

    __slots__ = ("get", "done", "group", "kind", "reduce_op", "switch", "labels")
    is_comm = True

    def __init__(self, get, done, group, kind="all_reduce", reduce_op=None, switch=True, **labels):
        assert kind in KINDS, kind
        assert reduce_op is None or kind == "all_reduce", kind
        self.get, self.done, self.group, self.kind = get, done, group, kind
        self.reduce_op, self.switch, self.labels = reduce_op, switch, labels


class _InFlight:
    __slots__ = ("sub_batch", "work", "result", "op")

    def __init__(self, sub_batch, work, result, op):
        self.sub_batch, self.work, self.result, self.op = sub_batch, work, result, op

    def finish(self):
        """Wait, hand the result to ``done``, and drop every reference to it (the work and the
        result closure): the executor's frame that called this runs the sub-batch's next computes,
        often a whole backward op, and must not keep the collective's buffer alive meanwhile."""
        work, result, self.work, self.result = self.work, self.result, None, None
        if work is not None:
            work.wait()
        self.op.done(result())


def _issue(sub_batch, op, tracer, early):
    tensor = op.get()
    if op.group is None or op.group.size() == 1:  # ProcessGroup.size(), no Python layer
        return _InFlight(sub_batch, None, lambda: tensor, op)
    started = None
    if early is not None and op.reduce_op is None and op.kind in ("all_reduce", "reduce_scatter"):
        started = early.take(tensor, scatter=op.kind == "reduce_scatter")
    if started is not None:  # Megatron's linear started it in the compute op before (see .comm)
        work, result = started
        return _InFlight(sub_batch, work, result, op)
    ctx = tracer.context(sub_batch=sub_batch, **op.labels) if tracer else contextlib.nullcontext()
    with ctx, torch.no_grad():
        reduce_op = {} if op.reduce_op is None else dict(op=op.reduce_op)
        work, result = start_collective(op.kind, tensor, op.group, **reduce_op)
    return _InFlight(sub_batch, work, result, op)


@contextlib.contextmanager
def holding(owner, attr, value):
    """``owner.attr`` is ``value`` inside the context, and what it was again after (nested
    contexts restore in turn)."""
    outer = getattr(owner, attr)
    setattr(owner, attr, value)
    try:
        yield
    finally:
        setattr(owner, attr, outer)


class Interleave:
    """Yield points inside a long compute op (main_j). Under sequence parallelism each block has
    two collectives with a short op between them (reduce-scatter → bda + ln → all-gather); at a
    block boundary that short op can only run after the other sub-batch's whole main op, so its
    all-gather would start with nothing left to hide it. Calling this object from inside a
    running compute (the engine's hooks after main_j's first GEMM and before its backward) lets
    every other sub-batch whose next stretch is all ``light`` ops take its pending result, run
    that stretch and issue its next collective there, so that collective hides behind the rest
    of the running op. The order is fixed by the program (the op waits for the result if it is
    not there yet), never by timing: executions stay deterministic.

    One per schedule call (forward and backward of a micro-batch); the hooks outlive a single
    :func:`run_programs` call (a gradient hook set in forward fires in backward), so they call
    this object, which forwards to whichever execution is active."""

    def __init__(self):
        self.execution = None  # the :class:`_Execution` now running, if any

    def __call__(self):
        if self.execution is not None:
            self.execution.yield_point()

    def active(self, execution):
        return holding(self, "execution", execution)


class _Execution:
    """The state of one :func:`run_programs` call."""

    def __init__(self, programs, tracer, early, ids=None, interleave=False):
        self.programs, self.tracer, self.early = programs, tracer, early
        # the running computes are tracked for the tracer and for yield points only
        self.tracked = tracer is not None or interleave
        self.ids = list(range(len(programs))) if ids is None else list(ids)  # trace labels
        self.pos = [0] * len(programs)
        # sub-batch -> its collectives in flight, in issue order (more than one only after a
        # ``Comm(switch=False)``)
        self.pending = {}
        self.ran_early = [set() for _ in programs]  # positions of early computes already run
        self.running = []  # (sub-batch, trace key) of the compute ops now running, innermost last
        self.grad = torch.is_grad_enabled()  # a yield point may sit inside a backward hook
        self.yielding = False

    def compute(self, x, op):
        if not self.tracked:
            op.fn()
            return
        key = (id(self), len(self.running))
        self.running.append((x, key))
        try:
            if self.tracer is None:
                op.fn()
            else:
                with self.tracer.context(sub_batch=self.ids[x], **op.labels):
                    self.tracer.open_compute(key)
                    try:
                        op.fn()
                    finally:
                        self.tracer.close_compute(key)
        finally:
            self.running.pop()

    def resume(self, x):
        """x's pending results, its computes up to its next collective, and that collective's
        issue (up to the next one where a ``Comm(switch=False)`` was issued). Early computes of
        the stretch run before the wait (see :class:`Compute`)."""
        prog, pos, ran_early = self.programs[x], self.pos, self.ran_early[x]
        n = len(prog)
        if x in self.pending:
            k = pos[x]
            while k < n and not prog[k].is_comm:
                if prog[k].early:
                    self.compute(x, prog[k])
                    ran_early.add(k)
                k += 1
            for op in self.pending.pop(x):
                op.finish()
        while pos[x] < n:
            op = prog[pos[x]]
            if not op.is_comm:
                if pos[x] not in ran_early:
                    if self.tracked:
                        self.compute(x, op)
                    else:  # the common case, without a frame of its own
                        op.fn()
                pos[x] += 1
                continue
            # a collective: queue it; the caller then switches, unless told not to
            self.pending.setdefault(x, []).append(_issue(self.ids[x], op, self.tracer, self.early))
            pos[x] += 1
            if op.switch:
                return

    def _light_stretch(self, y):
        prog, k = self.programs[y], self.pos[y]
        if y not in self.pending or k >= len(prog) or prog[k].is_comm:
            return False
        while k < len(prog) and not prog[k].is_comm:
            if not (prog[k].light or k in self.ran_early[y]):
                return False
            k += 1
        return True

    def yield_point(self):
        """Called from inside the running compute (see :class:`Interleave`)."""
        if self.yielding or not self.running:
            return
        x, key = self.running[-1]
        n = len(self.programs)
        ready = [y for y in ((x + i) % n for i in range(1, n)) if self._light_stretch(y)]
        if not ready:
            return
        tracer = self.tracer
        if tracer is not None:  # the running op's trace segment pauses while others run
            tracer.close_compute(key)
        self.yielding = True
        try:
            with torch.set_grad_enabled(self.grad):
                for y in ready:
                    self.resume(y)
        finally:
            self.yielding = False
            if tracer is not None:
                tracer.open_compute(key)


def run_programs(
    programs, labels=None, tracer=None, early=None, interleave=None, ids=None, compute_context=None
):
    """Execute the sub-batch programs interleaved (Alg. 1/2); returns when all are done.
    ``tracer`` (an :class:`~megatron_oases.instrument.trace.Tracer`, optional) records each op.
    ``early`` (a :class:`~.comm.EarlyReductions`, optional): input-gradient all-reduces that
    Megatron's column linears start inside compute ops; the all-reduce ``Comm`` of that gradient
    adopts the started work instead of issuing another. ``interleave`` (an :class:`Interleave`,
    optional): the yield points inside compute ops call into this execution. ``ids``: each program's
    sub-batch index for the trace (default its position; the first program leads).
    ``compute_context``: a context manager the run executes in (the engine's deferral of
    Megatron's own TMP communication, :meth:`.deferral.Deferral.deferring`): entered once, not per
    compute op, as only compute ops call Megatron's layers (a collective's issue and its ``done``
    do not)."""
    outer = tracer.context(**labels) if (tracer and labels) else contextlib.nullcontext()
    execution = _Execution(programs, tracer, early, ids, interleave is not None)
    active = interleave.active(execution) if interleave is not None else contextlib.nullcontext()
    inside = compute_context if compute_context is not None else contextlib.nullcontext()
    n = len(programs)
    lengths = [len(p) for p in programs]
    x = 0
    with outer, active, inside:
        while True:
            execution.resume(x)
            # round-robin: the next sub-batch after x with ops left (x itself last)
            for step in range(1, n + 1):
                y = (x + step) % n
                if execution.pos[y] < lengths[y]:
                    break
            else:
                break
            x = y
        for ops in list(execution.pending.values()):
            for op in ops:
                op.finish()
