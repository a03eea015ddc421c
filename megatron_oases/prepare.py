"""The one door both entry points (``oases-pretrain-gpt`` and Megatron-LM's patched
``pretrain_gpt.py``) go through, with the :class:`~.config.OasesConfig` parsed once: install the
run's runtime before the first model is built, then prepare each built stage with it."""

from .attention import STOCK, apply_core_attention, choose_core_attention
from .patches import install as install_runtime


def install(config):
    """The run's :class:`~.patches.runtime.OasesRuntime`, its patches installed: after parsing
    and distributed initialisation, before any model is built. Once per run (an entry point
    that builds several stages keeps the runtime: :class:`RuntimeOnce`)."""
    return install_runtime(config)


class RuntimeOnce:
    """The run's runtime, installed on first use: Megatron calls the model provider once per
    stage, after distributed initialisation, and every stage must share one runtime."""

    def __init__(self, config):
        self.config, self._runtime = config, None

    def get(self):
        if self._runtime is None:
            self._runtime = install(self.config)
        return self._runtime


def changes_model(config):
    """Whether a built stage needs :func:`prepare_model` (a split schedule, a plan, or a swapped
    core attention)."""
    return config.patches_model or choose_core_attention(config.attention_backend) != STOCK


def prepare_model(model, runtime):
    """One built model stage (before DDP or FSDP wraps it), where the schedule joins this model
    instance (torchtitan's ``parallelize_llama(model, ...)`` style; other models in the process
    stay Megatron's), with the run's ``runtime`` (:func:`install`): a per-layer plan's layers
    rebuilt at their degrees, the schedule bound to this stage
    (:func:`.schedule.megatron.binding.bind_schedule`: its forwards and its TP linears, with the
    runtime's schedule selection), then ``--attention-backend``'s core attention (after the plan,
    which rebuilds layers). Once per stage: preparing it again is refused."""
    config = runtime.config
    if model in runtime.prepared:
        raise RuntimeError(
            f"megatron-oases: this {type(model).__name__} was prepared already; prepare each "
            "built stage once"
        )
    if config.patches_model:
        from .schedule.megatron.binding import bind_schedule

        degrees = None
        if config.plan is not None:
            from .layer_degrees.runtime import attach_plan

            degrees = attach_plan(model, config, runtime.plans)
        bind_schedule(model, runtime.selection, degrees, ends=runtime.stage_ends)
    apply_core_attention(model, config)
    runtime.prepared.add(model)
    return model
