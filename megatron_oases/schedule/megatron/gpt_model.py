"""One ``GPTModel`` instance's forward with its stage's ends in the schedule.

:func:`megatron_oases.schedule.megatron.binding.bind_schedule` gives one model instance (only) the
forward and ``_postprocess`` below, each with the stage's
:class:`~megatron_oases.schedule.megatron.binding.StageSchedule` as its argument. A training call that
qualifies records its ends (:class:`StageCall`) on that object, where the same instance's bound
decoder forward takes them, then runs Megatron's own ``GPTModel.forward``; on the first stage it
gives Megatron a stand-in ``decoder_input`` (Megatron's argument for a precomputed embedding),
whose shape only Megatron reads (RoPE), and the schedule runs the embedding itself. Any other
call is Megatron's, untouched.
"""

import functools
import inspect

import torch

from ...validation import Schedule
from .stage_ends import EmbeddingEnd, OutputEnd


class StageCall:
    """One ``GPTModel.forward`` call's ends: the embedding the schedule runs instead of Megatron
    (with the stand-in given to Megatron as ``decoder_input``), and the loss the schedule
    computed."""

    def __init__(self, model, labels, runtime_gather_output, embedding=None, stand_in=None):
        self.model, self.labels, self.runtime_gather_output = model, labels, runtime_gather_output
        self.embedding, self.stand_in = embedding, stand_in  # until the schedule takes them
        self.loss = None  # the schedule's per-token loss, for _postprocess

    def take(self, block, hidden):
        """The ends the schedule of ``block`` runs for input ``hidden``: (embedding, output),
        each None when it stays stock."""
        embedding = None
        if self.embedding is not None:
            if hidden is not self.stand_in:
                raise RuntimeError(
                    "oases: the embedding's output was changed before the transformer layers "
                    "(Megatron's GPTModel changed?); run with --oases-schedule off and report it"
                )
            embedding, self.embedding, self.stand_in = self.embedding, None, None
        output = None
        if self.labels is not None and block is self.model.decoder and block.post_process:
            output = OutputEnd(
                self.model, block.final_layernorm, self.labels, self.runtime_gather_output
            )
        return embedding, output

    def resolve(self, hidden):
        """``hidden`` as real data for a block that runs stock code: the stand-in becomes the
        embedding computed as Megatron does."""
        if self.embedding is None or hidden is not self.stand_in:
            return hidden
        embedding, self.embedding, self.stand_in = self.embedding, None, None
        return embedding.stock()

    def check_taken(self):
        if self.embedding is not None:  # nothing took the embedding: a Megatron change
            raise RuntimeError(
                "oases: the embedding's output never reached the schedule (Megatron's GPTModel "
                "changed?); run with --oases-schedule off and report it"
            )


def qualifies(model, a):
    """Whether a ``GPTModel.forward`` call (bound arguments ``a``) runs its ends in the schedule:
    training, plain decoder-only language modelling without MTP or hooks."""
    from megatron.core.config_logger import has_config_logger_enabled
    from megatron.core.transformer.transformer_block import TransformerBlock

    config = model.config
    return (
        model.training
        and torch.is_grad_enabled()
        and isinstance(getattr(model, "decoder", None), TransformerBlock)
        and not getattr(model, "mtp_process", False)
        and not getattr(config, "mtp_num_layers", None)
        and not has_config_logger_enabled(config)
        and all(
            a.get(k) is None
            for k in (
                "decoder_input",
                "inference_context",
                "inference_params",
                "packed_seq_params",
                "output_processor",
            )
        )
        and not a.get("extra_block_kwargs")
    )


def _embedding_stand_in(module, input_ids):
    """What Megatron gets as ``decoder_input`` instead of the embedding's output: a tensor of its
    shape (Megatron reads only that, for RoPE) whose data is never read."""
    config = module.config
    dtype = torch.float32 if config.fp32_residual_connection else None
    dtype = dtype or module.word_embeddings.weight.dtype
    anchor = torch.zeros((), dtype=dtype, device=input_ids.device, requires_grad=True)
    b, s = input_ids.shape
    if config.sequence_parallel:  # Megatron's embedding scatters its output along s
        s //= module.word_embeddings.tp_group.size()
    return anchor.expand(s, b, config.hidden_size)


