"""Deferred TMP communication: Megatron's linears compute, the schedule communicates.

While :func:`deferred_tmp_comm` is active (the schedule engine runs a compute op), Megatron-Core's
tensor-parallel linears skip their own all-reduces:

- ``RowParallelLinear``: the forward all-reduce (``layers.reduce_from_tensor_model_parallel_region``,
  imported by name into ``layers``) returns the partial sum unchanged; the engine all-reduces it
  asynchronously. Its backward is the identity (paper eq. 1), so nothing is lost. Under sequence
  parallelism the same holds for its reduce-scatter
  (``layers.reduce_scatter_to_sequence_parallel_region``), whose backward (an all-gather of the
  output gradient) the engine then issues itself.
- ``ColumnParallelLinear``: the backward all-reduce of the input gradient (``allreduce_dgrad``,
  read at forward time and saved in the autograd context) is switched off for that call; the
  engine all-reduces the input gradient asynchronously. Under sequence parallelism its input
  all-gather (forward) and input-gradient reduce-scatter (backward) are switched off the same way
  (``sequence_parallel`` is read at forward time too): the engine passes the gathered input and
  reduce-scatters the gradient. The linear then keeps the gathered input for its weight gradient
  instead of re-gathering it in backward (see :mod:`.engine` for what that costs in memory).

The stage ends (:mod:`.stage`) run the vocab-parallel embedding in two steps around the schedule's
all-reduce: its lookup while deferring (the partial sum), then Megatron's whole embedding forward
with :func:`supplied_reduction` giving the all-reduced sum to the embedding's reduction, so every
op after it (positions, dropout, ...) is Megatron's own.

Outside the context both behave exactly as stock. The flag is thread-local: autograd on CPU runs
re-entrant backward on the calling thread, and the engine never hands work to other threads.
"""

import contextlib
import threading

_local = threading.local()


def deferring():
    return getattr(_local, "defer", False)


@contextlib.contextmanager
def deferred_tmp_comm(enabled=True):
    prev = deferring()
    _local.defer = enabled
    try:
        yield
    finally:
        _local.defer = prev


@contextlib.contextmanager
def supplied_reduction(reduced):
    """The next deferred reduction returns ``reduced`` (its result, computed by the schedule)
    instead of its input; used once."""
    prev = getattr(_local, "supply", None)
    _local.supply = reduced
    try:
        yield
    finally:
        unused = getattr(_local, "supply", None) is not None
        _local.supply = prev
        if unused:
            raise RuntimeError("oases: a supplied reduction was not consumed (Megatron changed?)")


def make_deferred_reduction(original):
    """Replacement for ``layers.reduce_from_tensor_model_parallel_region`` or
    ``layers.reduce_scatter_to_sequence_parallel_region``: the identity while deferring (or the
    result :func:`supplied_reduction` gives)."""

    def reduction(input_, *args, **kwargs):
        if deferring():
            supplied = getattr(_local, "supply", None)
            if supplied is None:
                return input_
            _local.supply = None
            if supplied.shape != input_.shape:
                raise RuntimeError(
                    f"oases: supplied reduction of shape {tuple(supplied.shape)} for an input "
                    f"of shape {tuple(input_.shape)}"
                )
            return supplied
        return original(input_, *args, **kwargs)

    reduction.__name__ = reduction.__qualname__ = original.__name__
    reduction.__wrapped__ = original
    return reduction


def make_column_forward(original):
    """Replacement for ``ColumnParallelLinear.forward`` honouring the deferral flag."""

    def forward(self, input_, *args, **kwargs):
        if not deferring():
            return original(self, input_, *args, **kwargs)
        saved = self.allreduce_dgrad, self.disable_grad_reduce, self.sequence_parallel
        self.allreduce_dgrad, self.disable_grad_reduce, self.sequence_parallel = False, True, False
        try:
            return original(self, input_, *args, **kwargs)
        finally:
            self.allreduce_dgrad, self.disable_grad_reduce, self.sequence_parallel = saved

    forward.__wrapped__ = original
    return forward
