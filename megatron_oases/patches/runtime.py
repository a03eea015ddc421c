"""One run's Oases runtime: what ``install(config)`` made and every stage and patch of the run
shares, handed to ``prepare_model(model, runtime)`` as an argument (torchtitan's
``parallelize_llama(model, ...)`` style), never looked up in a registry."""

import weakref
from dataclasses import dataclass, field
from typing import Optional


@dataclass(frozen=True)
class OasesRuntime:
    """Made once per run by :func:`megatron_oases.patches.install` (or ``make_runtime``); frozen.

    - ``config``: the checked :class:`~megatron_oases.config.OasesConfig`;
    - ``selection``: the run's :class:`~megatron_oases.schedule.megatron.entry.LayerSchedule`
      (a split schedule or a plan; else None), the one mutable hand-off: ``auto``'s tuner selects
      each iteration's :class:`~megatron_oases.validation.Schedule` on it between iterations;
    - ``stage_ends``: the GPT stages' embedding and output layer join the programs;
    - ``plans``: a plan's :class:`~megatron_oases.layer_degrees.runtime.AttachedPlans` (each
      prepared stage's degrees, for the checkpoint hook), or None;
    - ``tracer`` (``--oases-trace``), ``recorder`` (``--log-json``), ``tuner``
      (``--oases-schedule auto``), each or None;
    - ``patches``: the run's patches, in the catalogue's order.
    """

    config: object
    selection: Optional[object] = None
    stage_ends: bool = False
    plans: Optional[object] = None
    tracer: Optional[object] = None
    recorder: Optional[object] = None
    tuner: Optional[object] = None
    patches: tuple = ()
    #: the model stages this runtime prepared (``prepare_model``'s once-guard)
    prepared: weakref.WeakSet = field(default_factory=weakref.WeakSet, repr=False, compare=False)

    def patch(self, name):
        """The run's patch called ``name``, or None."""
        return next((p for p in self.patches if p.name == name), None)
