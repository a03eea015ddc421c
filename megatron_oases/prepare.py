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
    """Whether a built stage needs :func:`prepare_model` (a split schedule, a plan, or a swapped
    core attention)."""
    return config.patches_model or choose_core_attention(config.attention_backend) != STOCK


def prepare_model(model, config):
    """One built model stage (before DDP or FSDP wraps it), where the schedule joins this model
    instance (torchtitan's ``parallelize_llama(model, ...)`` style; other models in the process
    stay Megatron's): a per-layer plan's layers rebuilt at their degrees, the schedule bound to
    this stage (:func:`.schedule.megatron.binding.bind_schedule`: its forwards and its TP linears), then
    ``--attention-backend``'s core attention (after the plan, which rebuilds layers)."""
    if config.patches_model:
        from .schedule.megatron.binding import bind_schedule
        from .schedule.megatron.patch import installed

        degrees = None
        if config.plan is not None:
            from .layer_degrees.runtime import attach_plan

            degrees = attach_plan(model, config)
        patch = installed()
        bind_schedule(model, patch.layer_schedule, degrees, ends=patch.stage_ends)
    apply_core_attention(model, config)
    return model
