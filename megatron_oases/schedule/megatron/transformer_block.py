"""A GPT stage's decoder (``TransformerBlock``) forward under the schedule, bound to one decoder
instance by :func:`megatron_oases.schedule.megatron.binding.bind_schedule`.

In training with grad enabled, the layer loop (and Megatron's ``_checkpointed_forward``) becomes
one :func:`.engine.schedule_layers` node per span of equal-degree layers (one span without a
plan), with batch resharding between spans (:mod:`megatron_oases.layer_degrees.reshard`);
everything else (PP input tensor, final layernorm) is as stock. Eval/inference runs Megatron's
own ``TransformerBlock.forward``.
"""

import contextlib

import torch
from megatron.core.utils import make_viewless_tensor

from ...errors import OasesConfigError
from ...layer_degrees.reshard import reshard
from ...validation import Schedule
from .entry import recomputed_layers, schedule_layers


def block_forward(
    self,
    stage,
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
    """This decoder's forward (bound to the instance with its ``stage``, a
    :class:`~megatron_oases.schedule.megatron.binding.StageSchedule`): the layers under the stage's
    :class:`.engine.LayerSchedule`, as degree spans where a plan gave ``stage.degrees``; the
    ends of the model's current call (``stage.call``, :mod:`.gpt_model`) join the programs."""
    from megatron.core.transformer.transformer_block import TransformerBlock

    layer_schedule, layer_degrees, call = stage.layer_schedule, stage.degrees, stage.call
    # Eval/inference: stock code. (A degree-d layer fed the whole micro-batch is still
    # correct — each d-group computes the same result — so plans need no special case.)
    # So is stock without a plan's degrees (``--oases-schedule auto`` selecting ``off``).
    stock = layer_degrees is None and layer_schedule.schedule == Schedule.OFF
    if not (self.training and torch.is_grad_enabled()) or len(self.layers) == 0 or stock:
        if call is not None:  # the stand-in for the embedding becomes real data
            hidden_states = call.resolve(hidden_states)
        return TransformerBlock.forward(
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
        hidden_states = make_viewless_tensor(inp=hidden_states, requires_grad=True, keep_graph=True)
    mb = layer_schedule.next_microbatch()
    if layer_degrees is None:
        spans, T = [(None, list(range(len(self.layers))))], None
    else:
        spans, T = layer_degrees.spans(), layer_degrees.groups.domain_size
    degree, mask = T, attention_mask
    # As stock: under sequence parallelism the layers run in the model-parallel RNG fork
    # (TP ranks hold different tokens); recomputation replays snapshots taken inside it.
    with _sequence_parallel_rng(self.config):
        for d, idx in spans:
            layers = [self.layers[i] for i in idx]
            if layer_degrees is not None:
                groups = layer_degrees.groups
                hidden_states = reshard(hidden_states, degree, d, groups)
                mask = _mask_share(attention_mask, hidden_states.size(1), d, groups)
                degree = d
            if layer_schedule.schedule == Schedule.OFF:  # a plan's degree spans, unscheduled
                recomputed = recomputed_layers(self.config, idx)
                hidden_states = _stock_layers(
                    layers, recomputed, hidden_states, mask, rotary_pos_emb, attention_bias
                )
            else:
                hidden_states = schedule_layers(
                    stage,
                    layers,
                    hidden_states,
                    self.config,
                    indices=idx,
                    attention_mask=mask,
                    rotary_pos_emb=rotary_pos_emb,
                    attention_bias=attention_bias,
                    microbatch=mb,
                    embedding=embedding,
                    output=output,
                )
    if output is not None:  # the per-token loss; the bound _postprocess passes it through
        call.loss = hidden_states
        return hidden_states
    if layer_degrees is not None:
        hidden_states = reshard(hidden_states, degree, T, layer_degrees.groups)
    if self.final_layernorm is not None:
        hidden_states = self.final_layernorm(hidden_states)
        hidden_states = make_viewless_tensor(inp=hidden_states, requires_grad=True, keep_graph=True)
    return hidden_states


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
    return torch.chunk(mask, groups.domain_size // degree, dim=0)[groups.group_index(degree)]


def _stock_layers(layers, recomputed, hidden, attention_mask, rotary_pos_emb, attention_bias):
    """Megatron's layer loop for a span of layers; its first ``recomputed`` layers checkpointed
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
