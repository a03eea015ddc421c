"""The overlapped TMP schedule of one pipeline stage's layers, as one autograd node (paper §3).

:func:`run_scheduled` runs a :class:`ScheduledLayers` as that node. Forward cuts the micro-batch
into sub-batches (the ``split`` the caller gives), builds each one's forward program
(:mod:`.forward`) and runs them interleaved (:mod:`.executor`), so one sub-batch's collective
hides behind another's compute. Backward builds the schedule's backward rounds (:mod:`.backward`,
table :data:`BACKWARD`) the same way. Nothing here imports Megatron: the blocks, the split and the
RNG states come in as arguments (Megatron's are in ``schedule/megatron/``). The schedules, their
memory and their RNG handling are described in ``docs/schedules.md``.
"""

import contextlib
import dataclasses

import torch

from ...validation import Schedule
from . import backward as backward_programs
from .comm import EarlyReductions
from .deferral import Deferral
from .executor import Interleave, run_programs
from .forward import forward_program
from .fsdp import TaggedOps, default_sharded
from .ops import BlockOps
from .state import SubBatch


def _kept_only(ops, sbs, ends, recomputed_layers):
    """``overlap`` without recompute: one round."""
    return [[ends(sb, backward_programs.kept_graphs(ops, sb)) for sb in sbs]]


def _fine_grained(ops, sbs, ends, recomputed_layers):
    """``oases``: the kept blocks' backward, then the recomputed ones', in one round."""
    return [
        [
            ends(
                sb, backward_programs.kept_graphs(ops, sb) + backward_programs.fine_grained(ops, sb)
            )
            for sb in sbs
        ]
    ]


def _cross_pass(ops, sbs, ends, recomputed_layers):
    """``cross-pass``: recompute and backward of every layer in one op sequence, one round."""
    return [
        [
            ends(
                sb,
                backward_programs.kept_graphs(ops, sb)
                + backward_programs.cross_pass(ops, sb, recomputed_layers),
            )
            for sb in sbs
        ]
    ]


def _pass_by_pass(ops, sbs, ends, recomputed_layers):
    """``overlap`` with recompute (paper Fig. 3b): per layer a recompute round, then a backward
    round. The output end and the kept blocks' backward open the first recompute round, the
    embedding closes the last backward round."""
    kept = {sb.index: backward_programs.kept_graphs(ops, sb) for sb in sbs}
    rounds, top = [], recomputed_layers - 1
    for layer in reversed(range(recomputed_layers)):
        phases = [backward_programs.layer_phases(ops, sb, layer) for sb in sbs]
        last = layer == top
        rounds.append(
            [
                ends(sb, (kept[sb.index] if last else []) + p[0], out=last, emb=False)
                for sb, p in zip(sbs, phases)
            ]
        )
        rounds.append([ends(sb, p[1], out=False, emb=layer == 0) for sb, p in zip(sbs, phases)])
    return rounds


#: How a micro-batch's backward runs, by what forward saved: ``(schedule, saved)`` → builder of
#: its rounds (a round: one program per sub-batch, executed interleaved; rounds follow each other). ``saved`` is "graphs" (no layer recomputed), "blocks" (each block's input: ``oases``)
#: or "layers" (each recomputed layer's input: Megatron's full recompute).
BACKWARD = {
    (Schedule.OVERLAP, "graphs"): _kept_only,
    (Schedule.CROSS_PASS, "graphs"): _kept_only,
    (Schedule.OASES, "graphs"): _kept_only,
    (Schedule.OASES, "blocks"): _fine_grained,
    (Schedule.CROSS_PASS, "layers"): _cross_pass,
    (Schedule.OVERLAP, "layers"): _pass_by_pass,
}


