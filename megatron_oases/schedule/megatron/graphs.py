"""A block's main op replayed from a captured CUDA graph (``--oases-cuda-graphs``).

The two-sub-batch schedules issue every kernel of a block twice, and on a fast GPU the host's
cost of issuing them, not the GPU, sets the step time (``docs/host-cost.md``). Here main_j (the
attention or MLP between its layernorm and its TMP reduction, which the schedule keeps outside:
:mod:`.deferral`) is captured once per input shape into a forward graph and a backward graph, then
each call is one replay of each. Design and limits: ``docs/schedules.md`` (CUDA graphs).

A captured graph owns static buffers: its inputs, its outputs, the tensors its backward needs and
its gradients. A *copy* (:class:`GraphedCall`) is therefore busy from a forward that autograd may
backpropagate through until that backward ran (or autograd dropped the graph); a call meanwhile
(the other sub-batch, the next micro-batch of a pipeline) takes another copy, captured on first
need. A forward without grad (the forward of a block recomputed later) returns clones and leaves
the copy free.

``mode="eager"`` runs the same bookkeeping (static buffers, copies, leases) with eager calls in
place of the replays: a debugging aid that runs on any device, and what the CPU tests exercise.
"""

import contextlib

import torch
from torch.utils._pytree import tree_flatten, tree_unflatten

from ...validation import CUDA_GRAPH_MODES
from ..engine.deferral import Deferral

#: copies of one block's graph at most (sub-batches × micro-batches in flight); more means a
#: forward whose backward never comes, i.e. a bug, not a schedule
MAX_COPIES = 16

_WARMUP = 3  # eager passes before capture (lazy inits, autotuning) on a side stream


@contextlib.contextmanager
def _no_rng_fork():
    """Megatron's core attention enters the tensor-parallel RNG fork around its dropout even at
    p = 0, and the fork reads and sets the CUDA generator's state, which a capture forbids. With
    the dropout at 0 (checked before the run) the fork draws nothing, so it is skipped while
    capturing."""
    from megatron.core.tensor_parallel import random

    tracker = random.get_cuda_rng_tracker()
    tracker.fork = lambda *args, **kwargs: contextlib.nullcontext()
    try:
        yield
    finally:
        del tracker.fork


def _kind(leaf, params):
    if leaf is None:
        return "none"
    if not isinstance(leaf, torch.Tensor):
        raise TypeError(f"oases: a graphed block returned a {type(leaf).__name__}")
    if any(leaf is p for p in params):
        return "param"  # a skip_bias_add bias: handed back as it is, outside the graph
    return "tensor"


def _clone(t):
    return None if t is None else t.clone()


class _Lease:
    """A copy's busy flag, cleared by the backward or when autograd frees the node."""

    __slots__ = ("call",)

    def __init__(self, call):
        self.call = call
        call.busy = True

    def release(self):
        if self.call is not None:
            self.call.busy, self.call = False, None

    def __del__(self):
        self.release()


class _Replay(torch.autograd.Function):
    """Autograd node of one replay: its inputs are the call's tensors and the op's parameters."""

    @staticmethod
    def forward(ctx, call, lease, *tensors):
        call.forward(tensors[: call.num_inputs])
        ctx.call, ctx.lease = call, lease
        outs = call.outputs()
        ctx.mark_non_differentiable(*[o for o, d in zip(outs, call.differentiable) if not d])
        return outs

    @staticmethod
    def backward(ctx, *grads):
        call, lease = ctx.call, ctx.lease
        ctx.call = ctx.lease = None
        grads_in = call.backward(grads)
        lease.release()
        return (None, None, *grads_in)


