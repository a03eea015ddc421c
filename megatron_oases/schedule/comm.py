"""Deferred TMP communication: Megatron's linears compute, the schedule communicates.

While :func:`deferred_tmp_comm` is active (the engine runs a compute op), Megatron-Core's
tensor-parallel linears skip their own collectives, which the schedule's programs issue
asynchronously; a column linear's input-gradient all-reduce is started by Megatron itself on a
stand-in group that hands it to the schedule (:class:`EarlyReductions`). Stock behaviour outside
the context. Why and how: ``docs/schedules.md`` (deferred communication).
"""

import contextlib
import threading

import torch
import torch.distributed as dist


class _State(threading.local):
    """Per thread: the deferral flag, the column linears' :class:`EarlyReductions`, a supplied
    reduction and the embedding's scatter cut; class defaults, so reading one is an attribute
    access (the linears' wrappers read them on every call)."""

    defer = False
    early = None
    supply = None
    cut = None


_local = _State()


def deferring():
    return _local.defer


class deferred_tmp_comm:  # noqa: N801 (used as a context manager, like contextlib's)
    """Context: Megatron's TMP linears defer their communication to the schedule. ``early``:
    the :class:`EarlyReductions` that column linears called now hand their backward all-reduce
    to (None: the engine issues it after the backward op). Reusable and reentrant (the engine
    enters one object around every compute op, nested where a yield point runs another
    sub-batch's ops); a class, not a generator, whose machinery cost more Python than the
    op's own bookkeeping."""

    __slots__ = ("enabled", "early", "outer")

    def __init__(self, enabled=True, early=None):
        self.enabled, self.early, self.outer = enabled, early, []

    def __enter__(self):
        self.outer.append((_local.defer, _local.early))
        _local.defer, _local.early = self.enabled, self.early
        return self

    def __exit__(self, *exc):
        _local.defer, _local.early = self.outer.pop()
        return False


def start_collective(kind, tensor, group, op=dist.ReduceOp.SUM):
    """Start ``kind`` (see :data:`.executor.KINDS`) asynchronously; returns (work, a function giving
    the result after it). Calls the ``torch.distributed`` functions as wrapped now (emulator,
    tracer)."""
    if kind == "all_reduce":
        return dist.all_reduce(tensor, op=op, group=group, async_op=True), lambda: tensor
    n = dist.get_world_size(group)
    if kind == "all_gather" and isinstance(tensor, tuple):
        k, shape = len(tensor), tuple(tensor[0].shape)
        work, out = start_collective("all_gather", torch.stack(tensor), group)  # [n·k, *shape]

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
    work = dist.reduce_scatter_tensor(out, tensor, op=op, group=group, async_op=True)
    return work, lambda: out


class _Started:
    """What Megatron's column linear gets back from its all-reduce: ``wait()`` returns at once;
    the schedule waits on the real work when the gradient is needed."""

    def wait(self, *args, **kwargs):
        return True

    def is_completed(self):
        return False


class EarlyReductions:
    """Input-gradient reductions that Megatron's column linears started in a backward op, by the
    storage of the gradient they reduce, until the engine's collective for that gradient adopts
    them (:meth:`take`): an all-reduce in place or, under sequence parallelism, a reduce-scatter
    into a new s/t tensor. One per micro-batch's schedule; :meth:`check_empty` after the
    backward proves every one was adopted (so waited on)."""

    def __init__(self):
        self._started = {}

    def start(self, all_reduce, tensor, group, op, scatter=False):
        if scatter:
            work, scattered = start_collective("reduce_scatter", tensor, group, op)
            result = scattered()
        else:
            result, work = tensor, all_reduce(tensor, op=op, group=group, async_op=True)
        self._started[tensor.untyped_storage().data_ptr()] = (tensor, work, result, scatter)
        return _Started()

    def take(self, tensor, scatter=False):
        """``(work, result)`` of the reduction started on ``tensor``'s storage, or None (then
        nothing reduced it yet)."""
        found = self._started.pop(tensor.untyped_storage().data_ptr(), None)
        if found is None:
            return None
        started, work, result, scattered = found
        if (
            started.shape != tensor.shape
            or started.data_ptr() != tensor.data_ptr()
            or scattered != scatter
        ):
            raise RuntimeError("oases: an input-gradient reduction covers another tensor")
        return work, result

    def check_empty(self):
        if self._started:
            for _, work, _, _ in self._started.values():
                work.wait()
            self._started.clear()
            raise RuntimeError(
                "oases: a column-parallel linear's input-gradient reduction was started but no "
                "collective of the schedule took it (Megatron changed?)"
            )


