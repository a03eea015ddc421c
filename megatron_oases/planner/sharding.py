"""Sharded data parallelism in the planner: what each strategy shards over the data-parallel
replicas, what it gathers, what its collectives cost and how much of them compute hides. The one
place these rules live; :mod:`.memory_model` and :mod:`.build` call it.

The strategies (plan files name them, :data:`~megatron_oases.formats.plan.DATA_PARALLEL_SHARDINGS`),
their bytes per parameter per rank and their collectives on the data-parallel link:

- none (DDP): ``wg + opt``; ``--use-distributed-optimizer`` (ZeRO-1): ``wg + opt/R``; their
  gradient sync is :mod:`.build`'s (not here).
- ``megatron_fsdp/optim``: ``2p + opt/R``; per iteration, exposed: the gradients' reduce-scatter
  and the parameters' all-gather.
- ``megatron_fsdp/optim_grads``: ``p + (p + opt)/R``; per micro-batch, exposed: the whole
  gradient's reduce-scatter once the backward ends (megatron-core 0.19 makes per-layer buckets only
  under ``optim_grads_params``: ``FullyShardedDataParallel`` gives the other strategies no FSDP
  unit modules, so the stage's gradients are one bucket, ready at the backward's end; measured on
  the emulated grid, one reduce-scatter of the whole gradient a micro-batch); per iteration,
  exposed: the parameters' all-gather.
- ``megatron_fsdp/optim_grads_params``: ``(2p + opt)/R``; per micro-batch: the parameters'
  all-gather in forward and again in backward, prefetched (below), and the gradients'
  reduce-scatter as above; per iteration, exposed: the parameters' all-gather after the step,
  as under ``optim`` (``start_param_sync`` gathers every bucket, waits for it and, the weights
  being sharded, releases it: the forward gathers again).
- ``torch_fsdp2``: ``(2p + opt + 4)/R`` (bf16); its collectives as ``optim_grads_params``'.

``p``: the model's bytes per element (bf16: 2), ``opt``: the optimizer's per parameter (the
profile's: bf16 12 = fp32 master + two Adam moments), ``R``: the layer's data-parallel replicas
(``D·T/d``; every sharded layer runs at ``d = T``, so ``D``). Megatron-FSDP keeps its main
gradients and reduces them in the model's dtype by default (``--megatron-fsdp-main-grads-dtype
auto``, ``--megatron-fsdp-grad-comm-dtype auto``); FSDP2 under Megatron holds bf16 gradients and
Megatron's float16 optimizer makes an fp32 copy of them at its step (the ``+ 4``, counted as state:
safe). Megatron-FSDP ``optim``/``optim_grads`` gather the updated parameters synchronously after
the step (``--overlap-param-gather`` is off by default) and ``optim`` reduce-scatters at the last
micro-batch synchronously (``--overlap-grad-reduce`` off), so those are exposed once per
iteration, as the DDP and ZeRO-1 syncs are; sharded gradients and parameters force the
per-micro-batch collectives into hooks that Megatron-FSDP and FSDP2 prefetch and overlap.

**Megatron-FSDP's prefetch window** (stock ``optim_grads_params``): a pass's gather at a unit
extends over the next units until the extra elements reach ``suggested_AG_prefetch_size``, half of
``max(10⁹, 2·P)`` (megatron-core 0.19, ``megatron_fsdp.py``; ``all_gather_params``), and a data-
parallel group's gathers of one call are one coalesced collective (one NCCL group on a GPU). So
each pass (forward, backward) starts with one gather of ``n = min(L, 1 + ⌈max(5·10⁸, P)/P⌉)``
layers, waited whole before its first layer runs, and from there each layer gathers the one
``n − 1`` ahead (:func:`prefetch_layers`). At a 7B layer (``P`` ≈ 2·10⁸ at TP1) ``n`` is 4; at the
verify grid's 3·10⁶ it is the whole stage (its trace: 2.4 s, 8 layers' gathers, before the first
layer's backward). FSDP2 and the split schedules' engine gather one layer, the next behind it
(``n = 1``).

**The gathered units.** Stock (``off``): ZeRO-3 holds two layers' gathered parameters (the one
running and the one prefetched; Megatron-FSDP: ``max(2, n)``, the running one and ``n − 1``
ahead) and two layers' unsharded gradients (the one being computed and the one being
reduce-scattered): ``4·P·p`` on top of the layer's working set; ZeRO-2
(Megatron-FSDP ``optim_grads``, one bucket) the whole stage's unsharded gradients until the
backward ends (``P·p`` a layer, over the stage; inferred from the bucketing, not measured). The
embedding and output layer (the root module under FSDP2, gathered for the whole pass) with their
unsharded gradients: ``2·F·p`` (ZeRO-3), ``F·p`` (ZeRO-2).

**Under the split schedules** (``overlap``, ``cross-pass``, ``oases``; ``schedule/engine/fsdp.py``)
the engine gathers one layer at a time, one layer ahead, hands each layer's gradients over once
after the last sub-batch's backward of it (Megatron-FSDP's delayed weight-gradient entry; FSDP2's
per-layer post-backward) and releases it: the stock rhythm and hiding, with a third layer's
parameters held at a layer boundary (``5·P·p`` under ZeRO-3).

**Hiding.** Each pass is walked layer by layer on one data-parallel link, collectives in issue
order (:func:`_pass_waits`): the first gather (``n`` layers, one collective) waits; a layer's own
gather, issued when the layer ``n − 1`` before it (FSDP2: one before) starts, hides behind the
passes between (their compute and exposed TP communication; the contention of DP and TP traffic
on a shared PCIe bus is not modelled); in backward each layer's reduce-scatter is issued when it
ends and queues on the link with the gathers, and the last one is waited. With ``n = 1`` and
collectives of ``c`` against passes of ``t``, ``L`` gathers cost ``c + (L − 1)·max(0, c − t)``.
The embedding's and output layer's gathers run before the first layer and their reduce-scatters
after the last: exposed. Collectives cost the
profile's data-parallel ring fit (``grad_sync.reduce_scatter``: a ring all-gather moves what a
reduce-scatter does) on ``R`` ranks. The host's extra calls: :func:`.host_model.sharding_calls`.

What the search tries (:func:`strategies_for`): every strategy where DP > 1, stock and under the
split schedules; FSDP2 without pipeline parallelism and only for a model with untied embedding and
output weights (Megatron's rules; untying would train another model); Megatron-FSDP with pipeline
parallelism too (the ``megatron-fsdp-pipeline`` patch).
"""