class GraphedCall:
    """One copy of ``fn(*args)``: static buffers and a forward graph, plus a backward graph when
    ``grad`` (or, in ``eager`` mode, eager calls on the same buffers). A copy for forwards without
    grad (blocks recomputed later) captures no backward and keeps no activations."""

    def __init__(self, fn, flat, spec, params, mode, grad, deferral):
        self.deferral = deferral  # the stage's (.deferral): its linears defer while captured
        self.fn, self.spec, self.params, self.mode, self.grad = fn, spec, list(params), mode, grad
        self.busy = False
        # static inputs (tensors), in flat order; non-tensor leaves are constants of the graph
        self.static = [
            (
                a.detach().clone().requires_grad_(grad and a.requires_grad)
                if isinstance(a, torch.Tensor)
                else a
            )
            for a in flat
        ]
        self.tensors_in = [a for a in self.static if isinstance(a, torch.Tensor)]
        self.num_inputs = len(self.tensors_in)
        self.wrt = [t for t in self.tensors_in if t.requires_grad] + self.params
        self.static_out = self.static_grad_out = self.static_grad_in = None
        self.live = None  # eager mode: the last forward's outputs, with their graph
        if mode == "capture":
            self._capture()

    # ------------------------------------------------------------------ running fn
    def _call(self):
        with self.deferral.deferring(early=None), torch.set_grad_enabled(self.grad):
            # no collective inside (the engine issues the reductions), grad as the copy's
            leaves, spec = tree_flatten(self.fn(*tree_unflatten(self.static, self.spec)))
        self.out_spec = spec
        self.kinds = [_kind(leaf, self.params) for leaf in leaves]
        outs = [leaf for leaf, k in zip(leaves, self.kinds) if k == "tensor"]
        self.differentiable = tuple(o.requires_grad for o in outs)
        self.passthrough = [leaf if k == "param" else None for leaf, k in zip(leaves, self.kinds)]
        return outs

    def _grads(self, outs, grad_outs):
        pairs = [(o, g) for o, g, d in zip(outs, grad_outs, self.differentiable) if d]
        return torch.autograd.grad(
            [o for o, _ in pairs], self.wrt, [g for _, g in pairs], allow_unused=True
        )

    def _capture(self):
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(_WARMUP):
                outs = self._call()
                if self.grad:
                    self._grads(outs, [torch.ones_like(o) for o in outs])
                del outs
        torch.cuda.current_stream().wait_stream(side)
        self.fwd_graph = torch.cuda.CUDAGraph()
        with _no_rng_fork():
            with torch.cuda.graph(self.fwd_graph, capture_error_mode="thread_local"):
                outs = self._call()
            self.static_out = [o.detach() for o in outs]
            if not self.grad:
                return
            self.static_grad_out = [torch.empty_like(o) for o in outs]
            self.bwd_graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(
                self.bwd_graph, pool=self.fwd_graph.pool(), capture_error_mode="thread_local"
            ):
                grads = self._grads(outs, self.static_grad_out)
        self.static_grad_in = [None if g is None else g.detach() for g in grads]

    # ------------------------------------------------------------------ one call
    def forward(self, tensors):
        for static, t in zip(self.tensors_in, tensors):
            if static.data_ptr() != t.data_ptr():
                static.detach().copy_(t)
        if self.mode == "capture":
            self.fwd_graph.replay()
            return
        outs = self._call()
        if self.static_out is None:
            self.static_out = [torch.empty_like(o) for o in outs]
            self.static_grad_out = [torch.empty_like(o) for o in outs]
        for static, o in zip(self.static_out, outs):
            static.copy_(o.detach())
        self.live = outs if self.grad else None

    def outputs(self):
        return tuple(o.detach() for o in self.static_out)

    def backward(self, grads):
        for static, g, d in zip(self.static_grad_out, grads, self.differentiable):
            if d and g is not None:
                static.copy_(g)
            elif d:
                static.zero_()
        if self.mode == "capture":
            self.bwd_graph.replay()
            grads_in = self.static_grad_in
        else:  # into static buffers too, so that aliasing bugs show without a GPU
            live, self.live = self.live, None
            grads = self._grads(live, self.static_grad_out)
            if self.static_grad_in is None:
                self.static_grad_in = [None if g is None else torch.empty_like(g) for g in grads]
            for static, g in zip(self.static_grad_in, grads):
                if g is not None:
                    static.copy_(g)
            grads_in = self.static_grad_in
        # The tensor inputs' gradients leave as clones: once this backward frees the copy, another
        # call may take it (the other sub-batch's recomputation) and overwrite its buffers before
        # this gradient's asynchronous reduction has read it. The parameters' gradients may stay
        # aliases: AccumulateGrad copies a gradient it does not own (the buffers keep a reference).
        it = iter(grads_in)
        out = [_clone(next(it)) if t.requires_grad else None for t in self.tensors_in]
        return out + [next(it) for _ in self.params]

    def assemble(self, outs):
        """The caller's output structure: graph outputs, parameters passed through, Nones."""
        it = iter(outs)
        leaves = [next(it) if k == "tensor" else p for k, p in zip(self.kinds, self.passthrough)]
        return tree_unflatten(leaves, self.out_spec)


class BlockGraphs:
    """The graphed main ops of a run's blocks: copies by (op, input shapes), captured on first
    need. One per run (the ``oases-schedule`` patch's), living across iterations."""

    def __init__(self, mode="capture"):
        if mode not in CUDA_GRAPH_MODES:
            raise ValueError(f"unknown --oases-cuda-graphs mode {mode!r}")
        self.mode = mode
        self.copies = {}
        self._params = {}  # id(owner) -> (owner, its parameters that take gradients)

    @property
    def captures(self):
        """Copies made so far (each captured once)."""
        return sum(len(c) for c in self.copies.values())

    def run(self, owner, fn, args, deferral=None):
        """``fn(*args)`` (``fn``'s parameters: ``owner``'s, whose linears defer to ``deferral``)
        through a free copy of its graph."""
        flat, spec = tree_flatten(args)
        tensors = [a for a in flat if isinstance(a, torch.Tensor)]
        if id(owner) not in self._params:
            self._params[id(owner)] = owner, [p for p in owner.parameters() if p.requires_grad]
        params = self._params[id(owner)][1]
        grad = torch.is_grad_enabled() and (bool(params) or any(t.requires_grad for t in tensors))
        key = (id(owner), str(spec), grad) + tuple(
            (
                (tuple(a.shape), a.dtype, a.device, a.requires_grad)
                if isinstance(a, torch.Tensor)
                else a
            )
            for a in flat
        )
        copies = self.copies.setdefault(key, [])
        call = next((c for c in copies if not c.busy), None)
        if call is None:
            if len(copies) >= MAX_COPIES:
                raise RuntimeError(
                    f"oases: {MAX_COPIES} copies of one graphed block are busy (a forward whose "
                    "backward never ran); run without --oases-cuda-graphs and report it"
                )
            deferral = Deferral() if deferral is None else deferral  # none: no linears of ours
            call = GraphedCall(fn, flat, spec, params, self.mode, grad, deferral)
            copies.append(call)
        if not grad:  # nothing will backpropagate: clones, and the copy stays free
            call.forward(tensors)
            return call.assemble([o.clone() for o in call.outputs()])
        return call.assemble(_Replay.apply(call, _Lease(call), *tensors, *call.params))
