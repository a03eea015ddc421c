"""The entry the bound forwards (:mod:`.binding`) call: a stage's layers under the process's
:class:`LayerSchedule`, run by the engine (``schedule/engine/``) on Megatron's blocks
(:mod:`.blocks`), split (:mod:`.split`), RNG states (:mod:`.rng`) and, under Megatron-FSDP, its
per-layer gathers and gradient hand-over (:mod:`.fsdp_params`)."""

import dataclasses

from ...validation import SUB_BATCHES, Schedule
from ..engine.node import ScheduledLayers, run_scheduled
from . import rng
from .blocks import LayerBlocks
from .fsdp_params import stage_params
from .split import make_split


def recomputed_layers(config, indices):
    """How many of a span of a stage's layers (``indices``: their positions in the stage,
    ascending) Megatron's full recomputation checkpoints (``config``: its TransformerConfig): all
    of them under ``--recompute-method uniform`` (one layer per checkpoint, see
    :mod:`megatron_oases.validation`), those among the stage's first ``--recompute-num-layers``
    under ``block`` (always a leading part of the span), none without full recomputation."""
    if config.recompute_granularity != "full":
        return 0
    if config.recompute_method == "block":
        return sum(1 for i in indices if i < config.recompute_num_layers)
    return len(indices)


@dataclasses.dataclass
class LayerSchedule:
    """How the bound forwards (:mod:`.binding`) run a stage's layers, read at each call:
    ``schedule`` (``--oases-schedule``, the config's :class:`~megatron_oases.config.Schedule`,
    checked once when parsed; ``off``: stock Megatron, or a plan's degree spans in Megatron's own
    loop), ``parts`` sub-batches cut as ``split``, ``graphs`` (``--oases-cuda-graphs``'
    :class:`.graphs.BlockGraphs`) and ``tracer`` (``oases-trace``'s), or None. Fixed at install,
    except under ``--oases-schedule auto``, whose tuner (:mod:`megatron_oases.tuning.runtime`)
    :meth:`select`\\ s each iteration's candidate between iterations, never inside one (a
    micro-batch's backward uses what its forward captured)."""

    schedule: Schedule
    parts: int = SUB_BATCHES
    split: str = "batch"
    graphs: object = None
    tracer: object = None

    def select(self, schedule, parts=SUB_BATCHES, graphs=None):
        """The schedule the next iteration runs (``auto``'s candidate)."""
        self.schedule, self.parts, self.graphs = Schedule(schedule), parts, graphs

    def next_microbatch(self):
        """The next micro-batch's number in the trace (-1 untraced: only the trace reads it)."""
        return self.tracer.next_microbatch() if self.tracer is not None else -1


def schedule_layers(
    stage,
    layers,
    hidden,
    config,
    *,
    indices=None,
    attention_mask=None,
    rotary_pos_emb=None,
    attention_bias=None,
    microbatch=-1,
    embedding=None,
    output=None,
):
    """A stage's ``layers`` (``indices``: their positions in the stage, default all of them) on
    ``hidden`` under ``stage`` (a :class:`~.binding.StageSchedule`: its :class:`LayerSchedule`
    and the deferral its linears hold): one autograd node, the one entry of the bound forwards.
    ``config``: Megatron's TransformerConfig, whose full recompute decides what forward keeps.
    ``embedding`` / ``output``: the stage ends (:mod:`.stage_ends`) or None."""
    indices = range(len(layers)) if indices is None else indices
    layer_schedule, deferral = stage.layer_schedule, stage.deferral
    kind, parts = layer_schedule.split, layer_schedule.parts
    scheduled = ScheduledLayers(
        LayerBlocks(
            layers, attention_mask, rotary_pos_emb, attention_bias, layer_schedule.graphs, deferral
        ),
        layer_schedule.schedule,
        split=lambda h: make_split(kind, h, parts),
        rng=rng.STATES,
        recomputed_layers=recomputed_layers(config, indices),
        microbatch=microbatch,
        tracer=layer_schedule.tracer,
        embedding=embedding,
        output=output,
        deferral=deferral,
        sharded=stage_params(layers, embedding, output),
    )
    return run_scheduled(scheduled, hidden)