import math
from dataclasses import dataclass

import numpy as np

from ..errors import OasesConfigError
from ..formats.plan import DATA_PARALLEL_SHARDINGS
from ..validation import SPLIT_SCHEDULES


@dataclass(frozen=True)
class Strategy:
    """One sharding strategy: what it shards (``optim``, ``grads``, ``params``), its Megatron
    flags, and where it runs."""

    name: str
    label: str  # as messages name it
    short: str  # as the search's table names it
    shards: tuple
    flags: str
    split_schedules: bool  # runs under overlap / cross-pass / oases
    pipeline: bool  # runs with PP > 1 (Megatron allows it and this megatron-core runs it)
    untied_only: bool  # needs --untie-embeddings-and-output-weights
    step_grad_copy: bool  # the float16 optimizer's fp32 copy of the gradients at its step

    @property
    def zero3(self):
        return "params" in self.shards

    @property
    def zero2(self):
        return "grads" in self.shards


def _megatron_fsdp(strategy, shards):
    return Strategy(
        name=f"megatron_fsdp/{strategy}",
        label=f"Megatron-FSDP {strategy}",
        short="mfsdp-" + "".join(part[0] for part in strategy.split("_")),
        shards=shards,
        flags=f"--use-megatron-fsdp --data-parallel-sharding-strategy {strategy} "
        "--ckpt-format fsdp_dtensor",
        split_schedules=True,
        # with pipeline stages through the megatron-fsdp-pipeline patch
        # (platform/megatron_fsdp_pipeline.py), which fixes what fails there in megatron-core 0.19
        pipeline=True,
        untied_only=False,
        step_grad_copy=False,
    )


#: Every strategy, by the name a plan file records.
STRATEGIES = {
    s.name: s
    for s in (
        Strategy(
            name="torch_fsdp2",
            label="torch FSDP2",
            short="fsdp2",
            shards=("optim", "grads", "params"),
            flags="--use-torch-fsdp2 --untie-embeddings-and-output-weights",
            split_schedules=True,
            pipeline=False,
            untied_only=True,
            step_grad_copy=True,
        ),
        _megatron_fsdp("optim", ("optim",)),
        _megatron_fsdp("optim_grads", ("optim", "grads")),
        _megatron_fsdp("optim_grads_params", ("optim", "grads", "params")),
    )
}
assert tuple(STRATEGIES) == DATA_PARALLEL_SHARDINGS  # the plan format's names: one list


