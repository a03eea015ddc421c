"""Sequence parallelism without recomputation: keep the s/t shard, re-gather for backward.

Under SP a block's main op runs on the all-gathered ln output (s rows). Stock Megatron's
column-parallel linear saves only the local s/t shard for its weight gradient and re-gathers it in
backward; with the schedule owning the gather, the linear would save the whole gathered tensor
from forward to backward (t× the activation, per block). :func:`shard_saved` puts it back to
stock's footprint:

- the gathered tensor enters main_j through a grad sink (:func:`.cuts.grad_sink`) instead of a leaf (a leaf, and the
  ``AccumulateGrad`` node holding it, would keep its storage alive); the sink hands main_j's input
  gradient to the schedule, which reduce-scatters it;
- while main_j builds its graph, saved tensors that alias the gathered storage are packed as a
  :class:`Regathered` token (shape, strides, offset); backward unpacks them from the tensor the
  schedule all-gathered again just before main_j's backward (an overlapped collective, like the
  others). Saved tensors need only equal contents on unpack (``torch.autograd.graph``).
"""

import contextlib

import torch


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
