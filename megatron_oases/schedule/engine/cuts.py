"""Where a schedule cuts the autograd graph between its ops, and where it joins it again.

A block's forward and backward run as several ops with collectives between them, so its graph is
cut at each collective: the gradient that arrives at a cut is handed to the schedule, which
communicates it and feeds the next backward op. The cuts cost one aten call each and keep no
tensor alive that stock Megatron's graph would not (design: ``docs/schedules.md``, host cost:
``docs/host-cost.md``).
"""

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
    gradient flows on to ``partial``'s graph: an all-reduce's backward is the identity, so where
    nothing runs between the two backward ops the cut is not needed. No aten call; ``reduced``
    travels in a tuple, so the node owns it rather than a view of it."""
    return _Joined.apply(partial, (reduced,))
