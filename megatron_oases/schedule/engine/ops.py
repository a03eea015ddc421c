"""The ops a schedule's programs are made of, for one micro-batch of a stage's blocks.

:class:`BlockOps` knows the micro-batch's settings (which blocks keep their graphs, sequence
parallelism, the split's chunk attention) and makes the :class:`~.executor.Compute` and
:class:`~.executor.Comm` ops that the forward (:mod:`.forward`) and backward (:mod:`.backward`)
program builders put in order; the backward bodies the ops run are in :mod:`.backward`. Design
notes: ``docs/schedules.md``.
"""

import functools
from typing import Callable, NamedTuple

import torch

from .cuts import grad_sink, joined_reduction
from .executor import Comm, Compute


class RngStates(NamedTuple):
    """The RNG states an op that may run again re-runs under: ``snapshot()`` takes them (before
    the op's first run), ``replay(snapshot)`` is a context that runs under a snapshot and then
    returns to the current states, so a recomputation's dropout masks equal the forward's. The
    caller gives them (Megatron's: CPU, device and its model-parallel tracker)."""

    snapshot: Callable[[], object]
    replay: Callable[[object], object]


class BlockOps:
    """Op factories over ``blocks`` (a :class:`.blocks.LayerBlocks`) for one micro-batch.

    ``first_kept``: blocks from this one on keep their autograd graphs from forward; the ones
    before it are recomputed in backward. ``anchor``: a scalar that requires grad, putting
    :func:`.cuts.grad_sink` nodes in the graph. ``prefix``: the sequence split's shared
    chunk attention (the split's ``prefix_attention``), or None. ``rng``: :class:`RngStates`."""

    def __init__(self, blocks, microbatch, tracer, first_kept, anchor, prefix, rng):
        self.blocks, self.microbatch, self.tracer = blocks, microbatch, tracer
        self.first_kept, self.anchor, self.prefix = first_kept, anchor, prefix
        self.rng = rng
        # Sequence parallelism: an all-gather before each block's main op, and the block's
        # reduction is a reduce-scatter (see :mod:`.blocks`).
        self.sp = blocks.sequence_parallel
        self.reduction = "reduce_scatter" if self.sp else "all_reduce"
        self.zeros = {}  # zero tensors by shape, for backward's bda probes (:mod:`.backward`)
        self.placeholders = {}  # a one-element tensor per (device, dtype), see free_data
        self._labels = {}  # (j, pass) -> labels: built once per micro-batch, not once per op
        self._groups = {}  # j -> block j's TP group

    def keeps(self, j):
        """Block j keeps its autograd graph from forward (its layer is not recomputed)."""
        return j >= self.first_kept

    def regathers(self, j):
        """SP with block j's graph kept: main_j's saved input stays an s/t shard, re-gathered
        before its backward (:mod:`.regather`), as stock Megatron's SP linears do."""
        return self.sp and self.keeps(j)

    # ------------------------------------------------------------------ op factories
    def labels(self, j, pass_):
        """Tracer labels of block j's ops (``pass`` is a keyword, hence the dict)."""
        labels = self._labels.get((j, pass_))
        if labels is None:
            labels = self._labels[(j, pass_)] = {
                "pass": pass_,
                "layer": self.blocks.global_layer(j),
                "block": self.blocks.kind(j),
            }
        return labels

    def compute(self, fn, j, pass_, early=False, light=False):
        op = Compute(fn, early, light)
        if self.tracer is not None:  # labels are for the trace only
            op.labels = self.labels(j, pass_)
        return op

    def light(self, fn, j, pass_):
        return self.compute(fn, j, pass_, light=True)

    def group(self, j):
        group = self._groups.get(j)
        if group is None:
            group = self._groups[j] = self.blocks.tp_group(j)
        return group

    def collective(self, kind, get, done, j, pass_):
        """``kind`` of ``get()`` on block j's TP group; ``done(result)`` when it completed."""
        op = Comm(get, done, self.group(j), kind)
        if self.tracer is not None:
            op.labels = self.labels(j, pass_)
        return op

    def reduce(self, get, done, j, pass_):
        """Block j's reduction (all-reduce; reduce-scatter under SP)."""
        return self.collective(self.reduction, get, done, j, pass_)

    def queued(self, j, pass_, n, get, done):
        """``n`` all-reduces of block j's runs of tokens (tail pieces, :mod:`.forward`):
        ``get(i)``, then ``done(i, result)`` in issue order. The sub-batch goes on after each
        but the last (``Comm(switch=False)``), which hands over as a whole block's would."""
        return [
            Comm(
                get=lambda i=i: get(i),
                done=lambda t, i=i: done(i, t),
                group=self.group(j),
                switch=i == n - 1,
                **self.labels(j, pass_),
            )
            for i in range(n)
        ]

    # ------------------------------------------------------------------ tensors
    @staticmethod
    def store(block, name):
        """A ``done``/sink callback putting its tensor into ``block``'s slot ``name`` (a partial
        of ``setattr``: no Python frame per call)."""
        return functools.partial(setattr, block, name)

    def sink(self, x, store):
        """``x`` as an op's input whose gradient goes to ``store(g)``
        (:func:`.cuts.grad_sink`, a graph cut)."""
        return grad_sink(self.anchor, x, store)

    def block_input(self, block, H, residual=True):
        """H_j as block j's inputs: ln_j's through a sink whose gradient adds to the block's
        input gradient, and (``residual``) bda_j's residual in ``block.residual``, an alias
        without a graph. bda is ``residual + dropout(...)``, so the residual's gradient is bda's
        output gradient itself (bda_j's backward, :mod:`.backward`, starts the input gradient
        with it); a leaf used by both would make ``AccumulateGrad`` copy that gradient
        into ``.grad``.
        The alias is ``.data`` (no aten call): bda's add reads the residual and saves nothing,
        so no saved-tensor version check needs the shared counter ``detach()`` would keep."""
        if residual:
            block.residual = H.data if H.requires_grad else H
        return self.sink(H, block.add_input_grad)

    def free_data(self, P):
        """Free a kept graph's root's data (backward needs its ``grad_fn`` only), as Megatron's
        ``deallocate_output_tensor`` does, onto one shared placeholder per (device, dtype)
        instead of a new tensor each time. A view is left alone: its base holds the data."""
        if P._base is not None:
            return
        key = (P.device, P.dtype)
        placeholder = self.placeholders.get(key)
        if placeholder is None:
            placeholder = self.placeholders[key] = torch.empty((1,), device=P.device, dtype=P.dtype)
        P.data = placeholder

    def main(self, sb, j, x):
        """main_j of sub-batch ``sb`` on ``x``: (partial sum, bias)."""
        if self.prefix is None:
            return self.blocks.main(j, x, sb.mask, sb.rotary)
        with self.prefix.running(sb.index):
            return self.blocks.main(j, x, sb.mask, sb.rotary)

    def norm_output_ready(self, block, norm_output, main):
        """Hand ln_j's output to the all-gather (SP) or straight to ``main``."""
        if self.sp:
            block.outbox = norm_output.detach()
        else:
            main(norm_output)

    def to_main(self, sb, j, pass_, first, main, early=False):
        """Ops from block j's input to its partial sum: ``first`` (ln; without sequence
        parallelism also main), then under SP the all-gather of the ln output and ``main(x)``.
        ``early``: ``first`` needs only saved tensors (see :class:`.executor.Compute`)."""
        block = sb.blocks[j]
        # under SP ``first`` is only ln (with bda_{j-1} before it): a light op
        ops = [self.compute(first, j, pass_, early=early, light=self.sp)]
        if self.sp:
            done = lambda t: setattr(block, "gathered", t)  # noqa: E731
            ops.append(self.collective("all_gather", lambda: block.take("outbox"), done, j, pass_))
            ops.append(self.compute(lambda: main(block.take("gathered")), j, pass_))
        return ops

    def joins(self, block):
        """Block's R_j joins main_j's graph (:meth:`reduced_input`): without SP and for a whole
        block (not run in runs of tokens), where nothing happens between bda_j's backward and
        main_j's: one backward call for both, no cut at R_j."""
        return not self.sp and block.pieces is None

    def reduced_input(self, block):
        """R_j as bda_j's input: joined to main_j's graph where :meth:`joins`, else a sink whose
        gradient goes to the block's ``reduced_grad`` (the backward collective comes first)."""
        R = block.take("reduced")
        if self.joins(block):
            return joined_reduction(block.take("partial"), R)
        return self.sink(R, self.store(block, "reduced_grad"))