def strategy(name, source="--data-parallel-sharding"):
    """The :class:`Strategy` called ``name`` (one line naming the choices otherwise)."""
    if name not in STRATEGIES:
        raise OasesConfigError(
            f"{source}: unknown sharding {name!r}; choose one of {', '.join(STRATEGIES)}"
        )
    return STRATEGIES[name]


def launch_flags(name):
    """Megatron's flags for sharding ``name`` ('' for None)."""
    return STRATEGIES[name].flags if name else ""


def label(name):
    """``"torch FSDP2"``, ``"Megatron-FSDP optim_grads"`` ('' for None)."""
    return STRATEGIES[name].label if name else ""


def strategies_for(dp, pp, untied, schedule="off"):
    """The strategies a layout of ``dp`` replicas and ``pp`` stages can run ``schedule`` with,
    for a model whose embedding and output weights are ``untied``."""
    if dp < 2:
        return ()
    out = []
    for s in STRATEGIES.values():
        if schedule in SPLIT_SCHEDULES and not s.split_schedules:
            continue
        if (pp > 1 and not s.pipeline) or (s.untied_only and not untied):
            continue
        out.append(s.name)
    return tuple(out)


def check_sharding(settings):
    """The checks that need no profile (:class:`~.settings.PlanSettings`, one line each)."""
    s = strategy(settings.data_parallel_sharding, settings.source("data_parallel_sharding"))
    if settings.distributed_optimizer:
        raise OasesConfigError(
            f"{s.label} shards the optimizer state itself (FSDP2 refuses "
            "--use-distributed-optimizer; Megatron-FSDP sets it); drop --distributed-optimizer"
        )
    if settings.schedule in SPLIT_SCHEDULES and not s.split_schedules:
        raise OasesConfigError(
            f"--schedule {settings.schedule} does not run under {s.label} (the runtime refuses "
            "it); use another --data-parallel-sharding, or --schedule off"
        )


def check_profile(name, profile, pp):
    """The checks against the layout and model of ``profile`` (``pp`` stages)."""
    s = STRATEGIES[name]
    if profile.dp < 2:
        raise OasesConfigError(
            f"{s.label} shards over data-parallel replicas and this profile has data-parallel "
            f"size {profile.dp}; drop --data-parallel-sharding or profile with DP > 1"
        )
    if pp > 1 and not s.pipeline:
        raise OasesConfigError(
            f"{s.label} does not run with pipeline parallelism (the runtime refuses it); use one "
            "pipeline stage, or no sharding"
        )
    if s.untied_only and not profile.shape.get("untie_embeddings_and_output_weights"):
        raise OasesConfigError(
            f"{s.label} needs --untie-embeddings-and-output-weights and this model ties them "
            "(untying trains another model); use a Megatron-FSDP strategy"
        )
    fits = (profile.data.get("grad_sync") or {}).get("reduce_scatter") or {}
    if str(profile.tp) not in fits:
        raise OasesConfigError(
            "this profile has no data-parallel collective timings (measured profiles lack them); "
            "use an --analytic profile to plan sharded data parallelism"
        )


# ---------------------------------------------------------------------------------- memory
def bytes_per_param(name, wg, opt, dtype_bytes, replicas):
    """Parameters, gradients and optimizer state per parameter per rank (module table)."""
    s, p = STRATEGIES[name], dtype_bytes
    sharded = opt + (4 if s.step_grad_copy and p == 2 else 0)
    unsharded = 0.0
    for part in ("params", "grads"):
        if part in s.shards:
            sharded += p
        else:
            unsharded += p
    return unsharded + sharded / replicas


#: Megatron-FSDP's smallest all-gather prefetch, in elements (module docstring): half of its
#: suggested communication unit, at least 10⁹ elements (megatron-core 0.19, ``megatron_fsdp.py``).
MEGATRON_FSDP_MIN_PREFETCH_ELEMENTS = 500_000_000


def prefetch_layers(name, params, layers, schedule):
    """``n``: the layers a pass's first gather brings in as one collective, the running one and
    those prefetched with it (module docstring); later layers are gathered ``max(1, n − 1)``
    ahead. 1 but for stock Megatron-FSDP ZeRO-3 (the engine gathers one layer at a time)."""
    s = STRATEGIES[name]
    if not (s.zero3 and name.startswith("megatron_fsdp/")) or schedule in SPLIT_SCHEDULES:
        return 1
    window = max(MEGATRON_FSDP_MIN_PREFETCH_ELEMENTS, params)
    return int(min(layers, 1 + math.ceil(window / max(params, 1))))


