"""A ``HybridModel`` stage's ``HybridStack`` forward under the schedule, bound to one instance by
:func:`megatron_oases.schedule.megatron.binding.bind_schedule`.

Each ``*`` (attention) or ``-`` (MLP) layer of ``--hybrid-layer-pattern`` is one block of
:mod:`.blocks`, so a ``*-*-`` stack is scheduled exactly as the GPT layers it migrates from.
What stays stock: evaluation and inference, the PP input tensor, the final norm, and the stage's
ends (the embedding and the output layer + loss run outside the programs: their overlap is wired
into ``GPTModel`` only, :mod:`.stage_ends`). Unlike ``TransformerBlock``, ``HybridStack`` runs its
layers outside the model-parallel RNG fork under sequence parallelism, and so does this.
"""

import torch
from megatron.core.utils import make_viewless_tensor

from ...errors import OasesConfigError
from ...validation import Schedule
from .entry import schedule_layers


def stack_forward(
    self,
    stage,
    hidden_states,
    attention_mask,
    inference_context=None,
    rotary_pos_emb=None,
    *,
    inference_params=None,
    packed_seq_params=None,
    padding_mask=None,
):
    """This ``HybridStack``'s forward (bound to the instance with its ``stage``, a
    :class:`~megatron_oases.schedule.megatron.binding.StageSchedule`): its layers under the stage's
    :class:`.engine.LayerSchedule`. No per-layer plan reaches it: ``prepare_model`` refuses one
    for a ``HybridModel``."""
    from megatron.core.models.hybrid.hybrid_block import HybridStack

    stock = (
        stage.layer_schedule.schedule == Schedule.OFF
    )  # ``--oases-schedule auto`` selecting stock
    if not (self.training and torch.is_grad_enabled()) or len(self.layers) == 0 or stock:
        return HybridStack.forward(
            self,
            hidden_states,
            attention_mask,
            inference_context,
            rotary_pos_emb,
            inference_params=inference_params,
            packed_seq_params=packed_seq_params,
            padding_mask=padding_mask,
        )
    if packed_seq_params is not None or inference_context or inference_params:
        raise OasesConfigError(
            "--oases-schedule supports HybridModel training without packed sequences; "
            "use --oases-schedule off"
        )
    if not self.pre_process:
        hidden_states = self.input_tensor
    if hasattr(hidden_states, "unwrap"):  # a WrappedTensor (Megatron's inference path)
        hidden_states = hidden_states.unwrap()
    hidden_states = make_viewless_tensor(inp=hidden_states, requires_grad=True, keep_graph=True)
    hidden_states = schedule_layers(
        stage,
        self.layers,
        hidden_states,
        self.config,
        attention_mask=attention_mask,
        rotary_pos_emb=rotary_pos_emb,
        microbatch=stage.layer_schedule.next_microbatch(),
    )
    if self.post_process and self.post_layer_norm:
        hidden_states = self.final_norm(hidden_states)
    return make_viewless_tensor(inp=hidden_states, requires_grad=True, keep_graph=True)
