"""The ``oases-schedule`` patch: where Megatron hands over to the schedule, in one list.

:func:`make_patch` lists every Megatron (and torch) symbol the schedule replaces, and checks at
install time that each is the one Megatron calls, so a change of Megatron fails here, not in a
run (:func:`megatron_oases.compat.require_symbol` / ``require_call``). All are restored by
``uninstall``. The replacements' bodies live beside what they work with:

- ``TransformerBlock.forward`` → :mod:`.transformer_block`: a GPT stage's layers as
  :func:`.engine.schedule_layers` nodes, one per span of equal-degree layers with a plan (bound
  per decoder instance by ``prepare_model``, :mod:`megatron_oases.layer_degrees.runtime`);
- ``HybridStack.forward`` → :mod:`.hybrid_stack`: a ``HybridModel`` stage's layers, one node;
- a schedule without a plan: ``GPTModel.forward``, ``GPTModel._postprocess`` and
  ``tensor_parallel.scatter_to_sequence_parallel_region`` → :mod:`.stage_ends` (and :mod:`.deferral`
  for the scatter): the embedding and the output layer + loss as ops of the programs;
- ``tensor_parallel.layers.reduce_from_tensor_model_parallel_region`` and
  ``reduce_scatter_to_sequence_parallel_region``, ``ColumnParallelLinear.forward``,
  ``torch.distributed.all_reduce`` → :mod:`.deferral`: Megatron's own TMP communication deferred
  to the schedule inside the engine's compute ops (its opening table: who sets and who reads
  each field of the state they share);
- a plan: checkpoint save/load, ``finalize_model_grads`` (before 0.19) and
  ``param_is_not_tensor_parallel_duplicate`` (with its copy in ``optimizer.clip_grads``) →
  :mod:`megatron_oases.layer_degrees`: checkpoints in the stock layout, the replica sync, grad-norm
  clipping counting each replica once.

Outside the engine (eval, inference, a call that does not qualify) every replacement runs
stock code.
"""

from megatron.core.tensor_parallel import layers as tp_layers
from megatron.core.transformer.transformer_block import TransformerBlock

from ..compat import finalize_model_grads_replacements, require_call, require_symbol
from ..layer_degrees.model import make_param_is_not_tp_duplicate
from ..patching import Patch
from . import stage_ends
from .deferral import make_all_reduce, make_column_forward, make_deferred_reduction, make_scatter
from .engine import LayerSchedule
from .graphs import BlockGraphs
from .hybrid_stack import make_stack_forward
from .loss import check_megatron as check_cross_entropy
from .transformer_block import make_block_forward


def _stage_end_replacements():
    """``GPTModel.forward``/``_postprocess`` and the SP scatter, each checked to be what Megatron
    calls (a change of Megatron's GPTModel fails at install time)."""
    from megatron.core import tensor_parallel
    from megatron.core.models.common.embeddings.language_model_embedding import (
        LanguageModelEmbedding,
    )
    from megatron.core.models.gpt.gpt_model import GPTModel

    require_symbol(GPTModel, "_postprocess", called_by=[GPTModel.forward])
    require_symbol(GPTModel, "_preprocess", called_by=[GPTModel.forward])
    require_symbol(GPTModel, "_postprocess", parameters=("hidden_states", "extra_block_kwargs"))
    # the StageCall travels in extra_block_kwargs; the placeholder as decoder_input
    require_call(GPTModel.forward, "**(extra_block_kwargs or {})")
    require_call(GPTModel.forward, "extra_block_kwargs=extra_block_kwargs")
    require_call(GPTModel._preprocess, "if decoder_input is not None:")
    require_call(GPTModel._preprocess, "self.embedding(")
    # what OutputEnd calls in place of _postprocess's output layer and loss
    for name in ("self.output_layer(", "self.compute_language_model_loss("):
        require_call(GPTModel._postprocess, name)
    if hasattr(GPTModel, "_scale_logits"):
        require_call(GPTModel._postprocess, "self._scale_logits(")
    check_cross_entropy()  # the loss's steps (.loss) are Megatron's cross-entropy
    embedding = require_symbol(
        LanguageModelEmbedding, "forward", parameters=("input_ids", "position_ids")
    )
    require_call(LanguageModelEmbedding.forward, "self.word_embeddings(input_ids)")
    # under SP the embedding's split, whose backward all-gather the schedule issues (.comm)
    scatter = require_symbol(
        tensor_parallel,
        "scatter_to_sequence_parallel_region",
        called_by=[LanguageModelEmbedding.forward],
    )
    require_call(
        LanguageModelEmbedding.forward, "tensor_parallel.scatter_to_sequence_parallel_region("
    )
    return [
        (GPTModel, "forward", stage_ends.model_forward(GPTModel.forward, embedding)),
        (GPTModel, "_postprocess", stage_ends.postprocess(GPTModel._postprocess)),
        (tensor_parallel, "scatter_to_sequence_parallel_region", make_scatter(scatter)),
    ]


