"""Megatron's vocab-parallel cross-entropy cut at its collectives, as ops of a sub-batch program.

``_VocabParallelCrossEntropy.forward`` blocks on three small all-reduces per call: the max logit
(MAX), then the target logit and the exp-sum (SUM). Run per sub-batch at the end of a forward
pass, the first of them queues behind the other sub-batch's last block all-reduce (the pass-end
tail) and all three hold the host while nothing else runs; on the emulated rtx3090-pcie link they
were the largest exposed item left in a split micro-batch's trace (notes.md, fourteenth session).

Here the same computation is three compute steps around two collectives that the schedule's
executor issues asynchronously (the two sums travel in one), so each sub-batch's reductions hide
behind the other sub-batch's output layer and softmax::

    logits_i, local max ══MAX══▶ shift, target logit, exp, local sums ══SUM══▶ loss_i, softmax

Every step is Megatron's own (the static helpers of ``VocabParallelCrossEntropy`` that its fused
variants share) and the backward is ``_VocabParallelCrossEntropy.backward`` itself, run on this
function's saved tensors: the loss and the logits' gradient are stock's (the stacked sum adds the
same operands). Only the path ``compute_language_model_loss`` takes by default runs here
(:func:`qualifies`); any other loss stays one compute op calling Megatron.
"""

import torch
import torch.distributed as dist

from ...compat import require_call, require_symbol
from ..engine.executor import Comm, Compute


def _megatron():
    from megatron.core.tensor_parallel import cross_entropy

    return cross_entropy


def check_megatron():
    """At install time: what the steps call is still what Megatron's loss runs (a change of
    Megatron's cross-entropy fails loudly, never silently)."""
    from megatron.core.models.common.language_module.language_module import LanguageModule

    ce = _megatron()
    require_call(LanguageModule.compute_language_model_loss, "labels.transpose(0, 1)")
    require_call(
        LanguageModule.compute_language_model_loss, "tensor_parallel.vocab_parallel_cross_entropy("
    )
    require_call(LanguageModule.compute_language_model_loss, "loss.transpose(0, 1)")
    require_symbol(ce, "_VocabParallelCrossEntropy", called_by=[ce.vocab_parallel_cross_entropy])
    forward = ce._VocabParallelCrossEntropy.forward
    helpers = ce.VocabParallelCrossEntropy
    for name in (
        "calculate_logits_max",
        "calculate_predicted_logits",
        "calculate_cross_entropy_loss",
    ):
        require_symbol(helpers, name, called_by=[forward])
    require_call(forward, "ctx.save_for_backward(exp_logits, target_mask, masked_target_1d)")
    require_call(forward, "ctx.label_smoothing, ctx.vocab_size = label_smoothing, vocab_size")


def qualifies(model, group):
    """The loss is Megatron's unfused vocab-parallel cross-entropy over ``group`` (more than one
    rank): no cross-entropy fusion, and the model's ``compute_language_model_loss`` is
    ``LanguageModule``'s."""
    from megatron.core.models.common.language_module.language_module import LanguageModule

    return (
        group.size() > 1
        and not getattr(model.config, "cross_entropy_loss_fusion", False)
        and type(model).compute_language_model_loss is LanguageModule.compute_language_model_loss
    )


class _Attach(torch.autograd.Function):
    """The last step: the loss from the reduced sums, attached to the logits with Megatron's
    backward (the softmax, computed in place over the shifted exp logits, is what it saves)."""

    @staticmethod
    def forward(ctx, logits, exp_logits, predicted, sum_exp, target_mask, masked_target_1d):
        helpers = _megatron().VocabParallelCrossEntropy
        softmax, loss = helpers.calculate_cross_entropy_loss(exp_logits, predicted, sum_exp)
        ctx.label_smoothing, ctx.vocab_size = 0.0, softmax.size(-1)
        ctx.save_for_backward(softmax, target_mask, masked_target_1d)
        return loss

    @staticmethod
    def backward(ctx, grad_output):
        grad_logits = _megatron()._VocabParallelCrossEntropy.backward(ctx, grad_output)[0]
        return grad_logits, None, None, None, None, None


class _Steps:
    """One sub-batch's cross-entropy between its ops (dropped after the last)."""

    def __init__(self, group, logits, labels, deliver):
        self.group, self.logits_fn, self.labels, self.deliver = group, logits, labels, deliver
        self.logits = self.shifted = self.target = self.max = self.sums = self.kept = None

    def local_max(self):
        """Logits (the caller's function: final norm, output layer), the shard's max."""
        helpers = _megatron().VocabParallelCrossEntropy
        self.logits = self.logits_fn()
        self.target = self.labels.transpose(0, 1).contiguous()  # [b, s] -> [s, b], as Megatron
        with torch.no_grad():
            self.shifted, self.max = helpers.calculate_logits_max(self.logits.detach())

    def local_sums(self):
        """Shift by the global max (in place, as Megatron), target logit, exp, the shard's sum."""
        ce = _megatron()
        shard = self.shifted.size(-1)
        rank, n = self.group.rank(), self.group.size()
        first, last = ce.VocabUtility.vocab_range_from_per_partition_vocab_size(shard, rank, n)
        with torch.no_grad():
            mask, target_1d, predicted, sum_exp, exp_logits = (
                ce.VocabParallelCrossEntropy.calculate_predicted_logits(
                    self.shifted, self.target, self.max, first, last
                )
            )
        self.kept = exp_logits, mask, target_1d
        self.sums, self.shifted, self.max = torch.stack([predicted, sum_exp]), None, None

    def finish(self):
        exp_logits, mask, target_1d = self.kept
        predicted, sum_exp = self.sums.unbind(0)
        with torch.enable_grad():
            loss = _Attach.apply(self.logits, exp_logits, predicted, sum_exp, mask, target_1d)
            loss = loss.transpose(0, 1).contiguous()  # [s, b] -> [b, s], as Megatron
        self.logits = self.sums = self.kept = self.target = None
        self.deliver(loss)

    def ops(self, labels):
        def into(name):
            return lambda t: setattr(self, name, t)

        return [
            Compute(self.local_max, **labels),
            Comm(
                get=lambda: self.max,
                done=into("max"),
                group=self.group,
                reduce_op=dist.ReduceOp.MAX,
                **labels,
            ),
            Compute(self.local_sums, **labels),
            Comm(get=lambda: self.sums, done=into("sums"), group=self.group, **labels),
            Compute(self.finish, **labels),
        ]


def cross_entropy_ops(group, logits, labels, deliver, **trace_labels):
    """The program ops of one sub-batch's loss. ``logits()``: computes the sub-batch's logits
    [s, b, v/t] (with grad); ``labels``: its [b, s] targets; ``deliver(loss)``: takes the [b, s]
    per-token loss, as ``compute_language_model_loss`` returns it."""
    return _Steps(group, logits, labels, deliver).ops(trace_labels)
