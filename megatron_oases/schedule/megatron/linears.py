"""The scheduled stage's own TP linears: Megatron's, re-classed per instance so that they defer
their collectives to the schedule while the engine runs (:class:`.deferral.Deferral`).

Megatron's pattern, as in ``tensor_parallel/layers.py``: a private autograd Function
(:class:`_LinearWithEarlyDgrad`) → a public function with an explicit group
(:func:`linear_with_early_dgrad`) → modules (:class:`DeferringColumnLinear`,
:class:`DeferringRowLinear`, :class:`DeferringEmbedding`). :func:`defer_linears` re-classes the
linears of one model instance (``prepare_model``): a subclass of the instance's own class, so it
composes with FSDP2's class swap, which subclasses whatever class it finds. Outside the engine
each one runs Megatron's own code.

While deferring:

- a row linear (attention's ``linear_proj``, the MLP's ``linear_fc2``) returns its partial sum:
  Megatron's own forward under its per-instance switch ``explicit_expert_comm``, which skips
  the all-reduce or, under SP, reduce-scatter; the program's collective follows the op;
- a column linear (``linear_qkv``, ``linear_fc1``, the output layer) neither all-gathers its
  input under SP (the program did) nor reduces its input gradient after the op: its backward
  starts that reduction itself, before the weight gradient as Megatron's does, and hands it to
  the engine's :class:`.comm.EarlyReductions`;
- the embedding returns its vocab shard's partial lookup, or the reduced lookup the schedule
  supplies (:meth:`.deferral.Deferral.supplied`).

The deferred embedding lookup and the Function's backward mirror Megatron's
(``VocabParallelEmbedding.forward`` up to its reduction,
``LinearWithGradAccumulationAndAsyncCommunication.backward`` without SP gathers or deferred
weight gradients), checked at install time by :func:`check_megatron`.
"""

import torch
import torch.nn.functional as F

#: deferring subclass per Megatron class (one each, shared by every instance re-classed)
_CLASSES = {}


class _LinearWithEarlyDgrad(torch.autograd.Function):
    """A column linear whose input gradient's reduction starts in its backward, through
    ``early`` (an :class:`.comm.EarlyReductions`): all-reduced on ``group`` or (``scatter``,
    sequence parallelism: the schedule all-gathered the input) reduce-scattered."""

    @staticmethod
    def forward(ctx, input, weight, bias, gradient_accumulation_fusion, early, group, scatter):
        fused = gradient_accumulation_fusion and hasattr(weight, "main_grad")
        ctx.save_for_backward(input, weight)
        ctx.main_grad = weight.main_grad if fused else None
        ctx.fusion, ctx.use_bias = gradient_accumulation_fusion, bias is not None
        ctx.early, ctx.group, ctx.scatter = early, group, scatter
        output = torch.matmul(input, weight.t())
        return output if bias is None else output + bias

    @staticmethod
    def backward(ctx, grad_output):
        from megatron.core.utils import prepare_input_tensors_for_wgrad_compute

        input, weight = ctx.saved_tensors
        if ctx.fusion:
            weight.main_grad = ctx.main_grad
        grad_input = grad_output.matmul(weight)
        grad_output, total_input = prepare_input_tensors_for_wgrad_compute(grad_output, input)
        # started before the weight gradient, which it hides behind (as Megatron's linear)
        early, ctx.early = ctx.early, None
        early.start(grad_input, ctx.group, ctx.scatter)
        grad_weight = _weight_gradient(ctx, weight, grad_output, total_input)
        grad_bias = grad_output.sum(dim=0) if ctx.use_bias else None
        return grad_input, grad_weight, grad_bias, None, None, None, None