@functools.cache
def _signature():
    from megatron.core.models.gpt.gpt_model import GPTModel

    return inspect.signature(GPTModel.forward)


def model_forward(model, stage, *args, **kwargs):
    """``model``'s forward (bound to that instance with its ``stage``): a call that qualifies
    runs Megatron's ``GPTModel.forward`` with its :class:`StageCall` on ``stage`` and, on the
    first stage, the stand-in as ``decoder_input``; any other call is Megatron's."""
    from megatron.core.models.common.embeddings.language_model_embedding import (
        LanguageModelEmbedding,
    )
    from megatron.core.models.gpt.gpt_model import GPTModel

    bound = _signature().bind(model, *args, **kwargs)
    a = bound.arguments
    if stage.layer_schedule.schedule == Schedule.OFF or not qualifies(model, a):
        return GPTModel.forward(model, *args, **kwargs)
    labels = a.get("labels") if model.post_process else None
    call = StageCall(model, labels, a.get("runtime_gather_output"))
    module = getattr(model, "embedding", None)
    if (
        model.pre_process
        and module is not None
        and (
            not module.config.sequence_parallel
            or getattr(module, "scatter_to_sequence_parallel", True)
        )
    ):
        input_ids, position_ids = a["input_ids"], a["position_ids"]
        call.embedding = EmbeddingEnd(
            module, LanguageModelEmbedding.forward, input_ids, position_ids, stage.deferral
        )
        call.stand_in = a["decoder_input"] = _embedding_stand_in(module, input_ids)
    stage.call = call
    try:
        out = GPTModel.forward(*bound.args, **bound.kwargs)
    finally:
        stage.call = None
    call.check_taken()
    return out


def postprocess(model, stage, *args, **kwargs):
    """``model``'s ``_postprocess`` (bound with its ``stage``): the loss the schedule computed
    passes through."""
    from megatron.core.models.gpt.gpt_model import GPTModel

    call = stage.call
    if call is not None and call.loss is not None:
        return kwargs["hidden_states"]
    return GPTModel._postprocess(model, *args, **kwargs)


def check_megatron():
    """What the bound forwards rely on in Megatron's ``GPTModel`` (install time)."""
    from megatron.core import tensor_parallel
    from megatron.core.models.common.embeddings.language_model_embedding import (
        LanguageModelEmbedding,
    )
    from megatron.core.models.gpt.gpt_model import GPTModel

    from ...compat import require_call, require_symbol
    from .loss import check_megatron as check_cross_entropy

    require_symbol(GPTModel, "_postprocess", called_by=[GPTModel.forward])
    require_symbol(GPTModel, "_preprocess", called_by=[GPTModel.forward])
    require_symbol(GPTModel, "_postprocess", parameters=("hidden_states",))
    require_call(GPTModel.forward, "self._postprocess(")
    require_call(GPTModel._preprocess, "if decoder_input is not None:")
    require_call(GPTModel._preprocess, "self.embedding(")
    # what OutputEnd calls in place of _postprocess's output layer and loss
    for name in ("self.output_layer(", "self.compute_language_model_loss("):
        require_call(GPTModel._postprocess, name)
    if hasattr(GPTModel, "_scale_logits"):
        require_call(GPTModel._postprocess, "self._scale_logits(")
    check_cross_entropy()  # the loss's steps (.loss) are Megatron's cross-entropy
    require_symbol(LanguageModelEmbedding, "forward", parameters=("input_ids", "position_ids"))
    require_call(LanguageModelEmbedding.forward, "self.word_embeddings(input_ids)")
    # under SP the embedding's split, whose backward all-gather the schedule issues (.deferral)
    scatter = require_symbol(
        tensor_parallel,
        "scatter_to_sequence_parallel_region",
        called_by=[LanguageModelEmbedding.forward],
    )
    require_call(
        LanguageModelEmbedding.forward, "tensor_parallel.scatter_to_sequence_parallel_region("
    )
    return scatter
