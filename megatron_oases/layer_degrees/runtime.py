"""Wire a plan file into a model: groups, rebuilt layers, and the stage's degree runs."""

from dataclasses import dataclass

from ..compat import set_finalize_model_grads
from .groups import LayerDegreeGroups
from .model import apply_plan, sync_replica_grads

#: Where a built TransformerBlock carries its :class:`LayerDegrees` (read through :func:`stage_of`).
_STAGE_ATTR = "_oases_hetero"


@dataclass
class LayerDegrees:
    """What a TransformerBlock needs at run time: the groups and its layers' degrees."""

    groups: LayerDegreeGroups
    degrees: list  # one per layer of this stage

    def runs(self):
        """Consecutive layers of equal degree: [(degree, [layer indices])]."""
        out = []
        for i, d in enumerate(self.degrees):
            if out and out[-1][0] == d:
                out[-1][1].append(i)
            else:
                out.append((d, [i]))
        return out


def stage_of(decoder):
    """The :class:`LayerDegrees` that :func:`attach_plan` gave ``decoder``, or None (no plan)."""
    return getattr(decoder, _STAGE_ATTR, None)


def attach_plan(model, config):
    """Rebuild ``model``'s layers at the degrees of ``config.plan`` (an
    :class:`~megatron_oases.config.OasesConfig`'s, read and checked once), route the replica
    gradient sum through the model config's ``finalize_model_grads_func``."""
    degrees = config.plan["degrees"]
    groups = LayerDegreeGroups(config.tensor_model_parallel_size, degrees)
    stage = LayerDegrees(groups, apply_plan(model, degrees, groups))
    setattr(model.decoder, _STAGE_ATTR, stage)
    set_finalize_model_grads(model.config, finalize_with_replica_sync(groups))
    return stage


def finalize_with_replica_sync(groups):
    """Megatron's ``finalize_model_grads``, then the sum over the replicas of degree-d layers.

    Installed as the model config's ``finalize_model_grads_func``, which Megatron-LM's loop keeps
    when a model builder set it (it defaults it only when unset).
    """
    from megatron.core.distributed import finalize_model_grads

    def finalize(model, *args, **kwargs):
        out = finalize_model_grads(model, *args, **kwargs)
        for chunk in model:
            sync_replica_grads(chunk, groups)
        return out

    finalize.oases_replica_sync = True
    return finalize