class ReducingGroup:
    """Stands in for a column linear's TP group from its forward (saved in the autograd context)
    to its backward, whose ``torch.distributed.all_reduce(grad_input, group=..., async_op=True)``
    :func:`make_all_reduce` routes to ``early`` (``scatter``: as a reduce-scatter, for a linear
    whose input the schedule all-gathered under sequence parallelism). Only ``size()``/``rank()``
    are delegated: any other use of it fails loudly instead of talking to the wrong group."""

    __slots__ = ("group", "early", "scatter")

    def __init__(self, group, early, scatter=False):
        self.group, self.early, self.scatter = group, early, scatter

    def size(self):
        return self.group.size()

    def rank(self):
        return self.group.rank()


def make_all_reduce(original):
    """Replacement for ``torch.distributed.all_reduce`` (outermost, installed after the tracer
    and the link emulator): a call on a :class:`ReducingGroup` starts the real all-reduce through
    ``original`` and hands it to the schedule; every other call is ``original``'s."""

    def all_reduce(tensor, op=dist.ReduceOp.SUM, group=None, async_op=False):
        if isinstance(group, ReducingGroup):
            if not async_op:
                raise RuntimeError("oases: a synchronous all-reduce on a column linear's group")
            return group.early.start(original, tensor, group.group, op, group.scatter)
        return original(tensor, op=op, group=group, async_op=async_op)

    all_reduce.__name__ = all_reduce.__qualname__ = original.__name__
    all_reduce.__wrapped__ = original
    return all_reduce


@contextlib.contextmanager
def supplied_reduction(reduced):
    """The next deferred reduction returns ``reduced`` (its result, computed by the schedule)
    instead of its input; used once."""
    prev = _local.supply
    _local.supply = reduced
    try:
        yield
    finally:
        unused = _local.supply is not None
        _local.supply = prev
        if unused:
            raise RuntimeError("oases: a supplied reduction was not consumed (Megatron changed?)")


def make_deferred_reduction(original, scatters=False):
    """Replacement for ``layers.reduce_from_tensor_model_parallel_region`` or (``scatters``)
    ``layers.reduce_scatter_to_sequence_parallel_region``: the identity while deferring, or the
    result :func:`supplied_reduction` gives; a reduce-scatter inside :func:`cut_at_scatter` is
    cut there (its backward is the all-gather the schedule issues)."""

    def reduction(input_, *args, **kwargs):
        if not _local.defer:
            return original(input_, *args, **kwargs)
        if scatters and _local.cut is not None:
            group = kwargs.get("group", args[0] if args else None)
            if group is None:
                raise RuntimeError("oases: a reduce-scatter to cut without its group")
            n = input_.size(0) // group.size()
            return _cut(input_, input_[group.rank() * n : (group.rank() + 1) * n])
        supplied = _local.supply
        if supplied is None:
            return input_
        _local.supply = None
        scattered = scatters and input_.size(0) % max(supplied.size(0), 1) == 0
        if supplied.shape != input_.shape and not (
            scattered and supplied.shape[1:] == input_.shape[1:]
        ):
            raise RuntimeError(
                f"oases: supplied reduction of shape {tuple(supplied.shape)} for an input "
                f"of shape {tuple(input_.shape)}"
            )
        return supplied

    reduction.__name__ = reduction.__qualname__ = original.__name__
    reduction.__wrapped__ = original
    return reduction


