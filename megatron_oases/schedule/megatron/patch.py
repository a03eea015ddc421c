"""The ``oases-schedule`` patch: what the schedule changes process-wide, in one list; and the
run's :class:`~.entry.LayerSchedule` (:func:`make_selection`), which the runtime hands to every
stage it prepares.

The schedule itself is applied per model instance (:func:`.binding.bind_schedule`, from
``prepare_model``): the decoders' and models' forwards and their TP linears. Process-wide, the patch
replaces, each checked at install time to be what Megatron calls
(:func:`megatron_oases.compat.require_symbol` / ``require_call``; a change of Megatron fails here,
not in a run), and restores on ``uninstall``:

- with the stage's ends in the programs (a split schedule without a plan):
  ``tensor_parallel.scatter_to_sequence_parallel_region`` → :mod:`.deferral`, where the embedding's
  backward is cut at its split under sequence parallelism (Megatron's embedding calls it through
  the module, beyond an instance's reach);
- a plan: checkpoint save/load, ``finalize_model_grads`` (before 0.19) and
  ``param_is_not_tensor_parallel_duplicate`` (with its copy in ``optimizer.clip_grads``) →
  :mod:`megatron_oases.layer_degrees`: checkpoints in the stock layout, the replica sync, grad-norm
  clipping counting each replica once.

Outside the engine everything runs stock code.
"""

from ...compat import finalize_model_grads_replacements
from ...layer_degrees.model import make_param_is_not_tp_duplicate
from ...patching import Patch
from ...validation import Schedule
from ..engine.deferral import make_scatter
from .binding import check_megatron as check_bound_forwards
from .entry import LayerSchedule
from .gpt_model import check_megatron as check_gpt_model
from .graphs import BlockGraphs

PATCH_NAME = "oases-schedule"


def make_selection(config, tracer=None):
    """The :class:`~.entry.LayerSchedule` every stage of the run reads at each call, for a checked
    :class:`~megatron_oases.config.OasesConfig` asking for a split schedule or a per-layer plan,
    else None. ``--oases-schedule auto`` starts on stock: its tuner selects each iteration's
    candidate on it. ``tracer``: ``oases-trace``'s, or None."""
    if not config.patches_model:
        return None
    auto = config.autotune is not None
    return LayerSchedule(
        schedule=Schedule.OFF if auto else config.schedule,
        parts=config.sub_batches,
        split=config.split,
        graphs=BlockGraphs(config.cuda_graphs) if config.cuda_graphs and not auto else None,
        tracer=tracer,
    )


def joins_stage_ends(config):
    """Whether the stages' ends join the programs (:mod:`.gpt_model`): a split schedule without a
    plan."""
    return config.overlapped and config.plan is None


def make_patch(config, plans=None):
    """``oases-schedule`` for a checked :class:`~megatron_oases.config.OasesConfig` asking for a
    split schedule or a per-layer plan, else None. ``plans``: the run's
    :class:`~megatron_oases.layer_degrees.runtime.AttachedPlans` (a plan's checkpoint hook reads
    each stage's degrees there)."""
    if not config.patches_model:
        return None
    from megatron.core import tensor_parallel
    from megatron.core.optimizer import clip_grads

    check_bound_forwards()
    replacements = []
    if joins_stage_ends(config):
        scatter = check_gpt_model()
        replacements.append(
            (tensor_parallel, "scatter_to_sequence_parallel_region", make_scatter(scatter))
        )
    if config.plan is not None:  # checkpoints of a plan are written in the stock layout
        from ...layer_degrees.checkpoint import make_checkpoint_replacements

        replacements += make_checkpoint_replacements(plans)
        replacements += finalize_model_grads_replacements()  # the replica sync, before 0.19
        # grad-norm clipping counts each replica of a degree-d shard once
        for owner in (tensor_parallel, clip_grads):
            replacements.append(
                (
                    owner,
                    "param_is_not_tensor_parallel_duplicate",
                    make_param_is_not_tp_duplicate(owner.param_is_not_tensor_parallel_duplicate),
                )
            )
    return Patch(PATCH_NAME, replacements=replacements)