class ScheduledLayers:
    """One micro-batch through a stage's blocks under ``schedule`` (``--oases-schedule``); owns
    no global state.

    ``blocks``: the stage's blocks (the adapter's ``LayerBlocks``: ``ln``, ``main``, ``bda`` per
    block, the masks, ``yield_points``). ``split``: ``hidden -> split``, the sub-batch cut of one
    micro-batch (the adapter's ``make_split``: ``hidden``, ``masks``, ``rotary``, ``join_*``,
    ``backward_order``, ``prefix_attention``). ``rng``: :class:`.ops.RngStates`, the snapshot
    and replay of the RNG states a recomputed op re-runs under. ``recomputed_layers``: how many
    leading layers Megatron's full recompute checkpoints (0: every block keeps its graph).
    ``embedding`` / ``output``: the stage's ends run in the programs, or None. ``tracer``:
    records each op (optional). ``deferral``: the stage's :class:`.deferral.Deferral`, which its
    linears defer to (a fresh one for blocks without Megatron linears). ``sharded``: what gathers
    the stage's sharded parameters around the passes and hands their gradients over
    (:mod:`.fsdp`: a :class:`.fsdp.PerLayer`, the adapter's for Megatron-FSDP); default the FSDP2
    modules among the layers and the embedding (:class:`.fsdp.ShardedParams`, no-op without
    them)."""

    def __init__(
        self,
        blocks,
        schedule,
        *,
        split,
        rng,
        recomputed_layers=0,
        microbatch=-1,
        tracer=None,
        embedding=None,
        output=None,
        deferral=None,
        sharded=None,
    ):
        self.deferral = Deferral() if deferral is None else deferral
        self.blocks, self.schedule, self.microbatch, self.tracer = (
            blocks,
            schedule,
            microbatch,
            tracer,
        )
        self.make_split, self.rng = split, rng
        self.embedding, self.output = embedding, output
        layers = self.recomputed_layers = min(recomputed_layers, len(blocks.layers))
        if not layers:
            self.saved = "graphs"
        else:
            self.saved = "blocks" if schedule == Schedule.OASES else "layers"
        # SP: yield points inside main_j, where the other sub-batch's bda + ln between its two
        # collectives runs (see :class:`.executor.Interleave`); without SP there is no such op.
        self.interleave = Interleave() if blocks.sequence_parallel else None
        self.ops = self.split = self.prefix = None
        self.sbs = []
        # the column linears' input-gradient reductions started inside backward ops (.comm)
        self.early = EarlyReductions()
        # sharded data parallelism: the parameters the wrapper's bypassed hooks would gather
        # (.fsdp); by default FSDP2's (--use-torch-fsdp2), if any
        if sharded is None:
            ends = [embedding.module] if embedding is not None else []
            sharded = default_sharded(blocks.layers, ends)
        self.sharded = sharded

    def _execute(self, programs_, order=None):
        """Run the sub-batches' programs interleaved, the first of ``order`` (sub-batch
        indices; default 0, 1, ...) leading."""
        order = list(range(len(programs_))) if order is None else order
        yields = self.blocks.yield_points if self.interleave else None
        hooks = self.prefix.hooks() if self.prefix is not None else contextlib.nullcontext()
        with yields(self.interleave) if yields else contextlib.nullcontext(), hooks:
            run_programs(
                [programs_[i] for i in order],
                labels=dict(microbatch=self.microbatch),
                tracer=self.tracer,
                early=self.early,
                interleave=self.interleave,
                ids=order,
                compute_context=self.deferral.deferring(early=self.early),
            )

    def forward(self, hidden):
        split = self.split = self.make_split(hidden)
        masks = split.masks(self.blocks.attention_mask)
        rotary = split.rotary(self.blocks.rotary_pos_emb)
        self.prefix = split.prefix_attention(self.blocks)
        anchor = torch.zeros((), device=hidden.device, requires_grad=True)
        first_kept = self.blocks.first_block(self.recomputed_layers)
        make_ops = TaggedOps if self.sharded.tags else BlockOps
        ops = self.ops = make_ops(
            self.blocks, self.microbatch, self.tracer, first_kept, anchor, self.prefix, self.rng
        )
        for end in (self.embedding, self.output):
            if end is not None:
                end.split(split)
        # each block's ops set their own grad mode
        with torch.set_grad_enabled(ops.keeps(0)):
            cut = split.hidden(hidden.detach())
            if self.embedding is None:  # block 0 cuts its graph (BlockOps.block_input)
                inputs = list(cut)
            else:  # the embedding ops deliver each sub-batch's input
                inputs = [None] * len(cut)
            J = self.blocks.num_blocks
            self.sbs = [
                SubBatch(i, x, m, r, p.size(0), J)
                for i, (x, m, r, p) in enumerate(zip(inputs, masks, rotary, cut))
            ]
            layer_checkpoint = self.saved == "layers"
            last = len(self.sbs) - 1
            programs = [
                forward_program(
                    ops, sb, sb.index == last, layer_checkpoint, self.embedding, self.output
                )
                for sb in self.sbs
            ]
            with self.sharded.running([programs], ops, backward=False):
                self._execute(programs)
        if self.output is not None:  # per-token loss [b, s]
            return split.join_tokens([sb.loss.detach() for sb in self.sbs])
        return split.join_hidden([sb.output.detach() for sb in self.sbs])

    def _ends(self, sb, program, out=True, emb=True):
        """A backward program with the output end's ops before it and the embedding's after."""
        before = self.output.backward_ops(sb) if (out and self.output is not None) else []
        after = self.embedding.backward_ops(sb) if (emb and self.embedding is not None) else []
        return before + program + after

    def backward(self, grad_output):
        split, J = self.split, self.blocks.num_blocks
        if self.output is not None:  # the per-token loss's gradient, [b, s]
            for sb, g in zip(self.sbs, split.tokens(grad_output.contiguous())):
                sb.ends.loss_grad = g
        else:
            for sb, g in zip(self.sbs, split.hidden(grad_output.contiguous())):
                sb.blocks[J].input_grad = g
        if self.prefix is not None:
            self.prefix.start_backward()
        build = BACKWARD[(self.schedule, self.saved)]
        rounds = build(self.ops, self.sbs, self._ends, self.recomputed_layers)
        with self.sharded.running(rounds, self.ops, backward=True), torch.enable_grad():
            for round_programs in rounds:
                # sequence chunks: the last chunk leads (see .split)
                self._execute(round_programs, order=split.backward_order())
        self.early.check_empty()
        if self.prefix is not None:
            self.prefix.check_empty()
        if self.embedding is not None:  # the gradient went into the embedding's parameters
            out = None
        else:
            out = split.join_hidden([sb.blocks[0].take("input_grad") for sb in self.sbs])
        self.sbs, self.ops, self.split, self.prefix = [], None, None, None
        return out


class _ScheduledLayersFunction(torch.autograd.Function):
    """Autograd node over a stage's layers; parameters get their gradients from the inner backward
    calls (as in Megatron's CheckpointFunction), so Megatron DDP's grad hooks fire as usual."""

    @staticmethod
    def forward(ctx, scheduled, hidden):
        ctx.scheduled = scheduled
        return scheduled.forward(hidden)

    @staticmethod
    def backward(ctx, grad_output):
        scheduled, ctx.scheduled = ctx.scheduled, None
        return None, scheduled.backward(grad_output)


def run_scheduled(scheduled, hidden):
    """``scheduled`` (a :class:`ScheduledLayers`) on ``hidden`` as one autograd node."""
    return _ScheduledLayersFunction.apply(scheduled, hidden)
