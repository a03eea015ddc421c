"""The stage's ends inside the overlapped schedule: the embedding, and the output layer + loss.

Stock Megatron leaves the embedding's forward all-reduce and the output layer's input-gradient
all-reduce with little to hide them; here each sub-batch's ends are ops of its programs
(:class:`EmbeddingEnd`, :class:`OutputEnd`), wired into one ``GPTModel`` instance by
:mod:`.gpt_model`. Numerics, SP and the wiring: ``docs/schedules.md`` (the
stage's ends; how the engine is built).
"""

import contextlib

import torch

from ..engine.cuts import grad_sink
from ..engine.executor import Comm, Compute
from ..engine.ops import BlockOps
from . import loss
from .rng import replay, snapshot


def _in_place(sb, slot, group, kind, labels, detach=False):
    """The collective of the stage end's slot ``slot`` of ``sb``: takes it (detached with
    ``detach``) and puts the result back in the same slot."""
    take = (lambda: sb.ends.take(slot).detach()) if detach else (lambda: sb.ends.take(slot))
    return Comm(get=take, done=BlockOps.store(sb.ends, slot), group=group, kind=kind, **labels)


def _backward(outputs, grads):
    torch.autograd.backward(outputs, grads)


class _End:
    """What both stage ends share: the reduction of a tensor-parallel partial (a reduce-scatter
    along the sequence under SP)."""

    @property
    def reduction(self):
        return "reduce_scatter" if self.sequence_parallel else "all_reduce"


class EmbeddingEnd(_End):
    """The first stage's embedding as the first ops of each sub-batch's programs."""

    LABELS = dict(layer=-1, block="embedding")

    def __init__(self, module, forward, input_ids, position_ids, deferral):
        self.module, self.forward = module, forward  # Megatron's LanguageModelEmbedding.forward
        self.input_ids, self.position_ids = input_ids, position_ids
        self.deferral = deferral  # the stage's (.deferral), which its vocab lookup defers to
        self.ids = self.pos = None

    def stock(self):
        """The embedding as Megatron computes it (for a schedule that cannot take it)."""
        return self.forward(self.module, self.input_ids, self.position_ids)

    def split(self, split):
        """Each sub-batch's token ids and positions (a :mod:`.split` cut of [b, s])."""
        self.ids, self.pos = split.tokens(self.input_ids), split.tokens(self.position_ids)

    @property
    def group(self):
        return self.module.word_embeddings.tp_group

    @property
    def sequence_parallel(self):
        """Under SP Megatron all-reduces the lookup, then keeps the local sequence shard: the
        schedule reduce-scatters it instead (half the bytes; the shard's values are the same
        sums). In backward the scatter's all-gather of the gradient is the schedule's too."""
        return self.module.config.sequence_parallel and self.group.size() > 1

    def forward_ops(self, sb, deliver):
        """Lookup (partial sum), its all-reduce (under SP a reduce-scatter along the sequence),
        then the rest of Megatron's embedding forward; ``deliver(h)`` hands the sub-batch's
        embedding (under SP its s/t shard) to the layers."""
        labels = dict(**{"pass": "forward"}, **self.LABELS)
        return [
            Compute(lambda: self._lookup(sb), **labels),
            _in_place(sb, "lookup", self.group, self.reduction, labels),
            Compute(lambda: deliver(self._finish(sb)), **labels),
        ]

    @property
    def scatters_itself(self):
        """Megatron's embedding reduce-scatters the lookup itself (RoPE, no learned positions)."""
        return getattr(self.module, "reduce_scatter_embeddings", False)

    def _lookup(self, sb):
        with torch.no_grad():  # deferring: the vocab shard's partial sum, [b_i, s, h]
            emb = self.module.word_embeddings(self.ids[sb.index])
            # under SP [s, b_i, h], the layout Megatron scatters along s (and then already has)
            if self.sequence_parallel and not self.scatters_itself:
                emb = emb.transpose(0, 1)
            sb.ends.lookup = emb.contiguous()

    def _reduced(self, sb):
        """The reduction to supply to Megatron's forward: the all-reduced lookup, the
        reduce-scattered one where Megatron reduce-scatters, or else under SP a lookup-shaped
        tensor holding the reduce-scattered shard where Megatron's split reads (the rest is
        zeros that nothing reads: every op before the split is per token)."""
        reduced = sb.ends.take("lookup")
        if not self.sequence_parallel or self.scatters_itself:
            return reduced
        b, s = self.ids[sb.index].shape
        full = reduced.new_zeros((b, s, reduced.size(-1)))
        n, rank = reduced.size(0), self.group.rank()
        full[:, rank * n : (rank + 1) * n] = reduced.transpose(0, 1)
        return full

    def _finish(self, sb):
        reduced = self._reduced(sb)
        sb.ends.rng = snapshot()
        supply = (
            self.deferral.supplied(reduced) if self.group.size() > 1 else contextlib.nullcontext()
        )
        with torch.no_grad(), supply:
            return self.forward(self.module, self.ids[sb.index], self.pos[sb.index])

    def backward_ops(self, sb):
        labels = dict(**{"pass": "backward"}, **self.LABELS)
        if not self.sequence_parallel:
            return [Compute(lambda: self._backward(sb), **labels)]
        return [
            Compute(lambda: self._backward_to_scatter(sb), **labels),
            _in_place(sb, "scatter_grad", self.group, "all_gather", labels),
            Compute(
                lambda: _backward(sb.ends.take("scatter_input"), sb.ends.take("scatter_grad")),
                **labels,
            ),
        ]

    def _rerun(self, sb):
        """Megatron's embedding forward again, with the forward's dropout (deferring: affine in
        the unreduced lookup, so its gradients are exact)."""
        with replay(sb.ends.take("rng")):
            return self.forward(self.module, self.ids[sb.index], self.pos[sb.index])

    def _backward(self, sb):
        _backward(self._rerun(sb), sb.blocks[0].take("input_grad"))

    def _backward_to_scatter(self, sb):
        """Backward of the ops after Megatron's scatter (dropout, ...): the gradient of the
        local shard, which the schedule all-gathers, as the scatter's backward would."""
        with self.deferral.cut_at_scatter() as cuts:
            out = self._rerun(sb)
        ((full, leaf),) = cuts
        _backward(out, sb.blocks[0].take("input_grad"))
        sb.ends.scatter_input, sb.ends.scatter_grad = full, leaf.grad


