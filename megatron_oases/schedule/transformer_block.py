"""The ``oases-schedule`` patch: route TransformerBlock's layers through the overlapped schedule.

Replaced symbols (all restored by ``uninstall``):

- ``TransformerBlock.forward``: in training with grad enabled, the layer loop (and Megatron's
  ``_checkpointed_forward``) is replaced by one :class:`.engine.ScheduledLayersFunction` node per
  run of equal-degree layers (one run without a plan), with batch resharding between runs
  (:mod:`megatron_oases.hetero.reshard`); everything else (PP input tensor, final layernorm) is as
  stock. Eval/inference runs stock code.
- with a plan, ``tensor_parallel.param_is_not_tensor_parallel_duplicate`` (and its by-name copy
  in ``optimizer.clip_grads``): grad-norm clipping counts each replica once.
- ``GPTModel.forward``, ``GPTModel._postprocess`` and
  ``tensor_parallel.scatter_to_sequence_parallel_region`` (a schedule without a plan): the
  embedding and the output layer + loss run inside the schedule's programs (:mod:`.stage`); any
  other call runs stock code.
- ``tensor_parallel.layers.reduce_from_tensor_model_parallel_region``,
  ``tensor_parallel.layers.reduce_scatter_to_sequence_parallel_region`` and
  ``ColumnParallelLinear.forward``: honour the engine's deferral of TMP communication
  (:mod:`.comm`); stock behaviour outside the engine.
"""

import contextlib
import logging

import torch
from megatron.core.tensor_parallel import layers as tp_layers
from megatron.core.transformer.transformer_block import TransformerBlock
from megatron.core.utils import make_viewless_tensor

from ..compat import finalize_model_grads_replacements, require_call, require_symbol
from ..errors import OasesConfigError
from ..hetero.model import make_param_is_not_tp_duplicate
from ..hetero.reshard import reshard
from ..hetero.runtime import stage_of
from ..patching import Patch
from ..validation import SUB_BATCHES
from . import stage
from .blocks import LayerBlocks
from .comm import make_all_reduce, make_column_forward, make_deferred_reduction, make_scatter
from .engine import ScheduledLayers, ScheduledLayersFunction
from .graphs import BlockGraphs
from .loss import check_megatron as check_cross_entropy
from .stage import CALL_KWARG

logger = logging.getLogger(__name__)


def make_block_forward(original, mode, tracer=None, parts=SUB_BATCHES, split="batch", graphs=None):
    """``TransformerBlock.forward`` running the layers as degree runs (plan) through ``mode``;
    ``tracer`` (the ``oases-trace`` patch's, optional) records the schedule's ops; a
    :class:`.stage.StageCall` in the call's keywords (from ``GPTModel.forward``) brings the
    embedding and the output layer + loss into the programs; ``split``: ``--oases-split``;
    ``graphs``: the run's :class:`.graphs.BlockGraphs` (``--oases-cuda-graphs``) or None."""
    counter = {"microbatch": 0}

    def forward(
        self,
        hidden_states,
        attention_mask=None,
        context=None,
        context_mask=None,
        rotary_pos_emb=None,
        rotary_pos_cos=None,
        rotary_pos_sin=None,
        rotary_pos_cos_sin=None,
        attention_bias=None,
        inference_context=None,
        packed_seq_params=None,
        sequence_len_offset=None,
        padding_mask=None,
        **kwargs,
    ):
        call = kwargs.pop(CALL_KWARG, None)  # the stage's ends (.stage), when GPTModel gave them
        # Eval/inference: stock code. (A degree-d layer fed the whole micro-batch is still
        # correct — each d-group computes the same result — so plans need no special case.)
        if not (self.training and torch.is_grad_enabled()) or len(self.layers) == 0:
            if call is not None:  # a placeholder from the embedding becomes real data
                hidden_states = call.resolve(hidden_states)
            return original(
                self,
                hidden_states,
                attention_mask,
                context,
                context_mask,
                rotary_pos_emb,
                rotary_pos_cos,
                rotary_pos_sin,
                rotary_pos_cos_sin,
                attention_bias,
                inference_context,
                packed_seq_params,
                sequence_len_offset,
                padding_mask,
                **kwargs,
            )
        if context is not None or packed_seq_params is not None or inference_context is not None:
            raise OasesConfigError(
                "--oases-schedule supports decoder-only training without packed "
                "sequences or cross-attention; use --oases-schedule off"
            )
        embedding, output = call.take(self, hidden_states) if call is not None else (None, None)
        if not self.pre_process:
            hidden_states = self.input_tensor
        if embedding is None:
            hidden_states = make_viewless_tensor(
                inp=hidden_states, requires_grad=True, keep_graph=True
            )
        mb = tracer.next_microbatch() if tracer else counter["microbatch"]
        counter["microbatch"] += 1
        hetero = stage_of(self)
        if hetero is None:
            runs, T = [(None, list(range(len(self.layers))))], None
        else:
            runs, T = hetero.runs(), hetero.groups.T
        degree, mask = T, attention_mask
        # As stock: under sequence parallelism the layers run in the model-parallel RNG fork
        # (TP ranks hold different tokens); recomputation replays snapshots taken inside it.
        with _sequence_parallel_rng(self.config):
            for d, idx in runs:
                layers = [self.layers[i] for i in idx]
                if hetero is not None:
                    hidden_states = reshard(hidden_states, degree, d, hetero.groups)
                    mask = _mask_share(attention_mask, hidden_states.size(1), d, hetero.groups)
                    degree = d
                recomputed = recomputed_layers(self.config, idx)
                if mode == "off":
                    hidden_states = _stock_layers(
                        layers, recomputed, hidden_states, mask, rotary_pos_emb, attention_bias
                    )
                else:
                    run = ScheduledLayers(
                        LayerBlocks(layers, mask, rotary_pos_emb, attention_bias, graphs),
                        mode,
                        microbatch=mb,
                        recompute=self.config.recompute_granularity == "full",
                        recompute_layers=recomputed,
                        tracer=tracer,
                        parts=parts,
                        embedding=embedding,
                        output=output,
                        split=split,
                    )
                    hidden_states = ScheduledLayersFunction.apply(run, hidden_states)
        if output is not None:  # the per-token loss; GPTModel._postprocess passes it through
            call.loss = hidden_states
            return hidden_states
        if hetero is not None:
            hidden_states = reshard(hidden_states, degree, T, hetero.groups)
        if self.final_layernorm is not None:
            hidden_states = self.final_layernorm(hidden_states)
            hidden_states = make_viewless_tensor(
                inp=hidden_states, requires_grad=True, keep_graph=True
            )
        return hidden_states

    forward.__wrapped__ = original
    return forward


