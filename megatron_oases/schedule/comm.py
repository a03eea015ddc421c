"""Deferred TMP communication: Megatron's linears compute, the schedule communicates.

While :func:`deferred_tmp_comm` is active (the schedule engine runs a compute op), Megatron-Core's
tensor-parallel linears skip their own all-reduces:

- ``RowParallelLinear``: the forward all-reduce (``layers.reduce_from_tensor_model_parallel_region``,
  imported by name into ``layers``) returns the partial sum unchanged; the engine all-reduces it
  asynchronously. Its backward is the identity (paper eq. 1), so nothing is lost.
- ``ColumnParallelLinear``: the backward all-reduce of the input gradient (``allreduce_dgrad``,
  read at forward time and saved in the autograd context) is switched off for that call; the
  engine all-reduces the input gradient asynchronously.

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


def make_reduce_from_tp_region(original):
    """Replacement for ``layers.reduce_from_tensor_model_parallel_region``."""

    def reduce_from_tensor_model_parallel_region(input_, group=None):
        if deferring():
            return input_
        return original(input_, group=group)

    reduce_from_tensor_model_parallel_region.__wrapped__ = original
    return reduce_from_tensor_model_parallel_region


def make_column_forward(original):
    """Replacement for ``ColumnParallelLinear.forward`` honouring the deferral flag."""

    def forward(self, input_, *args, **kwargs):
        if not deferring():
            return original(self, input_, *args, **kwargs)
        saved = self.allreduce_dgrad, self.disable_grad_reduce
        self.allreduce_dgrad, self.disable_grad_reduce = False, True
        try:
            return original(self, input_, *args, **kwargs)
        finally:
            self.allreduce_dgrad, self.disable_grad_reduce = saved

    forward.__wrapped__ = original
    return forward