class OutputEnd(_End):
    """The last stage's final layernorm, output layer and loss as the last ops of each
    sub-batch's forward program and the first of its backward program."""

    LABELS = dict(layer=-1, block="output")

    def __init__(self, model, final_layernorm, labels, runtime_gather_output):
        self.model, self.final_layernorm = model, final_layernorm
        self.labels, self.runtime_gather_output = labels, runtime_gather_output
        self.labels_of = None

    def split(self, split):
        self.labels_of = split.tokens(self.labels)

    @property
    def group(self):
        return self.model.output_layer.tp_group

    @property
    def sequence_parallel(self):
        """Under SP the final norm runs on the s/t shard and the output layer on its all-gather
        (the schedule's collective, as for the blocks); its input gradient is reduce-scattered.
        The output layer keeps the gathered input for its weight gradient (stock re-gathers it):
        one s·b·h tensor per sub-batch until backward."""
        return self.model.config.sequence_parallel

    @property
    def staged_loss(self):
        """The loss is Megatron's unfused vocab-parallel cross-entropy: it runs as ops around its
        collectives (:mod:`.loss`), so its all-reduces hide behind the other sub-batch."""
        return loss.qualifies(self.model, self.group)

    def forward_ops(self, sb, anchor, grad_slot):
        """``anchor``: the schedule's grad anchor (:func:`.cuts.grad_sink`); the gradient of
        the layers' output lands in ``grad_slot(g)``."""
        labels = dict(**{"pass": "forward"}, **self.LABELS)
        norm = lambda: self._final_norm(sb, anchor, grad_slot)  # noqa: E731
        ops = []

        def head():  # the logits: final norm (under SP it ran before the gather), output layer
            if not self.sequence_parallel:
                norm()
            return self._logits(sb, anchor)

        if self.sequence_parallel:
            ops = [
                Compute(norm, **labels),
                _in_place(sb, "head_input", self.group, "all_gather", labels, detach=True),
            ]
        deliver = lambda t: self._delivered(sb, t)  # noqa: E731
        if self.staged_loss:
            return ops + loss.cross_entropy_ops(
                self.group, head, self.labels_of[sb.index], deliver, **labels
            )
        return ops + [Compute(lambda: deliver(self._stock_loss(sb, head())), **labels)]

    def _final_norm(self, sb, anchor, grad_slot):
        with torch.enable_grad():
            hidden = grad_sink(anchor, sb.output, grad_slot)
            ln = hidden if self.final_layernorm is None else self.final_layernorm(hidden)
        sb.ends.norm_output, sb.ends.head_input = ln, ln.detach()
        sb.output = None

    def _logits(self, sb, anchor):
        """The output layer (and 0.19's logit scaling) on the final norm's output, [s, b, v/t]."""
        model = self.model
        with torch.enable_grad():
            x = grad_sink(
                anchor, sb.ends.take("head_input"), BlockOps.store(sb.ends, "head_input_grad")
            )
            weight = None
            if model.share_embeddings_and_output_weights:
                weight = model.shared_embedding_or_output_weight()
            logits, _ = model.output_layer(
                x, weight=weight, runtime_gather_output=self.runtime_gather_output
            )
            scale = getattr(model, "_scale_logits", None)  # 0.19; checked at install time
            return logits if scale is None else scale(logits)

    def _stock_loss(self, sb, logits):
        with torch.enable_grad():
            return self.model.compute_language_model_loss(self.labels_of[sb.index], logits)

    @staticmethod
    def _delivered(sb, per_token):
        sb.ends.loss, sb.loss = per_token, per_token.detach()

    def backward_ops(self, sb):
        """Loss and output-layer backward (input gradient unreduced), its all-reduce (under SP
        a reduce-scatter), then the final layernorm's backward, which delivers the layers'
        output gradient."""
        labels = dict(**{"pass": "backward"}, **self.LABELS)
        return [
            Compute(lambda: _backward(sb.ends.take("loss"), sb.ends.take("loss_grad")), **labels),
            _in_place(sb, "head_input_grad", self.group, self.reduction, labels),
            Compute(
                lambda: _backward(sb.ends.take("norm_output"), sb.ends.take("head_input_grad")),
                **labels,
            ),
        ]
