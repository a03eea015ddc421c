"""Wire a plan file into a model: groups, rebuilt layers, and the decoder's degree spans.

The plan joins one model instance, as torchtitan's ``parallelize_llama(model, ...)`` does:
:func:`megatron_oases.prepare.prepare_model` rebuilds its layers (:func:`attach_plan`) and binds
the schedule to *that* model with its :class:`LayerDegrees` as an argument
(:func:`megatron_oases.schedule.megatron.binding.bind_schedule`); other model instances in the process
stay Megatron's.
"""

import weakref
from dataclasses import dataclass

from ..compat import set_finalize_model_grads
from ..errors import OasesConfigError
from .groups import LayerDegreeGroups
from .model import apply_plan, sync_replica_grads


@dataclass
class LayerDegrees:
    """What a decoder's forward needs at run time: the groups and its layers' degrees."""

    groups: LayerDegreeGroups
    degrees: list  # one per layer of this stage

    def spans(self):
        """Consecutive layers of equal degree: [(degree, [layer indices])]."""
        out = []
        for i, d in enumerate(self.degrees):
            if out and out[-1][0] == d:
                out[-1][1].append(i)
            else:
                out.append((d, [i]))
        return out


class AttachedPlans:
    """decoder → the :class:`LayerDegrees` its plan gave it (:func:`attach_plan`), for one run's
    checkpoint hook (:mod:`.checkpoint`), which Megatron's ``save_checkpoint``/``load_checkpoint``
    hand the model chunks, not the plan (the forward gets the degrees as its argument). One per
    runtime (``patches.OasesRuntime.plans``); held weakly, as the decoders are Megatron's."""

    def __init__(self):
        self._degrees = weakref.WeakKeyDictionary()

    def attach(self, decoder, layer_degrees):
        self._degrees[decoder] = layer_degrees

    def of(self, decoder):
        """``decoder``'s :class:`LayerDegrees`, or None (no plan, or another run's model)."""
        return self._degrees.get(decoder) if decoder is not None else None


def attach_plan(model, config, plans):
    """Rebuild ``model``'s layers at the degrees of ``config.plan`` (an
    :class:`~megatron_oases.config.OasesConfig`'s, read and checked once) and route the replica
    gradient sum through the model config's ``finalize_model_grads_func``; returns the
    :class:`LayerDegrees` that ``prepare_model`` binds to the decoder's forward (recorded in
    ``plans``, the run's :class:`AttachedPlans`, for its checkpoint hook)."""
    from megatron.core.transformer.transformer_block import TransformerBlock

    if not isinstance(model.decoder, TransformerBlock):  # validation refuses it first
        raise OasesConfigError(
            "--oases-plan supports GPTModel only; drop it for a HybridModel (--hybrid-layer-pattern)"
        )
    degrees = config.plan["degrees"]
    groups = LayerDegreeGroups(config.tensor_model_parallel_size, degrees)
    layer_degrees = LayerDegrees(groups, apply_plan(model, degrees, groups))
    set_finalize_model_grads(model.config, finalize_with_replica_sync(groups))
    plans.attach(model.decoder, layer_degrees)
    return layer_degrees


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