def _weight_gradient(ctx, weight, grad_output, total_input):
    """Megatron's weight gradient: a GEMM, or with gradient-accumulation fusion accumulated into
    ``main_grad`` by its CUDA extension (then a dummy gradient where DDP expects one)."""
    if not ctx.fusion:
        return grad_output.t().matmul(total_input)
    from megatron.core.tensor_parallel import layers

    if hasattr(weight, "__fsdp_param__"):
        raise RuntimeError(
            "oases: Megatron-FSDP's weight gradients under a split schedule; use "
            "--oases-schedule off or --use-torch-fsdp2"
        )
    fused = layers.fused_weight_gradient_mlp_cuda
    main_grad = weight.main_grad
    if main_grad.dtype == torch.float32:
        fused.wgrad_gemm_accum_fp32(total_input, grad_output, main_grad)
    elif main_grad.dtype in (torch.float16, torch.bfloat16):
        fused.wgrad_gemm_accum_fp16(total_input, grad_output, main_grad)
    else:
        raise RuntimeError("Unsupported gradient type for gradient accumulation fusion")
    if not hasattr(weight, "grad_added_to_main_grad"):
        return None
    zero = getattr(weight, "zero_out_wgrad", False)
    dummy = getattr(layers, "get_dummy_wgrad", None) if getattr(layers, "HAVE_TE", False) else None
    if dummy is not None:
        grad_weight = dummy(list(main_grad.shape), total_input.dtype, zero=zero)
    else:
        new = torch.zeros if zero else torch.empty
        grad_weight = new(main_grad.shape, dtype=total_input.dtype, device=total_input.device)
    weight.grad_added_to_main_grad = True
    return grad_weight


def linear_with_early_dgrad(
    input, weight, bias, gradient_accumulation_fusion, early, group, scatter=False
):
    """``input @ weight.T + bias`` whose backward starts the input gradient's reduction on
    ``group`` through ``early`` (:class:`_LinearWithEarlyDgrad`)."""
    return _LinearWithEarlyDgrad.apply(
        input, weight, bias, gradient_accumulation_fusion, early, group, scatter
    )


class DeferringColumnLinear:
    """Mixin before Megatron's ``ColumnParallelLinear``: Megatron's own ``forward``, whose matrix
    multiply (``_forward_impl``, Megatron's hook for it) defers its communication while the
    stage's deferral is active."""

    oases_deferral = None

    def _forward_impl(self, input, weight, *args, **kwargs):
        deferral = self.oases_deferral
        if not deferral.active:
            return super()._forward_impl(input, weight, *args, **kwargs)
        if args or kwargs.get("grad_output_buffer") is not None:
            raise RuntimeError(
                "oases: ColumnParallelLinear called its linear differently (Megatron changed?) "
                "or with --defer-embedding-wgrad-compute; use --oases-schedule off"
            )
        reduces = kwargs["allreduce_dgrad"] or kwargs["sequence_parallel"]
        if deferral.early is None or not reduces or not weight.requires_grad:
            # no collective of Megatron's: the schedule reduces the input gradient after the op
            stock = dict(kwargs, allreduce_dgrad=False, sequence_parallel=False)
            return super()._forward_impl(input, weight, **stock)
        return linear_with_early_dgrad(
            input,
            weight,
            kwargs["bias"],
            kwargs["gradient_accumulation_fusion"],
            deferral.early,
            kwargs["tp_group"],
            scatter=kwargs["sequence_parallel"],
        )


class DeferringRowLinear:
    """Mixin before Megatron's ``RowParallelLinear``: while the stage's deferral is active,
    Megatron's own forward returns the partial sum (and the bias, which the layers add after the
    reduction: ``skip_bias_add``, checked by ``blocks.check_layer``) through Megatron's own
    per-instance switch for a caller that owns the communication, ``explicit_expert_comm`` (set
    per instance by Megatron's overlapped shared experts)."""

    oases_deferral = None

    @property
    def explicit_expert_comm(self):
        # the value Megatron's constructor set (False: ``defer_linears`` re-classes no other)
        constructed = self.__dict__.get("explicit_expert_comm", False)
        return constructed or self.oases_deferral.active

    @explicit_expert_comm.setter
    def explicit_expert_comm(self, value):
        self.__dict__["explicit_expert_comm"] = value


class DeferringEmbedding:
    """Mixin before Megatron's ``VocabParallelEmbedding``: while the stage's deferral is active,
    the vocab shard's partial lookup (under Megatron's reduce-scatter, ``[s, b, h]``; inside a
    cut its local shard, :meth:`.deferral.Deferral.cut_at_scatter`), or the reduction the
    schedule supplies."""

    oases_deferral = None

    def forward(self, input_):
        deferral = self.oases_deferral
        if not deferral.active:
            return super().forward(input_)
        supplied = deferral.take_supplied()
        if supplied is not None:
            return _checked_supply(self, input_, supplied)
        partial = self._partial_lookup(input_)
        if not self.reduce_scatter_embeddings:
            return partial
        partial = partial.transpose(0, 1).contiguous()
        if deferral.cuts is None:
            return partial
        group = self.tp_group
        n = partial.size(0) // group.size()
        return deferral.cut(partial, partial[group.rank() * n : (group.rank() + 1) * n])

    def _partial_lookup(self, input_):
        """Megatron's lookup of this vocab shard, tokens of other shards zero."""
        sharded = self.tp_group.size() > 1
        if sharded:
            input_mask = (input_ < self.vocab_start_index) | (input_ >= self.vocab_end_index)
            masked_input = input_.clone() - self.vocab_start_index
            masked_input[input_mask] = 0
        else:
            masked_input = input_
        if self.deterministic_mode:
            output_parallel = self.weight[masked_input]
        else:
            output_parallel = F.embedding(masked_input, self.weight)
        if sharded:
            output_parallel[input_mask, :] = 0.0
        return output_parallel


