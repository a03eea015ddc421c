"""What the executor needs to communicate: starting a collective asynchronously
(:func:`start_collective`), and the column linears' input-gradient reductions that Megatron itself
started inside a backward op, kept until the program's collective of that gradient adopts them
(:class:`EarlyReductions`). No Megatron here: how Megatron's own TMP communication is deferred
to the schedule is :mod:`.deferral`, and the column linears that start those early reductions
are :mod:`.linears`.
"""

import collections

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


class EarlyReductions:
    """Input-gradient reductions that a scheduled stage's column linears started inside a
    backward op (:func:`.linears.linear_with_early_dgrad`), in the order started, until the
    program's collective of that gradient adopts them (:meth:`take`): an all-reduce in place or,
    under sequence parallelism, a reduce-scatter into a new s/t tensor. A backward op's
    collectives follow it in its program, before any other op of that sub-batch, so the oldest
    started is the one the next collective wants; :meth:`take` checks it is the very gradient
    tensor. One per micro-batch's schedule; :meth:`check_empty` after the backward proves every
    one was adopted (so waited on)."""

    def __init__(self):
        self._started = collections.deque()

    def start(self, tensor, group, scatter=False):
        """Start the reduction of ``tensor`` on ``group`` (``scatter``: a reduce-scatter)."""
        work, result = start_collective(
            "reduce_scatter" if scatter else "all_reduce", tensor, group
        )
        self._started.append((tensor, work, result, scatter))

    def take(self, tensor, scatter=False):
        """``(work, result function)`` of the reduction started on ``tensor``, or None (then
        nothing reduced it yet)."""
        if not self._started or self._started[0][0] is not tensor:
            if any(started is tensor for started, _, _, _ in self._started):
                raise RuntimeError("oases: input-gradient reductions adopted out of order")
            return None
        _, work, result, scattered = self._started.popleft()
        if scattered != scatter:
            raise RuntimeError("oases: an input-gradient reduction of another kind")
        return work, result

    def check_empty(self):
        if self._started:
            for _, work, _, _ in self._started:
                work.wait()
            self._started.clear()
            raise RuntimeError(
                "oases: a column-parallel linear's input-gradient reduction was started but no "
                "collective of the schedule took it (Megatron changed?)"
            )
