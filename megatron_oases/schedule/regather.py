"""Sequence parallelism without recomputation: keep the s/t shard, re-gather for backward.

Under SP a block's main op runs on the all-gathered ln output (s rows). Stock Megatron's
column-parallel linear saves only the local s/t shard for its weight gradient and re-gathers it in
backward; with the schedule owning the gather, the linear would save the whole gathered tensor
from forward to backward (t× the activation, per block). :func:`shard_saved` puts it back to
stock's footprint:

- the gathered tensor enters main_j through :func:`grad_sink` instead of a leaf (a leaf, and the
  ``AccumulateGrad`` node holding it, would keep its storage alive); the sink hands main_j's input
  gradient to the schedule, which reduce-scatters it;
- while main_j builds its graph, saved tensors that alias the gathered storage are packed as a
  :class:`Regathered` token (shape, strides, offset); backward unpacks them from the tensor the
  schedule all-gathered again just before main_j's backward (an overlapped collective, like the
  others). Saved tensors need only equal contents on unpack (``torch.autograd.graph``).
"""

import contextlib

import torch


class _GradSink(torch.autograd.Function):
    """See :func:`grad_sink`. ``box`` is a 1-tuple holding ``x``: autograd does not follow a
    tensor inside a tuple, so the node has no edge into ``x``'s own graph (the sink is a cut)."""

    @staticmethod
    def forward(ctx, anchor, box, sink):
        ctx.sink = sink
        # a new tensor object for the node to own (returning x would make autograd view it)
        return box[0].detach()

    @staticmethod
    def backward(ctx, grad):
        sink, ctx.sink = ctx.sink, None
        sink(grad)
        return None, None, None


def grad_sink(anchor, x, sink):
    """``x`` (with or without a graph) as an op's input whose gradient goes to ``sink(grad)`` and
    stops there: a graph cut. ``anchor`` (a scalar that requires grad) puts the node in the graph.
    Unlike a leaf (``x.detach().requires_grad_()``), nothing keeps ``x`` alive but the graph's own
    saved tensors, and no ``AccumulateGrad`` copies the gradient. One aten call (a detach)."""
    return _GradSink.apply(anchor, (x,), sink)


class _Joined(torch.autograd.Function):
    """See :func:`joined_reduction`."""

    @staticmethod
    def forward(ctx, partial, box):
        return box[0]

    @staticmethod
    def backward(ctx, grad):
        return grad, None


def joined_reduction(partial, reduced):
    """``reduced`` (the all-reduce of ``partial``, computed outside autograd) as a tensor whose
    gradient flows on to ``partial``'s graph: an all-reduce's backward is the identity. No aten
    call; ``reduced`` travels in a tuple, so the node owns it rather than a view of it."""
    return _Joined.apply(partial, (reduced,))


class Regathered:
    """A saved tensor that aliased the gathered input: where it sits in the re-gathered one."""

    __slots__ = ("size", "stride", "offset")

    def __init__(self, t):
        self.size, self.stride, self.offset = t.size(), t.stride(), t.storage_offset()


@contextlib.contextmanager
def shard_saved(gathered, regathered):
    """Pack tensors saved in this context that alias ``gathered``'s storage; unpack them from
    ``regathered()`` (the tensor all-gathered again before backward, same layout)."""
    storage = gathered.untyped_storage().data_ptr()

    def pack(t):
        if t.untyped_storage().data_ptr() == storage:
            return Regathered(t)
        return t

    def unpack(saved):
        if isinstance(saved, Regathered):
            return regathered().as_strided(saved.size, saved.stride, saved.offset)
        return saved

    with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
        yield
