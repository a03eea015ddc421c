"""The overlapped TMP schedule of one pipeline stage's transformer layers (paper §3).

:class:`ScheduledLayers` is one autograd node over all layers of a stage. Its forward splits the
micro-batch into sub-batches (two by default; whole samples, or sequence chunks with
``--oases-split sequence``, see :mod:`.split`) and runs them through
:func:`.executor.run_programs`; its backward builds the backward programs for the schedule:

``overlap``      without recomputation, forward keeps per-block autograd graphs and backward walks
                 them; with ``--recompute-granularity full`` it is the paper's basic pipelined
                 schedule (Fig. 3b, Merak-like): each layer is recomputed and back-propagated in
                 two passes, each overlapped across sub-batches, with a barrier between them.
``cross-pass``   forward saves each layer's input (Megatron's full/uniform recompute); backward
                 recomputes a layer (issuing its forward all-reduces again, asynchronously) and
                 runs its backward in *one* op sequence per sub-batch — no barrier between the
                 recompute and backward passes or between layers (Fig. 3c).
``oases``        fine-grained recomputation (Fig. 3d): forward saves every block's input H_j, i.e.
                 recomputation starts right after each forward all-reduce, so the recompute
                 sequence is ln_j → main_j and issues **no** all-reduce (eq. 1). The
                 bias-dropout-add between blocks is affine, so its backward is recomputed from the
                 RNG state alone (dropout of a probe tensor), without the all-reduced input.

Megatron's ``--recompute-method block --recompute-num-layers N`` recomputes only a stage's first N
layers: those run as above (``overlap`` with recompute, ``cross-pass``, ``oases``), the layers
after them as ``overlap`` without recompute (graphs kept). Backward walks the kept layers first, in
the same program, then the recomputed ones.

Sequence parallelism (``--sequence-parallel``): each block's all-reduce becomes an all-gather
before main_j and a reduce-scatter after it (backward: an all-gather of R_j's gradient, a
reduce-scatter of L_j's); every one is a :class:`~.executor.Comm` like the all-reduces. ``oases``
re-gathers in its recomputation (it keeps s/t-sized block inputs); ``overlap`` without recompute
keeps s/t shards and re-gathers for backward (:mod:`.regather`).

The forward's last collective of a stage is the last sub-batch's last MLP all-reduce; that block
runs in :data:`TAIL_PIECES` runs of tokens whose all-reduces are issued one by one, so the pass
ends on a piece of it (:meth:`ScheduledLayers._pieces`).

Inputs whose gradient the schedule collects (R_j, L_j) enter their ops through
:class:`~.regather.GradSink`, and a kept graph's root P_j has its data freed once reduced
(Megatron's ``deallocate_output_tensor``/``custom_backward``), so kept graphs hold what stock's do.

RNG: every op that may be recomputed snapshots Megatron's RNG states (CPU, device and tracker)
before it runs in forward, and recomputation restores exactly that snapshot — per sub-batch, so
dropout masks in recompute equal those of the forward.
"""

import contextlib

import torch
from megatron.core.pipeline_parallel.schedules import deallocate_output_tensor

from ..validation import SPLIT_SCHEDULES, SUB_BATCHES, TAIL_PIECES
from .comm import EarlyReductions
from .executor import Comm, Compute, Interleave, run_programs
from .regather import GradSink, shard_saved
from .rng import replay as _rng
from .rng import snapshot as _snapshot
from .split import make_split


def _leaf(t):
    return t.detach().requires_grad_()


def _backward(outputs, grads):
    torch.autograd.backward(outputs, grads)


def _backward_freed(outputs, grads):
    """``torch.autograd.backward`` where ``outputs[0]``'s data was freed in forward (a kept
    graph's root, see ``deallocate_output_tensor``): Megatron's ``custom_backward`` for several
    roots, which skips the shape check the freed output would fail."""
    torch.autograd.Variable._execution_engine.run_backward(
        tensors=tuple(outputs),
        grad_tensors=tuple(grads),
        keep_graph=False,
        create_graph=False,
        inputs=tuple(),
        allow_unreachable=True,
        accumulate_grad=True,
    )