def _early_all_reduce():
    """``torch.distributed.all_reduce``, routing the column linears' input-gradient all-reduce to
    the schedule (:mod:`.deferral`): checked to be how Megatron's linear issues it, before its weight
    gradient, on the group its forward saved."""
    import torch.distributed
    from megatron.core.tensor_parallel.layers import (
        ColumnParallelLinear,
        LinearWithGradAccumulationAndAsyncCommunication,
    )

    backward = LinearWithGradAccumulationAndAsyncCommunication.backward
    original = require_symbol(torch.distributed, "all_reduce", called_by=[backward])
    require_call(
        backward, "torch.distributed.all_reduce(grad_input, group=tp_group, async_op=True)"
    )
    require_call(LinearWithGradAccumulationAndAsyncCommunication.forward, "ctx.tp_group = tp_group")
    require_call(ColumnParallelLinear.forward, "tp_group=self.tp_group")
    return (torch.distributed, "all_reduce", make_all_reduce(original))


def _hybrid_stack(layer_schedule):
    """``HybridStack.forward`` (:mod:`.hybrid_stack`), checked to be the loop it replaces."""
    from megatron.core.models.hybrid.hybrid_block import HybridStack

    original = require_symbol(
        HybridStack, "forward", parameters=("hidden_states", "attention_mask", "rotary_pos_emb")
    )
    require_call(HybridStack.forward, "for layer in self.layers:")
    require_call(HybridStack.forward, "self.final_norm(hidden_states)")
    return (HybridStack, "forward", make_stack_forward(original, layer_schedule))


def make_patch(config, built=None):
    """``oases-schedule`` for a checked :class:`~megatron_oases.config.OasesConfig` asking for a
    split schedule or a per-layer plan, else None. ``built``: the patches built before this one
    (by name); the tracer of ``oases-trace``."""
    if not config.patches_model:
        return None
    plan = config.plan is not None
    trace = (built or {}).get("oases-trace")
    from megatron.core import tensor_parallel
    from megatron.core.optimizer import clip_grads
    from megatron.core.tensor_parallel.layers import (
        ColumnParallelLinear,
        RowParallelLinear,
        VocabParallelEmbedding,
    )

    # The stage's ends (embedding, output layer + loss) join the programs of a uniform-TP
    # schedule, with or without sequence parallelism (:mod:`.stage_ends`).
    # ``--oases-schedule auto`` starts on stock; its tuner selects each iteration's candidate
    auto = config.autotune is not None
    layer_schedule = LayerSchedule(
        schedule="off" if auto else config.schedule,
        parts=config.sub_batches,
        split=config.split,
        graphs=BlockGraphs(config.cuda_graphs) if config.cuda_graphs and not auto else None,
        tracer=trace.tracer if trace is not None else None,
    )
    replacements = [
        (TransformerBlock, "forward", make_block_forward(TransformerBlock.forward, layer_schedule)),
        _hybrid_stack(layer_schedule),
    ]
    if config.overlapped and not plan:
        ends = _stage_end_replacements()
        replacements += [_stock_when_off(r, layer_schedule) for r in ends] if auto else ends
    embed = VocabParallelEmbedding.forward  # the embedding's reduction (.stage_ends)
    for name in (
        "reduce_from_tensor_model_parallel_region",
        "reduce_scatter_to_sequence_parallel_region",
    ):
        original = require_symbol(tp_layers, name, called_by=[RowParallelLinear.forward, embed])
        scatters = name.startswith("reduce_scatter")
        replacements.append((tp_layers, name, make_deferred_reduction(original, scatters)))
    replacements += [
        (ColumnParallelLinear, "forward", make_column_forward(ColumnParallelLinear.forward)),
        _early_all_reduce(),
    ]
    if plan:  # checkpoints of a plan are written in the stock layout
        from ..layer_degrees.checkpoint import make_checkpoint_replacements

        replacements += make_checkpoint_replacements()
        replacements += finalize_model_grads_replacements()  # the replica sync, before 0.19
    if plan:  # grad-norm clipping counts each replica of a degree-d shard once
        for owner in (tensor_parallel, clip_grads):
            replacements.append(
                (
                    owner,
                    "param_is_not_tensor_parallel_duplicate",
                    make_param_is_not_tp_duplicate(owner.param_is_not_tensor_parallel_duplicate),
                )
            )
    patch = Patch("oases-schedule", replacements=replacements)
    patch.layer_schedule = layer_schedule  # what ``auto``'s tuner selects on (.tuning.runtime)
    return patch


def _stock_when_off(replacement, layer_schedule):
    """A stage-end replacement that runs Megatron's original while ``auto`` selects stock."""
    owner, name, new = replacement
    original = getattr(owner, name)

    def gated(*args, **kwargs):
        if layer_schedule.schedule == "off":
            return original(*args, **kwargs)
        return new(*args, **kwargs)

    gated.__wrapped__ = original
    return owner, name, gated
