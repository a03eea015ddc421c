"""The schedule applied to one model instance, from outside (torchtitan's ``parallelize_llama``
style): :func:`bind_schedule`, called by :func:`megatron_oases.prepare.prepare_model` for each
built stage.

For that instance only it

- re-classes the TP linears of the decoder's layers (and, where the stage's ends join the
  programs, the embedding's lookup and the output layer) into deferring ones holding the stage's
  :class:`.deferral.Deferral` (:mod:`.linears`);
- gives the decoder (``TransformerBlock`` or ``HybridStack``) and, with the stage's ends, the
  ``GPTModel`` itself a forward bound to the stage's :class:`StageSchedule`
  (:mod:`.transformer_block`, :mod:`.hybrid_stack`, :mod:`.gpt_model`);
- under ``--use-megatron-fsdp``, marks the parameters the programs run for the engine's
  once-per-layer gradient hand-over (:func:`.fsdp_params.mark`), which Megatron-FSDP reads when
  it wraps the stage.

``model.forward`` on the instance then names the code that runs; another model in the process
(an evaluation copy, inference) stays Megatron's.
"""

import dataclasses
import functools

from ..engine.deferral import Deferral
from .entry import LayerSchedule


@dataclasses.dataclass(eq=False)
class StageSchedule:
    """One model stage's schedule, the argument of its bound forwards: the process's
    :class:`.engine.LayerSchedule` (what ``auto``'s tuner selects on), the stage's
    :class:`.deferral.Deferral`, a plan's :class:`~megatron_oases.layer_degrees.runtime.LayerDegrees`
    (or None), and the ends of the model's call in progress (:class:`.gpt_model.StageCall`, set
    by the bound ``GPTModel`` forward for the duration of Megatron's forward)."""

    layer_schedule: LayerSchedule
    deferral: Deferral = dataclasses.field(default_factory=Deferral)
    degrees: object = None
    call: object = None


def bind_schedule(model, layer_schedule, degrees=None, ends=False):
    """Apply ``layer_schedule`` to ``model`` (one built stage, before DDP/FSDP wrap it): see the
    module docstring. ``degrees``: a plan's, bound to the decoder's forward; ``ends``: the
    embedding and the output layer + loss join the programs (a uniform-degree GPT stage).
    Returns the stage's :class:`StageSchedule`."""
    from megatron.core.transformer.transformer_block import TransformerBlock

    from .fsdp_params import mark, megatron_fsdp_requested
    from .gpt_model import model_forward, postprocess
    from .hybrid_stack import stack_forward
    from .linears import defer_linears
    from .transformer_block import block_forward

    stage = StageSchedule(layer_schedule, degrees=degrees)
    decoder = model.decoder
    if isinstance(decoder, TransformerBlock):
        forward = block_forward
    else:
        from megatron.core.models.hybrid.hybrid_block import HybridStack

        if not isinstance(decoder, HybridStack):
            raise RuntimeError(
                f"oases: cannot schedule a {type(decoder).__name__} decoder; use --oases-schedule off"
            )
        forward, ends = stack_forward, False  # a HybridModel's ends stay Megatron's
    deferred = [decoder]
    ends = ends and isinstance(decoder, TransformerBlock)
    if ends:
        if getattr(model, "pre_process", False) and getattr(model, "embedding", None) is not None:
            deferred.append(model.embedding.word_embeddings)
        if getattr(model, "post_process", False) and getattr(model, "output_layer", None):
            deferred.append(model.output_layer)
    defer_linears(deferred, stage.deferral)
    if megatron_fsdp_requested():
        mark(_run_by_programs(model, decoder, ends))
    decoder.forward = functools.partial(forward, decoder, stage)
    if ends:
        model.forward = functools.partial(model_forward, model, stage)
        model._postprocess = functools.partial(postprocess, model, stage)
    return stage


def _run_by_programs(model, decoder, ends):
    """The modules whose parameters the programs run: the decoder's layers and, where the stage's
    ends join the programs, the embedding, the final norm and the output layer."""
    modules = list(decoder.layers)
    if ends and getattr(model, "pre_process", False):
        modules.append(getattr(model, "embedding", None))
    if ends and getattr(model, "post_process", False):
        modules += [getattr(decoder, "final_layernorm", None), getattr(model, "output_layer", None)]
    return [m for m in modules if m is not None]


def check_megatron():
    """What the bound forwards replace is the loop Megatron calls (install time)."""
    from megatron.core.models.hybrid.hybrid_block import HybridStack
    from megatron.core.transformer.transformer_block import TransformerBlock

    from ...compat import require_call, require_symbol
    from .linears import check_megatron as check_linears

    require_symbol(
        TransformerBlock, "forward", parameters=("hidden_states", "attention_mask", "padding_mask")
    )
    require_symbol(
        HybridStack, "forward", parameters=("hidden_states", "attention_mask", "rotary_pos_emb")
    )
    require_call(HybridStack.forward, "for layer in self.layers:")
    require_call(HybridStack.forward, "self.final_norm(hidden_states)")
    check_linears()