def _checked_supply(embedding, input_, supplied):
    b, s = input_.shape
    h = supplied.size(-1)
    expected = [(b, s, h)]
    if embedding.reduce_scatter_embeddings:  # Megatron's reduce-scatter along s, [s/t, b, h]
        expected = [(s // embedding.tp_group.size(), b, h)]
    if tuple(supplied.shape) not in expected:
        raise RuntimeError(
            f"oases: supplied reduction of shape {tuple(supplied.shape)} for a lookup of "
            f"{expected[0]}"
        )
    return supplied


def _deferring(module, mixin, deferral):
    cls = type(module)
    if not isinstance(module, mixin):
        new = _CLASSES.get(cls)
        if new is None:
            new = _CLASSES[cls] = type(f"Deferring{cls.__name__}", (mixin, cls), {})
        module.__class__ = new
    module.oases_deferral = deferral


def defer_linears(modules, deferral):
    """Re-class the TP linears (and vocab-parallel embeddings) inside ``modules`` so they defer
    to ``deferral`` while it is active; returns how many. A row linear must take its input
    already split (``input_is_parallel``), as every linear of a transformer layer does."""
    from megatron.core.tensor_parallel.layers import (
        ColumnParallelLinear,
        RowParallelLinear,
        VocabParallelEmbedding,
    )

    count = 0
    for root in modules:
        for module in root.modules():
            if isinstance(module, ColumnParallelLinear):
                _deferring(module, DeferringColumnLinear, deferral)
            elif isinstance(module, RowParallelLinear):
                if not module.input_is_parallel or getattr(module, "explicit_expert_comm", False):
                    raise RuntimeError(
                        f"oases: a RowParallelLinear without input_is_parallel in "
                        f"{type(root).__name__}; use --oases-schedule off"
                    )
                _deferring(module, DeferringRowLinear, deferral)
            elif isinstance(module, VocabParallelEmbedding):
                _deferring(module, DeferringEmbedding, deferral)
            else:
                continue
            count += 1
    return count


def check_megatron():
    """The Megatron code the deferred paths mirror or rely on is still what it was (install time;
    one line naming the symbol otherwise)."""
    from megatron.core.tensor_parallel.layers import (
        ColumnParallelLinear,
        LinearWithGradAccumulationAndAsyncCommunication,
        RowParallelLinear,
        VocabParallelEmbedding,
    )

    from ...compat import require_call, require_symbol

    row = RowParallelLinear.forward
    for text in ("if self.explicit_expert_comm:", "output_ = output_parallel"):
        require_call(row, text)
    column = ColumnParallelLinear.forward
    require_symbol(ColumnParallelLinear, "_forward_impl", called_by=[column])
    for text in ("allreduce_dgrad=allreduce_dgrad", "tp_group=self.tp_group", "bias=bias"):
        require_call(column, text)
    backward = LinearWithGradAccumulationAndAsyncCommunication.backward
    for text in (
        "grad_input = grad_output.matmul(weight)",
        "torch.distributed.all_reduce(grad_input, group=tp_group, async_op=True)",
        "prepare_input_tensors_for_wgrad_compute(",
        "grad_weight = grad_output.t().matmul(total_input)",
        "weight.grad_added_to_main_grad = True",
    ):
        require_call(backward, text)
    lookup = VocabParallelEmbedding.forward
    for text in (
        "input_.clone() - self.vocab_start_index",
        "F.embedding(masked_input, ",
        "output_parallel[input_mask, :] = 0.0",
        "output_parallel.transpose(0, 1).contiguous()",
        "reduce_from_tensor_model_parallel_region(output_parallel, group=self.tp_group)",
    ):
        require_call(lookup, text)