def _sequence_parallel_rng(config):
    if not config.sequence_parallel:
        return contextlib.nullcontext()
    from megatron.core import tensor_parallel

    return tensor_parallel.get_cuda_rng_tracker().fork()


def _mask_share(mask, batch, degree, groups):
    """A per-sample attention mask cut to this degree-d group's batch share (as :func:`reshard`
    cuts the activations); a shared mask is returned as it is."""
    if mask is None or mask.dim() == 0 or mask.size(0) == 1 or mask.size(0) == batch:
        return mask
    return torch.chunk(mask, groups.T // degree, dim=0)[groups.group_index(degree)]


def recomputed_layers(config, idx):
    """How many of a run's layers (``idx``: their indices in the stage, ascending) Megatron's
    full recomputation checkpoints: all of them under ``--recompute-method uniform`` (one layer
    per checkpoint, see :mod:`megatron_oases.validation`), those among the stage's first
    ``--recompute-num-layers`` under ``block`` (always a leading part of the run), none without
    full recomputation."""
    if config.recompute_granularity != "full":
        return 0
    if config.recompute_method == "block":
        return sum(1 for i in idx if i < config.recompute_num_layers)
    return len(idx)


def _stock_layers(layers, recomputed, hidden, attention_mask, rotary_pos_emb, attention_bias):
    """Megatron's layer loop for a run of layers; its first ``recomputed`` layers checkpointed
    one at a time, as Megatron's full recomputation does."""
    from megatron.core import tensor_parallel

    def call(layer, h):
        return layer(
            hidden_states=h,
            attention_mask=attention_mask,
            rotary_pos_emb=rotary_pos_emb,
            attention_bias=attention_bias,
        )[0]

    for i, layer in enumerate(layers):
        if i < recomputed:
            hidden = tensor_parallel.checkpoint(
                lambda h, layer=layer: call(layer, h), False, hidden
            )
        else:
            hidden = call(layer, hidden)
    return hidden


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
        (GPTModel, "forward", stage.model_forward(GPTModel.forward, embedding)),
        (GPTModel, "_postprocess", stage.postprocess(GPTModel._postprocess)),
        (tensor_parallel, "scatter_to_sequence_parallel_region", make_scatter(scatter)),
    ]


def _early_all_reduce():
    """``torch.distributed.all_reduce``, routing the column linears' input-gradient all-reduce to
    the schedule (:mod:`.comm`): checked to be how Megatron's linear issues it, before its weight
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


def _hybrid_stack(config, mode, tracer, graphs):
    """``HybridStack.forward`` (:mod:`.hybrid_stack`), checked to be the loop it replaces."""
    from megatron.core.models.hybrid.hybrid_block import HybridStack

    from .hybrid_stack import make_stack_forward

    original = require_symbol(
        HybridStack, "forward", parameters=("hidden_states", "attention_mask", "rotary_pos_emb")
    )
    require_call(HybridStack.forward, "for layer in self.layers:")
    require_call(HybridStack.forward, "self.final_norm(hidden_states)")
    forward = make_stack_forward(original, mode, tracer, config.sub_batches, config.split, graphs)
    return (HybridStack, "forward", forward)


def make_patch(config, built=None):
    """``oases-schedule`` for a checked :class:`~megatron_oases.config.OasesConfig` asking for a
    split schedule or a per-layer plan, else None. ``built``: the patches built before this one
    (by name); the tracer of ``oases-trace``."""
    if not config.patches_model:
        return None
    mode, plan = str(config.schedule), config.plan is not None
    trace = (built or {}).get("oases-trace")
    tracer = trace.tracer if trace is not None else None
    from megatron.core import tensor_parallel
    from megatron.core.optimizer import clip_grads
    from megatron.core.tensor_parallel.layers import (
        ColumnParallelLinear,
        RowParallelLinear,
        VocabParallelEmbedding,
    )

    # The stage's ends (embedding, output layer + loss) join the programs of a uniform-TP
    # schedule, with or without sequence parallelism (:mod:`.stage`).
    graphs = BlockGraphs(config.cuda_graphs) if config.cuda_graphs else None
    forward = make_block_forward(
        TransformerBlock.forward, mode, tracer, config.sub_batches, config.split, graphs
    )
    replacements = [
        (TransformerBlock, "forward", forward),
        _hybrid_stack(config, mode, tracer, graphs),
    ]
    if mode != "off" and not plan:
        replacements += _stage_end_replacements()
    embed = VocabParallelEmbedding.forward  # the embedding's reduction (.stage)
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
        from ..hetero.checkpoint import make_checkpoint_replacements

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
    return Patch("oases-schedule", replacements=replacements)