def _gathers(linear, args, kwargs):
    """Whether a ColumnParallelLinear call all-gathers its output (``runtime_gather_output``
    overrides ``gather_output``)."""
    runtime = kwargs.get("runtime_gather_output", args[1] if len(args) > 1 else None)
    return linear.gather_output if runtime is None else runtime


def make_column_forward(original):
    """Replacement for ``ColumnParallelLinear.forward`` honouring the deferral flag. The
    attributes a deferred call overrides are written in the instance's ``__dict__`` (plain
    attributes there: read with ``[]``, which fails loudly were one to become a property), not
    through ``nn.Module.__setattr__``, a Python call each, six per linear call."""

    def forward(self, input_, *args, **kwargs):
        if not _local.defer:
            return original(self, input_, *args, **kwargs)
        d = self.__dict__
        try:
            saved = (
                d["tp_group"],
                d["allreduce_dgrad"],
                d["disable_grad_reduce"],
                d["sequence_parallel"],
            )
        except KeyError as e:
            raise RuntimeError(
                f"oases: ColumnParallelLinear has no instance attribute {e} (Megatron changed?); "
                "run with --oases-schedule off and report it"
            ) from None
        early = _local.early
        reduces = saved[1] or saved[3]  # allreduce_dgrad or sequence_parallel (never both)
        gathers = _gathers(self, args, kwargs) if (args or kwargs) else self.gather_output
        if early is not None and reduces and not gathers:
            # under SP the input is gathered by the schedule: reduce-scatter its gradient
            d["tp_group"] = ReducingGroup(saved[0], early, scatter=saved[3])
            d["allreduce_dgrad"], d["sequence_parallel"] = True, False
        else:
            d["allreduce_dgrad"], d["disable_grad_reduce"], d["sequence_parallel"] = (
                False,
                True,
                False,
            )
        try:
            return original(self, input_, *args, **kwargs)
        finally:
            d["tp_group"], d["allreduce_dgrad"], d["disable_grad_reduce"] = saved[:3]
            d["sequence_parallel"] = saved[3]

    forward.__wrapped__ = original
    return forward


@contextlib.contextmanager
def cut_at_scatter():
    """Within the context, the embedding's split along the sequence (Megatron's
    ``scatter_to_sequence_parallel_region``, or with RoPE its deferred reduce-scatter), whose
    backward all-gathers, returns its local shard as a new autograd leaf and records
    ``(input, leaf)`` in the yielded list: a backward through the output then stops at the leaf,
    and the schedule all-gathers ``leaf.grad`` itself before continuing from ``input``. Used
    exactly once (else Megatron changed)."""
    prev = _local.cut
    cuts = _local.cut = []
    try:
        yield cuts
    finally:
        _local.cut = prev
    if len(cuts) != 1:
        raise RuntimeError(
            f"oases: the embedding scattered its output {len(cuts)} times, expected once "
            "(Megatron changed?); run with --oases-schedule off and report it"
        )


def _cut(input_, local):
    leaf = local.detach().requires_grad_(input_.requires_grad)
    _local.cut.append((input_, leaf))
    return leaf


def make_scatter(original):
    """Replacement for ``tensor_parallel.scatter_to_sequence_parallel_region`` honouring
    :func:`cut_at_scatter`; stock outside it."""

    def scatter(input_, *args, **kwargs):
        if _local.cut is None:
            return original(input_, *args, **kwargs)
        with torch.no_grad():
            return _cut(input_, original(input_.detach(), *args, **kwargs))

    scatter.__name__ = scatter.__qualname__ = original.__name__
    scatter.__wrapped__ = original
    return scatter
