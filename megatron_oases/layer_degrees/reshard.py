"""Resharding between layers of different TMP degree, as autograd functions (batch dim 1 of [s,b,h]).

A degree-d group holds (replicated within the group) the activations of its batch share. Going
from degree ``a`` to ``b``:

- ``b < a`` (shrink): each rank keeps its slice of the share — no communication; backward
  all-gathers the gradient slices over the (b, a) pair group.
- ``b > a`` (grow): all-gather the shares over the (a, b) pair group; backward keeps its slice.

The slice index inside the pair group is ``(local % max) // min``, which is also the rank order of
the pair group, so gather order = batch order.
"""

import torch
import torch.distributed as dist


def _gather_batch(x, group):
    n = dist.get_world_size(group)
    parts = [torch.empty_like(x) for _ in range(n)]
    dist.all_gather(parts, x.contiguous(), group=group)
    return torch.cat(parts, dim=1)


def _slice_batch(x, n, index):
    return torch.chunk(x, n, dim=1)[index].contiguous()


class _Shrink(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, n, index, group):
        ctx.group = group
        return _slice_batch(x, n, index)

    @staticmethod
    def backward(ctx, g):
        return _gather_batch(g, ctx.group), None, None, None


class _Grow(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, n, index, group):
        ctx.n, ctx.index = n, index
        return _gather_batch(x, group)

    @staticmethod
    def backward(ctx, g):
        return _slice_batch(g, ctx.n, ctx.index), None, None, None


def reshard(x, from_degree, to_degree, groups):
    """Move [s, b_share, h] activations from one TMP degree's batch sharing to another's."""
    if from_degree == to_degree:
        return x
    small, big = sorted((from_degree, to_degree))
    n = big // small
    index = (groups.local % big) // small
    group = groups.pair_group(small, big)
    fn = _Shrink if to_degree < from_degree else _Grow
    return fn.apply(x, n, index, group)
