"""The ``oases-schedule`` patch: route TransformerBlock's layers through the overlapped schedule.

Replaced symbols (all restored by ``uninstall``):

- ``TransformerBlock.forward``: in training with grad enabled, the layer loop (and Megatron's
  ``_checkpointed_forward``) is replaced by one :class:`.engine.ScheduledLayersFunction` node;
  everything else (PP input tensor, final layernorm) is as stock. Eval/inference runs stock code.
- ``tensor_parallel.layers.reduce_from_tensor_model_parallel_region`` and
  ``ColumnParallelLinear.forward``: honour the engine's deferral of TMP communication
  (:mod:`.comm`); stock behaviour outside the engine.
"""

import logging

import torch
from megatron.core.tensor_parallel import layers as tp_layers
from megatron.core.transformer.transformer_block import TransformerBlock
from megatron.core.utils import make_viewless_tensor

from ..errors import OasesConfigError
from ..patches.registry import Patch
from . import trace as trace_mod
from .blocks import LayerBlocks
from .comm import make_column_forward, make_reduce_from_tp_region
from .engine import SCHEDULES, ScheduledLayers, ScheduledLayersFunction

logger = logging.getLogger(__name__)


def validate_schedule_args(args):
    mode = args.oases_schedule
    if mode not in SCHEDULES:
        raise OasesConfigError(f"unknown --oases-schedule {mode}; choose off or {', '.join(SCHEDULES)}")
    if mode in ("cross-pass", "oases"):
        if args.recompute_granularity != "full":
            raise OasesConfigError(
                f"--oases-schedule {mode} merges recompute with backward; add "
                "--recompute-granularity full or use --oases-schedule overlap"
            )
        if args.recompute_method != "uniform" or (args.recompute_num_layers or 1) != 1:
            raise OasesConfigError(
                f"--oases-schedule {mode} recomputes every layer; use --recompute-method uniform "
                "--recompute-num-layers 1"
            )
    if args.micro_batch_size < 2:
        raise OasesConfigError(
            f"micro-batch {args.micro_batch_size} cannot be split; use --micro-batch-size ≥ 2 or "
            "--oases-schedule off"
        )


def make_schedule_forward(original, mode):
    counter = {"microbatch": 0}

    def forward(self, hidden_states, attention_mask=None, context=None, context_mask=None,
                rotary_pos_emb=None, rotary_pos_cos=None, rotary_pos_sin=None,
                rotary_pos_cos_sin=None, attention_bias=None, inference_context=None,
                packed_seq_params=None, sequence_len_offset=None, padding_mask=None, **kwargs):
        if not (self.training and torch.is_grad_enabled()) or len(self.layers) == 0:
            return original(
                self, hidden_states, attention_mask, context, context_mask, rotary_pos_emb,
                rotary_pos_cos, rotary_pos_sin, rotary_pos_cos_sin, attention_bias,
                inference_context, packed_seq_params, sequence_len_offset, padding_mask, **kwargs
            )
        if context is not None or packed_seq_params is not None or inference_context is not None:
            raise OasesConfigError("--oases-schedule supports decoder-only training without packed "
                                   "sequences or cross-attention; use --oases-schedule off")
        if not self.pre_process:
            hidden_states = self.input_tensor
        hidden_states = make_viewless_tensor(inp=hidden_states, requires_grad=True, keep_graph=True)
        blocks = LayerBlocks(self.layers, attention_mask, rotary_pos_emb, attention_bias)
        tracer = trace_mod.active_tracer()
        mb = tracer.next_microbatch() if tracer else counter["microbatch"]
        counter["microbatch"] += 1
        run = ScheduledLayers(blocks, mode, microbatch=mb)
        hidden_states = ScheduledLayersFunction.apply(run, hidden_states)
        if self.final_layernorm is not None:
            hidden_states = self.final_layernorm(hidden_states)
            hidden_states = make_viewless_tensor(
                inp=hidden_states, requires_grad=True, keep_graph=True
            )
        return hidden_states

    forward.__wrapped__ = original
    return forward


def make_patch(args):
    mode = getattr(args, "oases_schedule", "off")
    if mode == "off":
        return None
    validate_schedule_args(args)
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear

    return Patch(
        "oases-schedule",
        replacements=[
            (TransformerBlock, "forward", make_schedule_forward(TransformerBlock.forward, mode)),
            (tp_layers, "reduce_from_tensor_model_parallel_region",
             make_reduce_from_tp_region(tp_layers.reduce_from_tensor_model_parallel_region)),
            (ColumnParallelLinear, "forward", make_column_forward(ColumnParallelLinear.forward)),
        ],
    )
