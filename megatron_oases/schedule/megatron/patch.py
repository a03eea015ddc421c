"""The ``oases-schedule`` patch: what the schedule changes process-wide, in one list, and the
:class:`~.engine.LayerSchedule` the stages it is applied to share.

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
from ...patching import REGISTRY, Patch
from ...validation import Schedule
from ..engine.deferral import make_scatter
from .binding import check_megatron as check_bound_forwards
from .entry import LayerSchedule
from .gpt_model import check_megatron as check_gpt_model
from .graphs import BlockGraphs

PATCH_NAME = "oases-schedule"


def make_patch(config, built=None):
    """``oases-schedule`` for a checked :class:`~megatron_oases.config.OasesConfig` asking for a
    split schedule or a per-layer plan, else None. ``built``: the patches built before this one
    (by name); the tracer of ``oases-trace``."""
    if not config.patches_model:
        return None
    plan = config.plan is not None
    trace = (built or {}).get("oases-trace")
    from megatron.core import tensor_parallel
    from megatron.core.optimizer import clip_grads

    # ``--oases-schedule auto`` starts on stock; its tuner selects each iteration's candidate
    auto = config.autotune is not None
    layer_schedule = LayerSchedule(
        schedule=Schedule.OFF if auto else config.schedule,
        parts=config.sub_batches,
        split=config.split,
        graphs=BlockGraphs(config.cuda_graphs) if config.cuda_graphs and not auto else None,
        tracer=trace.tracer if trace is not None else None,
    )
    check_bound_forwards()
    replacements = []
    ends = config.overlapped and not plan  # the stage's ends join the programs (.gpt_model)
    if ends:
        scatter = check_gpt_model()
        replacements.append(
            (tensor_parallel, "scatter_to_sequence_parallel_region", make_scatter(scatter))
        )
    if plan:  # checkpoints of a plan are written in the stock layout
        from ...layer_degrees.checkpoint import make_checkpoint_replacements

        replacements += make_checkpoint_replacements()
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
    patch = Patch(PATCH_NAME, replacements=replacements)
    patch.layer_schedule = layer_schedule  # what ``auto``'s tuner selects on (.tuning.runtime)
    patch.stage_ends = ends  # what bind_schedule wires into each GPT stage
    return patch


def installed():
    """The installed ``oases-schedule`` patch (its ``layer_schedule`` and ``stage_ends``)."""
    patch = REGISTRY.get(PATCH_NAME)
    if patch is None:
        raise RuntimeError(
            "megatron-oases: a split schedule or a per-layer plan needs the oases-schedule patch "
            "installed before the model is built (megatron_oases.prepare.install(config), then "
            "prepare_model)"
        )
    return patch