class SubBatch:
    """Everything one sub-batch carries through a micro-batch's forward and backward."""

    def __init__(self, index, hidden, mask, rotary, rows):
        self.index, self.input, self.mask, self.rotary = index, hidden, mask, rotary
        self.rows = rows  # dim 0 (sequence) of its [s, b, h] hidden states
        self.H, self.Lout, self.P, self.B, self.R, self.hout = ({} for _ in range(6))
        self.G = {}  # sequence parallelism: the all-gathered ln output of block j
        self.buf, self.rng, self.gR, self.gL, self.gH = ({} for _ in range(5))
        self.end = {}  # the stage ends' working tensors (:mod:`.stage`)
        # --recompute-modules layernorm: the checkpoint that frees ln_j's output until backward
        self.norm_checkpoint = {}
        self.pieces = {}  # block -> runs of tokens its kept graph was built in (see _pieces)
        self.output = self.loss = None


class ScheduledLayers:
    """One micro-batch through a stage's blocks under ``mode``; owns no global state."""

    def __init__(
        self,
        blocks,
        mode,
        microbatch=-1,
        recompute=True,
        recompute_layers=None,
        tracer=None,
        parts=SUB_BATCHES,
        embedding=None,
        output=None,
        split="batch",
    ):
        assert mode in SPLIT_SCHEDULES, mode
        self.blocks, self.mode, self.microbatch, self.tracer = blocks, mode, microbatch, tracer
        self.parts = parts  # sub-batches per micro-batch
        # how they are cut (--oases-split: samples or sequence chunks, see :mod:`.split`); set
        # per micro-batch, with the chunks' shared attention state (``prefix``, or None)
        self.split_kind, self.split, self.prefix = split, None, None
        # The stage's ends run in the programs too (:mod:`.stage`): the embedding before the
        # first block (the input is then a placeholder), the output layer and loss after the last.
        self.embedding, self.output = embedding, output
        # How many leading layers are recomputed: all (full/uniform), the first N (full/block,
        # ``recompute_layers``) or none; the blocks from ``first_kept`` on keep their graphs.
        layers = blocks.num_blocks // 2
        if mode == "overlap" and not recompute:
            layers = 0
        elif recompute_layers is not None:
            layers = min(recompute_layers, layers)
        self.recomputed_layers, self.first_kept = layers, 2 * layers
        # What forward keeps of a recomputed layer: its input (Megatron's full recompute:
        # overlap with recompute, cross-pass) or each block's input (oases' fine-grained
        # recompute); "none" when no layer is recomputed.
        if not layers:
            self.checkpoint = "none"
        elif mode == "oases":
            self.checkpoint = "block"
        else:
            self.checkpoint = "layer"
        # Sequence parallelism: an all-gather before each block's main op, and the block's
        # reduction is a reduce-scatter (see :mod:`.blocks`).
        self.sp = blocks.sequence_parallel
        self.reduction = "reduce_scatter" if self.sp else "all_reduce"
        # SP: yield points inside main_j, where the other sub-batch's bda + ln between its two
        # collectives runs (see :class:`.executor.Interleave`); without SP there is no such op.
        self.interleave = Interleave() if self.sp else None
        self.anchor = None
        self.sbs = []
        # the column linears' input-gradient all-reduces started inside backward ops (.comm)
        self.early = EarlyReductions()

    # ------------------------------------------------------------------ helpers
    def _keeps(self, j):
        """Block j keeps its autograd graph from forward (its layer is not recomputed)."""
        return j >= self.first_kept

    def _regathers(self, j):
        """SP with block j's graph kept: main_j's saved input stays an s/t shard, re-gathered
        before its backward (:mod:`.regather`), as stock Megatron's SP linears do."""
        return self.sp and self._keeps(j)

    def _labels(self, j, pass_):
        """Tracer labels of block j's ops (``pass`` is a keyword, hence the dict)."""
        return {"pass": pass_, "layer": self.blocks.global_layer(j), "block": self.blocks.kind(j)}

    def _compute(self, fn, j, pass_, early=False, light=False):
        return Compute(fn, early=early, light=light, **self._labels(j, pass_))

    def _run(self, programs, labels, order=None):
        """Run the sub-batches' ``programs`` interleaved, the first of ``order`` (sub-batch
        indices; default 0, 1, ...) leading."""
        order = list(range(len(programs))) if order is None else order
        yields = self.blocks.yield_points if self.interleave else None
        hooks = self.prefix.hooks() if self.prefix is not None else contextlib.nullcontext()
        with yields(self.interleave) if yields else contextlib.nullcontext(), hooks:
            run_programs(
                [programs[i] for i in order],
                labels=labels,
                tracer=self.tracer,
                early=self.early,
                interleave=self.interleave,
                ids=order,
            )

    def _chunk(self, sb):
        """Where ``sb``'s core attention may run (sequence chunks: it says which chunk runs)."""
        return self.prefix.running(sb.index) if self.prefix else contextlib.nullcontext()

    def _main(self, sb, j, x):
        """main_j of sub-batch ``sb`` on ``x``: (partial sum, bias)."""
        with self._chunk(sb):
            return self.blocks.main(j, x, sb.mask, sb.rotary)

    def _collective(self, kind, get, store, j, pass_):
        """``kind`` of ``get()`` on block j's TP group; the result lands in ``store[j]``."""
        return Comm(
            get=get,
            done=lambda t: store.__setitem__(j, t),
            group=self.blocks.tp_group(j),
            kind=kind,
            **self._labels(j, pass_),
        )

    def _to_main(self, sb, j, pass_, first, main, early=False):
        """Ops from block j's input to its partial sum: ``first`` (ln; without sequence
        parallelism also main), then under SP the all-gather of the ln output and ``main``.
        ``early``: ``first`` needs only saved tensors (see :class:`.executor.Compute`)."""
        # under SP ``first`` is only ln (with bda_{j-1} before it): a light op
        ops = [self._compute(first, j, pass_, early=early, light=self.sp)]
        if self.sp:
            ops.append(self._collective("all_gather", lambda: sb.buf.pop(j), sb.G, j, pass_))
            ops.append(self._compute(main, j, pass_))
        return ops

    def _input(self, x, grads, j):
        """``x`` as an op's input whose gradient lands in ``grads[j]`` (see
        :class:`.regather.GradSink`): unlike a leaf, nothing keeps ``x`` alive but the graph's
        own saved tensors, so a kept graph holds what stock Megatron's would."""
        return GradSink.apply(self.anchor, x.detach(), lambda g: grads.__setitem__(j, g))

    def _after_ln(self, sb, j, Lout, main):
        """Hand the ln output to the all-gather (SP) or straight to ``main``."""
        if self.sp:
            sb.buf[j] = Lout.detach()
        else:
            main(Lout)

    # ------------------------------------------------------------------ forward
    def forward(self, hidden):
        split = self.split = make_split(self.split_kind, hidden, self.parts)
        masks = split.masks(self.blocks.attention_mask)
        rotary = split.rotary(self.blocks.rotary_pos_emb)
        self.prefix = split.prefix_attention(self.blocks)
        # each block's ops set their own grad mode (_fwd_block, _fwd_main, _bda_forward)
        grad_ctx = torch.set_grad_enabled(self._keeps(0))
        self.anchor = torch.zeros((), device=hidden.device, requires_grad=True)
        for end in (self.embedding, self.output):
            if end is not None:
                end.split(split)
        with grad_ctx:
            cut = split.hidden(hidden.detach())
            if self.embedding is None:
                pieces = [self._as_input(p) for p in cut]
            else:  # a placeholder: the embedding ops deliver each sub-batch's input
                pieces = [None] * len(split.sizes)
            rows = [p.size(0) for p in cut]
            self.sbs = [SubBatch(i, *a) for i, a in enumerate(zip(pieces, masks, rotary, rows))]
            self._run(
                [self._forward_program(sb) for sb in self.sbs], dict(microbatch=self.microbatch)
            )
        if self.output is not None:  # per-token loss [b, s]
            return split.join_tokens([sb.loss.detach() for sb in self.sbs])
        return split.join_hidden([sb.output.detach() for sb in self.sbs])

    def _as_input(self, h):
        return _leaf(h) if self._keeps(0) else h

    def _forward_program(self, sb):
        J = self.blocks.num_blocks
        ops = []
        if self.embedding is not None:
            ops += self.embedding.forward_ops(sb, lambda h: setattr(sb, "input", self._as_input(h)))
        for j in range(J):
            n = self._tail_pieces(sb, j)
            if n > 1:
                ops += self._pieces(sb, j, n)
                continue
            ops += self._to_main(
                sb,
                j,
                "forward",
                lambda j=j: self._fwd_block(sb, j),
                lambda j=j: self._fwd_main(sb, j, sb.G.pop(j)),
            )
            ops.append(
                self._collective(self.reduction, lambda j=j: sb.buf.pop(j), sb.R, j, "forward")
            )
        ops.append(self._compute(lambda: self._fwd_tail(sb), J - 1, "forward", light=True))
        if self.output is not None:
            ops += self.output.forward_ops(sb, self.anchor, lambda g: sb.gH.__setitem__(J, g))
        return ops

    def _bda_forward(self, sb, j):
        """H_{j+1} = bda_j(R_j, bias_j, H_j) in forward, recording what backward needs."""
        with torch.set_grad_enabled(self._keeps(j)):
            return self._bda_forward_op(sb, j)

    def _bda_forward_op(self, sb, j):
        if not self._keeps(j):  # recomputed in backward
            sb.rng[("bda", j)] = _snapshot()
            out = self.blocks.bda(j, sb.R.pop(j), sb.B[j], sb.H[j])
            if self.checkpoint == "layer" and j % 2 == 1:
                sb.H.pop(j)  # layer-granular checkpoint: keep only layer inputs
            return out
        R = self._input(sb.R.pop(j), sb.gR, j)
        checkpoint = sb.norm_checkpoint.pop(j, None)
        if checkpoint is not None:
            # main_j (and under SP the all-gather) has consumed ln_j's output: free it until
            # R_j's gradient arrives, which comes before main_j's backward and the re-gather
            checkpoint.discard_output_and_register_recompute(R)
        out = sb.hout[j] = self.blocks.bda(j, R, sb.B[j], sb.H[j])
        return out

    def _fwd_block(self, sb, j, main=None):
        """bda_{j-1}, ln_j, then ``main`` on ln_j's output (default: main_j; under SP it runs
        after the all-gather instead)."""
        if j == 0:
            H = sb.input
        else:
            out = self._bda_forward(sb, j - 1)
            H = _leaf(out) if self._keeps(j) else out
        sb.H[j] = H  # a layer checkpoint drops odd blocks' H again after bda_j
        with torch.set_grad_enabled(self._keeps(j)):
            if self._keeps(j):
                Lout, checkpoint = self.blocks.ln_discardable(j, H)
                sb.Lout[j] = Lout
                if checkpoint is not None:
                    sb.norm_checkpoint[j] = checkpoint
            else:
                Lout = self.blocks.ln(j, H)
            self._after_ln(sb, j, Lout, main or (lambda x: self._fwd_main(sb, j, x)))

    def _fwd_main(self, sb, j, x):
        """main_j on its (gathered) input; the RNG snapshot is taken right before it, as the
        other sub-batch may run between ln_j and main_j under SP."""
        with torch.set_grad_enabled(self._keeps(j)):
            self._fwd_main_op(sb, j, x)

    def _fwd_main_op(self, sb, j, x):
        if self._regathers(j):  # x's storage is freed after this call; see .regather
            with shard_saved(x, lambda: sb.G[j]):
                P, sb.B[j] = self._main(sb, j, self._input(x, sb.gL, j))
        elif self._keeps(j):
            P, sb.B[j] = self._main(sb, j, self._input(x, sb.gL, j))
        else:
            sb.rng[("main", j)] = _snapshot()
            P, sb.B[j] = self._main(sb, j, x)
        sb.buf[j] = P.detach()
        if self._keeps(j):  # backward needs P's grad_fn only; its data goes to the reduction
            deallocate_output_tensor(P, deallocate_pipeline_outputs=P._base is None)
            sb.P[j] = P

    def _tail_pieces(self, sb, j):
        """Pieces block j of ``sb`` runs in forward: :data:`TAIL_PIECES` for the stage's last
        block of the last sub-batch (the pass's last collective), one elsewhere. Not under SP:
        a piece's reduce-scatter would not give a rank its own run of the sequence."""
        last = self.blocks.num_blocks - 1
        if self.sp or j != last or sb.index != len(self.sbs) - 1:
            return 1
        assert self.blocks.kind(j) == "mlp", j
        return min(TAIL_PIECES, sb.rows)

    def _pieces(self, sb, j, n):
        """Forward ops of MLP block j on ``n`` runs of tokens, each run's all-reduce issued as
        soon as its main op is done while the sub-batch goes on with the next run
        (``Comm(switch=False)``), so the other sub-batch resumes only after the last run, as
        for a whole block. The pass then ends on 1/n of the block's all-reduce, which the other
        sub-batch's output layer and loss (or a stage's last bda) can hide: they are often
        shorter than a whole one (a small vocabulary, a middle pipeline stage).

        Exact because Megatron's MLP is per token and draws no random numbers (dropout is in
        the bda): the runs' outputs joined are the block's, and a recomputation of the whole
        block from the RNG snapshot taken before the first run gives the same values. A kept
        graph is one graph per run, each run's input its own :class:`.regather.GradSink`, so
        backward has one input gradient per run, each all-reduced as Megatron's fc1 starts it
        (:meth:`_input_gradient_reductions`).

        Memory as for a whole block: each run's partial sum is copied into its rows of one
        block-sized buffer at once and reduced there in place, so the joined result needs no
        second copy (a concatenation would hold the block's output twice)."""
        keeps, runs, rows, out = self._keeps(j), [], [], []

        def start(x):  # ln_j's output
            cut = torch.tensor_split(x, n, dim=0)
            rows.extend(r.size(0) for r in cut)
            if keeps:
                runs.extend(self._input(r, sb.gL, (j, i)) for i, r in enumerate(cut))
                sb.pieces[j] = n
            else:
                sb.rng[("main", j)] = _snapshot()
                runs.extend(cut)
            piece(0)

        def piece(i):
            with torch.set_grad_enabled(keeps):
                P, sb.B[j] = self._main(sb, j, runs[i])
            runs[i] = None
            if not out:
                out.append(P.new_empty((sum(rows),) + tuple(P.shape[1:])))
            start_row = sum(rows[:i])
            sb.buf[(j, i)] = out[0][start_row : start_row + rows[i]].copy_(P.detach())
            if keeps:  # backward needs the runs' grad_fn only (see _fwd_main_op)
                deallocate_output_tensor(P, deallocate_pipeline_outputs=P._base is None)
                sb.P.setdefault(j, []).append(P)

        def done(i, t):  # the runs' results arrive in issue order, reduced in place in out
            if i == n - 1:
                sb.R[j] = out.pop()

        comms = self._queued(j, "forward", n, lambda i: sb.buf.pop((j, i)), done)
        ops = [self._compute(lambda: self._fwd_block(sb, j, main=start), j, "forward")]
        for i in range(n):
            if i:
                ops.append(self._compute(lambda i=i: piece(i), j, "forward"))
            ops.append(comms[i])
        return ops

    def _queued(self, j, pass_, n, get, done):
        """``n`` all-reduces of block j's runs of tokens (:meth:`_pieces`): ``get(i)``, then
        ``done(i, result)`` in issue order. The sub-batch goes on after each but the last
        (``Comm(switch=False)``), which hands over as a whole block's would."""
        return [
            Comm(
                get=lambda i=i: get(i),
                done=lambda t, i=i: done(i, t),
                group=self.blocks.tp_group(j),
                switch=i == n - 1,
                **self._labels(j, pass_),
            )
            for i in range(n)
        ]

    def _fwd_tail(self, sb):
        sb.output = self._bda_forward(sb, self.blocks.num_blocks - 1)

    # ------------------------------------------------------------------ backward
    def backward(self, grad_output):
        J = self.blocks.num_blocks
        labels = dict(microbatch=self.microbatch)
        split = self.split
        if self.output is not None:  # the per-token loss's gradient, [b, s]
            for sb, g in zip(self.sbs, split.tokens(grad_output.contiguous())):
                sb.end["gloss"] = g
        else:
            for sb, g in zip(self.sbs, split.hidden(grad_output.contiguous())):
                sb.gH[J] = g
        if self.prefix is not None:
            self.prefix.start_backward()

        def run(programs):  # sequence chunks: the last chunk leads (see .split)
            self._run(programs, labels, order=split.backward_order())

        with torch.enable_grad():
            # the kept layers' backward first (none under full/uniform recompute), then the
            # recomputed layers' in the same program
            kept = {sb.index: self._overlap_backward(sb) for sb in self.sbs}
            if self.checkpoint == "none":
                run([self._ends(sb, kept[sb.index]) for sb in self.sbs])
            elif self.checkpoint == "block":
                run([self._ends(sb, kept[sb.index] + self._oases_backward(sb)) for sb in self.sbs])
            elif self.mode == "cross-pass":  # one op sequence per sub-batch, no pass barrier
                run(
                    [
                        self._ends(sb, kept[sb.index] + self._crosspass_backward(sb))
                        for sb in self.sbs
                    ]
                )
            else:  # overlap with recompute (paper Fig. 3b): a barrier around every pass
                top = self.recomputed_layers - 1
                for layer in reversed(range(self.recomputed_layers)):
                    phases = [self._layer_phases(sb, layer) for sb in self.sbs]
                    last = layer == top
                    # the output end (and the kept layers' backward) open the first recompute
                    # pass, the embedding closes the last backward pass
                    run(
                        [
                            self._ends(
                                sb, (kept[sb.index] if last else []) + p[0], out=last, emb=False
                            )
                            for sb, p in zip(self.sbs, phases)
                        ]
                    )
                    run(
                        [
                            self._ends(sb, p[1], out=False, emb=layer == 0)
                            for sb, p in zip(self.sbs, phases)
                        ]
                    )
        self.early.check_empty()
        if self.prefix is not None:
            self.prefix.check_empty()
        if self.embedding is not None:  # the gradient went into the embedding's parameters
            out = None
        else:
            out = split.join_hidden([sb.gH.pop(0) for sb in self.sbs])
        self.sbs, self.anchor, self.split, self.prefix = [], None, None, None
        return out

    def _ends(self, sb, program, out=True, emb=True):
        """A backward program with the output end's ops before it and the embedding's after."""
        before = self.output.backward_ops(sb) if (out and self.output is not None) else []
        after = self.embedding.backward_ops(sb) if (emb and self.embedding is not None) else []
        return before + program + after

    def _main_backward(self, sb, j):
        """Block j's main backward between its collectives: under SP the all-gather of R_j's
        gradient (the row-parallel reduce-scatter's backward) first; then the input-gradient
        reduction of the column-parallel linear (all-reduce, or reduce-scatter under SP)."""
        ops = []
        if self._regathers(j):  # main_j's input again, in the same collective
            ops.append(self._regather(sb, j))
        elif self.sp:
            ops.append(self._collective("all_gather", lambda: sb.gR.pop(j), sb.gR, j, "backward"))
        ops.append(self._compute(lambda: self._ov_main(sb, j), j, "backward"))
        return ops + self._input_gradient_reductions(sb, j)

    def _input_gradient_reductions(self, sb, j):
        """The reduction of main_j's input gradient; for a kept graph built in runs of tokens
        (:meth:`_pieces`) one per run, queued together, joined when the last is taken."""
        n = sb.pieces.pop(j, None)
        if n is None:
            return [self._collective(self.reduction, lambda: sb.gL.pop(j), sb.gL, j, "backward")]
        parts = [None] * n

        def done(i, t):
            parts[i] = t
            if i == n - 1:
                sb.gL[j] = torch.cat(parts)

        return self._queued(j, "backward", n, lambda i: sb.gL.pop((j, i)), done)

    # overlap: graphs kept from forward ------------------------------------------
    def _overlap_backward(self, sb):
        """Backward of the blocks that kept their graphs (from ``first_kept`` on)."""
        ops = []
        for j in reversed(range(self.first_kept, self.blocks.num_blocks)):
            ops.append(self._compute(lambda j=j: self._ov_bda(sb, j), j, "backward", light=True))
            ops += self._main_backward(sb, j)
            ops.append(self._compute(lambda j=j: self._ov_ln(sb, j), j, "backward", light=True))
        return ops

    def _regather(self, sb, j):
        """One all-gather of R_j's gradient and main_j's saved input shard (a collective each
        would leave the second with no compute to hide behind)."""

        def done(gathered):
            sb.gR[j], sb.G[j] = gathered

        return Comm(
            get=lambda: (sb.gR.pop(j), sb.Lout[j].detach()),
            done=done,
            group=self.blocks.tp_group(j),
            kind="all_gather",
            **self._labels(j, "backward"),
        )

    def _ov_bda(self, sb, j):
        _backward(sb.hout.pop(j), sb.gH.pop(j + 1))  # R_j's gradient lands in sb.gR

    def _ov_main(self, sb, j):
        P, g = sb.P.pop(j), sb.gR.pop(j)
        if isinstance(P, list):  # forward ran it in runs of tokens (_pieces), data freed
            # one backward call per run: each run's weight gradient is accumulated before the
            # next run's is computed (one call over all runs could hold several at once), and
            # each run's input-gradient all-reduce starts before the next run's backward
            for p, gi in zip(P, torch.tensor_split(g, len(P), dim=0)):
                _backward_freed([p], [gi])
            return
        freed = P.numel() != g.numel()  # data freed in forward (kept graph) unless kept
        roots, grads = [], []
        if self.prefix is not None and j % 2 == 0:  # the later chunks' key/value gradients
            roots, grads = self.prefix.backward_roots(j // 2, sb.index)
        with self._chunk(sb):  # Megatron's selective recompute re-runs core attention in here
            if freed:  # grad_fn only
                _backward_freed([P] + roots, [g] + grads)
            else:
                _backward([P] + roots, [g] + grads)
        if self.prefix is not None and j % 2 == 0:
            self.prefix.collect(j // 2, sb.index)
        if self._regathers(j):
            sb.G.pop(j)  # main_j's input gradient has landed in sb.gL

    def _ov_ln(self, sb, j):
        _backward(sb.Lout.pop(j), sb.gL.pop(j))
        sb.gH[j] = sb.H.pop(j).grad

    # oases: fine-grained recomputation, no all-reduce in recompute ----------------
    def _oases_backward(self, sb):
        """Backward of the recomputed blocks (below ``first_kept``)."""
        J = self.first_kept
        ops = [self._compute(lambda: self._probe_bda(sb, J - 1), J - 1, "backward", light=True)]
        for j in reversed(range(J)):
            # from the saved H_j only: runs as soon as the previous collective is issued
            ops += self._recompute_to_main(sb, j, lambda j=j: self._rc_ln(sb, j), early=True)
            ops += self._main_backward(sb, j)
            ops.append(
                self._compute(lambda j=j: self._ln_backward(sb, j), j, "backward", light=True)
            )
            if j > 0:
                ops.append(
                    self._compute(
                        lambda j=j: self._probe_bda(sb, j - 1), j - 1, "backward", light=True
                    )
                )
        return ops

    def _probe_bda(self, sb, j):
        """Backward of bda_j from its RNG snapshot: bda is affine, so a zero probe input gives the
        exact gradients (dropout mask · g for R_j and bias, identity for the residual)."""
        g = sb.gH.pop(j + 1)
        probe = torch.zeros_like(g, requires_grad=True)
        with _rng(sb.rng.pop(("bda", j))):
            out = self.blocks.bda(j, probe, sb.B[j], torch.zeros_like(g))
        _backward(out, g)
        sb.gR[j] = probe.grad
        sb.gH[j] = g  # residual path; the ln path is added by _ln_backward

    def _recompute_to_main(self, sb, j, first, early=False):
        """Recompute block j from its saved input H_j up to its partial sum. Under sequence
        parallelism this re-gathers the ln output (an all-gather in recompute, overlapped like
        every collective) rather than keeping the gathered input from forward: that would hold
        t× the block input per block, undoing SP's activation saving."""
        main = lambda: self._rc_main(sb, j, sb.G.pop(j))  # noqa: E731
        return self._to_main(sb, j, "recompute", first, main, early=early)

    def _rc_ln(self, sb, j):
        H = sb.H[j] = _leaf(sb.H[j])
        Lout = sb.Lout[j] = self.blocks.ln(j, H)
        self._after_ln(sb, j, Lout, lambda x: self._rc_main(sb, j, x))

    def _rc_main(self, sb, j, x):
        with _rng(sb.rng.pop(("main", j))):
            sb.P[j], _ = self._main(sb, j, self._input(x, sb.gL, j))

    def _ln_backward(self, sb, j):
        _backward(sb.Lout.pop(j), sb.gL.pop(j))
        g_ln = sb.H.pop(j).grad
        sb.gH[j] = g_ln if j not in sb.gH else sb.gH[j] + g_ln

    # cross-pass: layer recompute (with its all-reduces) merged with backward --------
    def _crosspass_backward(self, sb):
        ops = []
        for layer in reversed(range(self.recomputed_layers)):
            recompute, backward = self._layer_phases(sb, layer)
            ops += recompute + backward
        return ops

    def _layer_phases(self, sb, layer):
        """Recompute ops (with the layer's forward collectives) and backward ops of one layer."""
        a, m = 2 * layer, 2 * layer + 1
        # the layer's first block from its saved input only (block m needs the recomputed R_a)
        recompute = self._recompute_to_main(sb, a, lambda: self._rc_ln(sb, a), early=True)
        recompute.append(self._rc_reduction(sb, a))
        recompute += self._recompute_to_main(sb, m, lambda: self._cp_mid(sb, a, m))
        recompute.append(self._rc_reduction(sb, m))
        light = dict(light=True)
        recompute.append(self._compute(lambda: self._cp_tail(sb, m), m, "recompute", **light))
        backward = [self._compute(lambda: self._ov_bda(sb, m), m, "backward", **light)]
        backward += self._main_backward(sb, m)
        backward.append(self._compute(lambda: self._ov_ln(sb, m), m, "backward", **light))
        backward.append(self._compute(lambda: self._ov_bda(sb, a), a, "backward", **light))
        backward += self._main_backward(sb, a)
        backward.append(self._compute(lambda: self._ln_backward(sb, a), a, "backward", **light))
        return recompute, backward

    def _rc_reduction(self, sb, j):
        return self._collective(self.reduction, lambda: sb.P[j].detach(), sb.R, j, "recompute")

    def _cp_mid(self, sb, a, m):
        """Recompute bda_a (needs the recomputed reduction) and block m's ln (and main)."""
        R = self._input(sb.R.pop(a), sb.gR, a)
        with _rng(sb.rng.pop(("bda", a))):
            h = sb.hout[a] = self.blocks.bda(a, R, sb.B[a], sb.H[a])
        sb.H[m] = h
        self._rc_ln(sb, m)

    def _cp_tail(self, sb, m):
        R = self._input(sb.R.pop(m), sb.gR, m)
        with _rng(sb.rng.pop(("bda", m))):
            sb.hout[m] = self.blocks.bda(m, R, sb.B[m], sb.H[m])


class ScheduledLayersFunction(torch.autograd.Function):
    """Autograd node over a stage's layers; parameters get their gradients from the inner backward
    calls (as in Megatron's CheckpointFunction), so Megatron DDP's grad hooks fire as usual."""

    @staticmethod
    def forward(ctx, run, hidden):
        ctx.run = run
        return run.forward(hidden)

    @staticmethod
    def backward(ctx, grad_output):
        run, ctx.run = ctx.run, None
        return None, run.backward(grad_output)
