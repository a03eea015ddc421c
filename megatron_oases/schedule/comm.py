"""What the executor needs to communicate: starting a collective asynchronously
(:func:`start_collective`), and the column linears' input-gradient reductions that Megatron itself
started inside a backward op, kept until the program's collective of that gradient adopts them
(:class:`EarlyReductions`). No Megatron and no thread-local here: how Megatron's own TMP
communication is deferred to the schedule, and how those early reductions reach
:class:`EarlyReductions`, is :mod:`.deferral`.
"""

import torch
import torch.distributed as dist


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
