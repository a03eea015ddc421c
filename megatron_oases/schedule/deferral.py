"""Megatron's own TMP communication, deferred to the schedule: the replacements that read the
engine's per-thread state, and that state.

While the engine runs a compute op, Megatron-Core's tensor-parallel linears skip their own
collectives, which the schedule's programs issue asynchronously (:mod:`.comm` starts them); a
column linear's input-gradient all-reduce is started by Megatron itself on a stand-in group that
hands it to the schedule (:class:`.comm.EarlyReductions`). Outside the engine every replacement
is stock. Why and how: ``docs/schedules.md`` (deferred communication; the hand-offs).

Megatron's linears are called deep inside its modules, where no argument of ours reaches them, so
the engine tells them through one thread-local, :data:`_local`:

======  ==============================================  ===========================================
field   set by (a context)                              read by (a replacement)
======  ==============================================  ===========================================
defer   :class:`deferred_tmp_comm`: ``executor.         :func:`make_deferred_reduction` (returns its
        run_programs`` around a run (the engine's       input), :func:`make_column_forward` (no
        ``compute_context``), ``graphs`` at capture     collective of its own)
early   the same, with the micro-batch's                :func:`make_column_forward`: the call's
        ``EarlyReductions`` (engine)                    ``tp_group`` is a :class:`ReducingGroup`
supply  :func:`supplied_reduction`, in                  :func:`make_deferred_reduction`: the next
        ``stage_ends.EmbeddingEnd._finish``             reduction returns it, once
cut     :func:`cut_at_scatter`, in ``stage_ends.        :func:`make_scatter`, and under SP
        EmbeddingEnd._backward_to_scatter``             :func:`make_deferred_reduction`: cut there
======  ==============================================  ===========================================

The one hand-off that does not go through it: a column linear's forward saves its ``tp_group``
(then a :class:`ReducingGroup`) in its autograd context; its backward calls
``torch.distributed.all_reduce(grad_input, group=...)``, which :func:`make_all_reduce` routes
to ``EarlyReductions.start`` (keyed by the gradient's storage), where the program's next
collective of that gradient adopts it (``EarlyReductions.take``, from ``executor._issue``).
"""

import contextlib
import threading

import torch
import torch.distributed as dist


class _State(threading.local):
    """Per thread: the fields of the table above; class defaults, so reading one is an
    attribute access (the linears' wrappers read them on every call)."""

    defer = False
    early = None
    supply = None
    cut = None


_local = _State()


def deferring():
    return _local.defer


class deferred_tmp_comm:  # noqa: N801 (used as a context manager, like contextlib's)
    """Context: Megatron's TMP linears defer their communication to the schedule. ``early``:
    the :class:`.comm.EarlyReductions` that column linears called now hand their backward
    all-reduce to (None: the engine issues it after the backward op). Reusable and reentrant
    (the engine enters one object around every compute op, nested where a yield point runs
    another sub-batch's ops); a class, not a generator, whose machinery cost more Python than
    the op's own bookkeeping."""

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