def gathered_layer_bytes(name, params, dtype_bytes, schedule, layers):
    """``(additive, runtime)`` bytes of one layer's gathered units beyond its shard: what the
    layers being computed, prefetched and reduced hold (the max over layers; nothing additive over
    the stage; ``layers``: the stage's), under the split schedules with a third layer's parameters
    at a layer boundary (the engine releases a layer once every sub-batch is past it)."""
    s, unit = STRATEGIES[name], params * dtype_bytes
    split = schedule in SPLIT_SCHEDULES
    if s.zero3:
        if split:
            return 0.0, 5 * unit
        return 0.0, (max(2, prefetch_layers(name, params, layers, schedule)) + 2) * unit
    if s.zero2:  # one bucket: every layer's unsharded gradient until the backward ends
        return unit, 0.0
    return 0.0, 0.0


def gathered_fixed_bytes(name, fixed_params, dtype_bytes):
    """The embedding's and output layer's gathered parameters and unsharded gradients."""
    s, unit = STRATEGIES[name], fixed_params * dtype_bytes
    return 2 * unit if s.zero3 else unit if s.zero2 else 0.0


# ------------------------------------------------------------------------------------ time
def collective_time(profile, degree, nbytes):
    """One all-gather (of ``nbytes`` gathered) or reduce-scatter (of ``nbytes`` in) over a
    degree-``degree`` layer's data-parallel replicas: the profile's ring fit."""
    fit = profile.data["grad_sync"]["reduce_scatter"][str(degree)]
    if nbytes <= 0 or fit.get("replicas", 2) <= 1:
        return 0.0
    return float(fit["alpha_s"]) + float(fit["beta_s_per_byte"]) * nbytes


def _pass_waits(passes, first, n, gather, scatter):
    """One pass over a stage's layers in run order, its collectives on one link in issue order:
    ``(L,)`` the wait before each layer, the last reduce-scatter's after the last layer on it.
    ``first``: the gather of the first ``n`` layers, before the first; then each later layer's
    own ``gather``, issued when the layer ``max(1, n − 1)`` before it starts; ``scatter`` (0:
    none) issued when each layer ends."""
    L, ahead = len(passes), max(1, n - 1)
    waits, ready = np.zeros(L), np.zeros(L)
    t = link = first
    waits[0] = first
    for i in range(L):
        if ready[i] > t:
            waits[i] += ready[i] - t
            t = ready[i]
        j = i + ahead
        if n <= j < L:
            link = ready[j] = max(t, link) + gather
        t += passes[i]
        if scatter:
            link = max(t, link) + scatter
    waits[L - 1] += max(0.0, link - t)
    return waits


def exposed_times(name, profile, degree, schedule, forward, backward):
    """``(per_micro_batch, per_iteration)``: ``(L,)`` arrays of one stage's exposed seconds of
    sharding ``name`` per layer (the embedding's and output layer's on layer 0). ``forward``,
    ``backward``: ``(L,)`` each layer's pass per micro-batch (backward with its recompute)."""
    s = STRATEGIES[name]
    L, p = len(forward), profile.dtype_bytes
    params = profile.mem("params_per_layer", degree)
    fixed = float(profile.data["memory"]["fixed_params"])
    ag = rs = collective_time(profile, degree, params * p)  # bf16 parameters, gradients
    ag_fixed = rs_fixed = collective_time(profile, degree, fixed * p)
    micro, once = np.zeros(L), np.zeros(L)
    if s.zero3:
        # each pass: the first gather (n layers, one collective) waits, later ones ride behind
        # the passes before them; backward also reduce-scatters each layer's gradients, the
        # last waited (module docstring)
        n = prefetch_layers(name, params, L, schedule)
        first = collective_time(profile, degree, n * params * p)
        micro += _pass_waits(np.asarray(forward, float), first, n, ag, 0.0)
        micro += _pass_waits(np.asarray(backward, float)[::-1], first, n, ag, rs)[::-1]
        micro[0] += ag_fixed + rs_fixed
        if name.startswith("megatron_fsdp/"):  # the step's parameter sync (module docstring)
            once += ag
            once[0] += ag_fixed
    elif s.zero2:  # one bucket: the whole gradient after the backward (module docstring)
        micro += rs
        micro[0] += rs_fixed
        once += ag
        once[0] += ag_fixed
    else:  # optim: after the last micro-batch, synchronously
        once += rs + ag
        once[0] += rs_fixed + ag_fixed
    return micro, once
