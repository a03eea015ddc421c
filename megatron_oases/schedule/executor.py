"""Two-sub-batch executor: the paper's Algorithms 1 and 2 over generic op programs.

Each sub-batch has a *program*: a list of :class:`Compute` and :class:`Comm` ops with data
dependencies only inside the program. The executor runs sub-batch x's computes until its next
communication, starts that collective (all-reduce; all-gather or reduce-scatter under sequence
parallelism) asynchronously, and switches to the other sub-batch, whose compute then hides x's
transfer ("whenever meeting a communication operator, start it asynchronously and switch the
sub-batch"). Collectives are *queued*: issuing one never waits for the one before it; the link
runs them one at a time in issue order (NCCL serialises collectives on a communicator's stream;
the link emulator books one channel per group), and the host blocks only when a sub-batch needs
its own pending result (before its next compute or its next collective). With one collective per
block this is the paper's rule exactly; under sequence parallelism a block has two, separated by a
short compute (bias-dropout-add and layernorm), and a queue lets the second wait on the link while
the other sub-batch's long compute runs, instead of holding the host.

Ordering assumption for GPUs: collectives are issued on the TP group's NCCL stream and computes on
the default stream in program order; the overlap needs them on different streams, which is what
``async_op=True`` gives (``CUDA_DEVICE_MAX_CONNECTIONS=1`` keeps launch order = issue order).
"""

import contextlib

import torch
import torch.distributed as dist

from .comm import deferred_tmp_comm


class Compute:
    """``early``: needs neither the sub-batch's collective before it nor the ops between them (a
    recomputation from a saved input), so when the sub-batch resumes, the executor runs it
    *before* waiting for that collective: the transfer then also hides behind the sub-batch's
    own work, which matters where the other sub-batch had little to run (its loss backward).
    Only ops of the resuming sub-batch move, within its own stretch, so no more activations
    are alive at once than in program order."""

    __slots__ = ("fn", "labels", "early")

    def __init__(self, fn, early=False, **labels):
        self.fn, self.labels, self.early = fn, labels, early


#: The collectives a :class:`Comm` can run. The sequence-parallel ones work on dim 0 of [s, b, h].
KINDS = ("all_reduce", "all_gather", "reduce_scatter")


class Comm:
    """A ``kind`` collective of ``get()`` on ``group``: all-reduce in place, or all-gather /
    reduce-scatter along the sequence dim into a new tensor; ``done(result)`` runs when it has
    completed. An all-gather's ``get()`` may return a tuple of same-shaped tensors: they travel
    in one collective, and ``done`` gets the tuple of gathered tensors."""

    __slots__ = ("get", "done", "group", "kind", "labels")

    def __init__(self, get, done, group, kind="all_reduce", **labels):
        assert kind in KINDS, kind
        self.get, self.done, self.group, self.kind = get, done, group, kind
        self.labels = labels


class _InFlight:
    __slots__ = ("sub_batch", "work", "result", "op")

    def __init__(self, sub_batch, work, result, op):
        self.sub_batch, self.work, self.result, self.op = sub_batch, work, result, op

    def finish(self):
        if self.work is not None:
            self.work.wait()
        self.op.done(self.result())


def _start(kind, tensor, group):
    """Start ``kind`` asynchronously; returns (work, a function giving the result after it)."""
    if kind == "all_reduce":
        return dist.all_reduce(tensor, group=group, async_op=True), lambda: tensor
    n = dist.get_world_size(group)
    if kind == "all_gather" and isinstance(tensor, tuple):
        k, shape = len(tensor), tuple(tensor[0].shape)
        work, out = _start("all_gather", torch.stack(tensor), group)  # [n·k, *shape]

        def split():  # rank-major [n, k, s/n, ...] -> k tensors of [s, ...]
            parts = out().view(n, k, *shape).transpose(0, 1)
            return tuple(p.reshape((n * shape[0],) + shape[1:]) for p in parts)

        return work, split
    tensor = tensor.contiguous()
    if kind == "all_gather":
        out = tensor.new_empty((tensor.size(0) * n,) + tuple(tensor.shape[1:]))
        return dist.all_gather_into_tensor(out, tensor, group=group, async_op=True), lambda: out
    if tensor.size(0) % n:
        raise ValueError(f"reduce-scatter of {tensor.size(0)} rows over {n} ranks")
    out = tensor.new_empty((tensor.size(0) // n,) + tuple(tensor.shape[1:]))
    return dist.reduce_scatter_tensor(out, tensor, group=group, async_op=True), lambda: out


def _issue(sub_batch, op, tracer, early):
    tensor = op.get()
    if op.group is None or dist.get_world_size(op.group) == 1:
        return _InFlight(sub_batch, None, lambda: tensor, op)
    work = early.take(tensor) if (early is not None and op.kind == "all_reduce") else None
    if work is not None:  # Megatron's linear started it in the compute op before (see .comm)
        return _InFlight(sub_batch, work, lambda: tensor, op)
    ctx = tracer.context(sub_batch=sub_batch, **op.labels) if tracer else contextlib.nullcontext()
    with ctx, torch.no_grad():
        work, result = _start(op.kind, tensor, op.group)
    return _InFlight(sub_batch, work, result, op)


def _run_compute(sub_batch, op, tracer, early):
    with deferred_tmp_comm(early=early):
        if tracer is None:
            op.fn()
        else:
            with tracer.compute(sub_batch=sub_batch, **op.labels):
                op.fn()


def run_programs(programs, labels=None, tracer=None, early=None):
    """Execute the sub-batch programs interleaved (Alg. 1/2); returns when all are done.
    ``tracer`` (an :class:`~megatron_oases.instrument.trace.Tracer`, optional) records each op.
    ``early`` (a :class:`~.comm.EarlyReductions`, optional): input-gradient all-reduces that
    Megatron's column linears start inside compute ops; the all-reduce ``Comm`` of that gradient
    adopts the started work instead of issuing another."""
    outer = tracer.context(**labels) if (tracer and labels) else contextlib.nullcontext()
    n = len(programs)
    pos = [0] * n
    pending = {}  # sub-batch -> its collective in flight (at most one each), in issue order
    ran_early = [set() for _ in programs]  # positions of early computes already run
    x = 0
    with outer:
        while True:
            prog = programs[x]
            if x in pending:  # data dependence: x's result before x goes on — but first the
                k = pos[x]  # early computes up to x's next collective, which need none of it
                while k < len(prog) and isinstance(prog[k], Compute):
                    if prog[k].early:
                        _run_compute(x, prog[k], tracer, early)
                        ran_early[x].add(k)
                    k += 1
                pending.pop(x).finish()
            while pos[x] < len(prog) and isinstance(prog[pos[x]], Compute):
                if pos[x] not in ran_early[x]:
                    _run_compute(x, prog[pos[x]], tracer, early)
                pos[x] += 1
            if pos[x] < len(prog):  # a Comm: queue it and switch
                pending[x] = _issue(x, prog[pos[x]], tracer, early)
                pos[x] += 1
            remaining = [i for i in range(n) if pos[i] < len(programs[i])]
            if not remaining:
                break
            x = next((i for i in remaining if i > x), remaining[0])  # round-robin
        for op in list(pending.values()):
            op.finish()
