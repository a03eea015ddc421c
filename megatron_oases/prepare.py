"""The one door both entry points (``oases-pretrain-gpt`` and Megatron-LM's patched
``pretrain_gpt.py``) go through, with the :class:`~.config.OasesConfig` parsed once: install the
patches before the first model is built, then prepare each built stage."""

from .attention import STOCK, apply_core_attention, choose_core_attention
from .patches import install_patches


def install(config):
    """The patches ``config`` asks for: after parsing and distributed initialisation, before any
    model is built. Idempotent."""
    return install_patches(config)


def changes_model(config):
    """Whether a built stage needs :func:`prepare_model` (a plan, or a swapped core attention)."""
    return config.plan is not None or choose_core_attention(config.attention_backend) != STOCK


def prepare_model(model, config):
    """One built model stage, where the plan joins this model instance (torchtitan's
    ``parallelize_llama(model, ...)`` style): the per-layer plan's layers rebuilt at their degrees
    and the degrees bound to *this* decoder's forward (other models in the process keep the
    class's), then ``--attention-backend``'s core attention (after the plan, which rebuilds
    layers)."""
    if config.plan is not None:
        from .layer_degrees.runtime import attach_plan, bind_block_forward

        bind_block_forward(model.decoder, attach_plan(model, config))
    apply_core_attention(model, config)
    return model
