"""Build a :class:`~.problem.ChainProblem` from a profile: the chains per schedule and their costs.

A transformer layer is two blocks (attention, MLP); a block is a computation sequence followed by its
all-reduce. Every layer ``l`` runs at one TMP degree ``d_l`` dividing the TMP domain ``T``: the
domain's micro-batch of ``m`` samples is split over ``T/d_l`` groups of ``d_l`` ranks, so a group
processes ``n_l = m·d_l/T`` samples (two sub-batches ``⌈n_l/2⌉, ⌊n_l/2⌋`` under the overlapped
schedules). Backward chains per schedule (layers in reverse):

* ``off`` (stock Megatron, no split): recompute ``R+C`` of both blocks, then ``B+C`` of both.
* ``overlap``: split; recompute pass and backward pass of each layer are separate segments (the
  pass barrier of Fig. 3b); without recompute the whole backward is one segment.
* ``cross-pass``: split; blocks ``(R_a,C) (R_m,C) (B_m,C) (B_a,C)`` of all layers in one segment.
* ``oases``: split; fine-grained recompute drops the recompute all-reduce: ``(R_m+B_m, C)
  (R_a+B_a, C)`` in one segment.

The recompute setting (:data:`RECOMPUTE_MODES`) is Megatron's: ``full`` recomputes each layer
as above; ``none`` keeps every activation (no recompute blocks, one backward segment;
``off``/``overlap`` only); ``selective`` (``--recompute-granularity selective --recompute-modules
core_attn``, ``off``/``overlap`` only) has the chains of ``none`` with each attention backward
block longer by one core-attention forward (QKᵀ, softmax, dropout, ·V; no TP communication in it,
so no extra collective): :meth:`~megatron_oases.formats.profile.Profile.core_attention_time`;
``selective+ln`` (also ``layernorm``) costs the same time and keeps less (:mod:`.memory_model`).

Between adjacent layers with different degrees the batch is re-split (an all-gather when the degree
grows; :mod:`.time_model`). The embedding and output layer run at ``T``, so a first/last layer below
``T`` adds one all-gather each (backward at the embedding, forward at the output). The output
layer's GEMMs and the embedding/output all-reduces over ``T`` are a degree-independent constant per
micro-batch. Under sequence parallelism (``sequence_parallel``) a block's all-reduce becomes
all-gathers and reduce-scatters (counts per pass and schedule in :mod:`.block_comm`), the embedding
reduce-scatters and the output layer all-gathers instead of their all-reduces, and every layer runs
at ``T`` (the runtime supports SP with uniform TMP only), so the plan is a prediction. The
iteration time is ``(num_microbatches + P − 1) × (forward + backward + edges)``
(1F1B over P pipeline stages; P = 1 without PP), plus, once per iteration, the all-reduce of each
degree-d < T layer's gradients over its T/d replicas (the per-layer runtime's replica sync; not in
the paper's eq. 5) — or, with ``grad_sync=True``, each layer's whole data-parallel gradient
all-reduce of its ``params/d`` over ``D·T/d`` replicas (with ``distributed_optimizer``: the
reduce-scatter of those gradients and the all-gather of the updated parameters, ZeRO-1). Memory
terms come from
:mod:`.memory_model`.

Sequence chunks (``split="sequence"``, ``--oases-split sequence``): the two sub-batches are the
first and second half of every sample's sequence, so a micro-batch of one sample is split too. A
chunk is costed as half the samples (GEMMs, collectives and memory scale with tokens) except core
attention: chunk c computes (s/2)×((c+1)·s/2) scores per sample, so the earlier chunk's core
attention costs half of a half-sample's, the later one's the same (:func:`_core_scale`). The
runtime runs chunks with uniform TMP only, so every layer is planned at ``T`` (a prediction, as
under SP).

This module checks the batch, degree and pin arguments against the profile and turns the profile's
timings into tables; the time and memory models themselves do not read arguments.
"""

import math

import numpy as np

from ..errors import OasesConfigError
from ..formats.profile import gather_ranks, tp_ranks
from ..recompute_settings import RECOMPUTE_MODES, SELECTIVE_MODES
from ..validation import (
    SPLIT_SCHEDULES,
    TAIL_PIECES,
    check_schedule,
    check_schedule_recompute,
    check_split,
    check_whole_layer_recompute,
)
from .block_comm import block_comm
from .memory_model import memory_parts
from .problem import DEFAULT_GRANULE, DEFAULT_MARGIN, Block, ChainProblem


def recompute_mode(value, source="recompute"):
    """``value`` as one of :data:`RECOMPUTE_MODES`. Booleans are the older form (plans written
    before selective recomputation was planned, ``recompute=True`` callers): True is ``full``,
    False ``none``; None is the default, ``full``."""
    if value is None or value is True:
        return "full"
    if value is False:
        return "none"
    if value in RECOMPUTE_MODES:
        return value
    raise OasesConfigError(
        f"{source}: unknown recompute setting {value!r}; choose one of {', '.join(RECOMPUTE_MODES)}"
    )


def recompute_label(value, recompute_num_layers=None):
    """``"no"``, ``"selective"``, ``"selective+ln"``, ``"full"`` or ``"first-N-layers full"``
    (block method): the setting as text says it (``… recompute``)."""
    mode = recompute_mode(value)
    if mode == "full" and recompute_num_layers is not None:
        return f"first-{recompute_num_layers}-layers full"
    return "no" if mode == "none" else mode


def _recomputed_layers(recompute, recompute_layers, L):
    """How many of a stage's ``L`` layers are recomputed: all under ``full`` (Megatron's uniform
    method), ``recompute_layers`` of them under the block method, none otherwise."""
    if recompute_layers is None:
        return L if recompute == "full" else 0
    if recompute != "full":
        raise OasesConfigError(
            f"--recompute-num-layers goes with --recompute full (got --recompute {recompute})"
        )
    if not 1 <= recompute_layers <= L:
        raise OasesConfigError(
            f"--recompute-num-layers {recompute_layers} must be between 1 and the {L} layers of "
            "a pipeline stage"
        )
    return recompute_layers


def _subs(n, split, chunks=False):
    """Samples per sub-batch; sequence ``chunks`` carry all ``n`` samples over half the tokens,
    costed as ``n/2`` samples (:func:`_core_scale` corrects core attention)."""
    if not split:
        return [n]
    if chunks:
        return [n / 2, n / 2]
    return [n - n // 2, n // 2]


def _core_scale(sub, chunks):
    """Core attention of sub-batch ``sub`` relative to that of its sample count at full length:
    sequence chunk c computes (s/2)×((c+1)·s/2) scores per sample, i.e. (c+1)/2 of the s×s
    square of ``s/2`` tokens' worth of samples (stock and batch sub-batches compute the square)."""
    return (sub + 1) / 2 if chunks else 1.0


def _sequence_split_degrees(profile, schedule, degrees, sequence_parallel):
    """``[T]``: sequence chunks run with uniform TMP only (the runtime refuses ``--oases-plan``
    with ``--oases-split sequence``), so, as under SP, the result is that setting's prediction."""
    if schedule not in SPLIT_SCHEDULES:
        raise OasesConfigError(
            f"--split sequence cuts micro-batches into sub-batches, which --schedule {schedule} "
            "does not; use --schedule overlap, cross-pass or oases, or drop --split"
        )
    if sequence_parallel:
        raise OasesConfigError(
            "--split sequence does not support --sequence-parallel (neither does the runtime); "
            "drop one of them"
        )
    T = profile.tp
    if degrees and sorted(set(int(d) for d in degrees)) != [T]:
        raise OasesConfigError(
            f"--split sequence plans every layer at T={T} (the runtime runs sequence chunks with "
            f"uniform TMP only); drop --degrees or pass --degrees {T}"
        )
    if profile.shape["seq_length"] < 2:
        raise OasesConfigError("--split sequence needs a sequence of at least 2 tokens")
    return [T]


def build_problem(
    profile,
    *,
    schedule="oases",
    global_batch_size,
    micro_batch_size=None,
    degrees=None,
    recompute=None,
    memory_gb=None,
    margin=DEFAULT_MARGIN,
    granule=DEFAULT_GRANULE,
    pins=None,
    max_switches=None,
    num_layers=None,
    grad_sync=False,
    allow_unsplit=False,
    distributed_optimizer=False,
    stage=0,
    sequence_parallel=False,
    recompute_layers=None,
    split="batch",
):
    """A :class:`ChainProblem` for ``profile`` (:class:`~megatron_oases.formats.profile.Profile`).

    With pipeline parallelism (the profile's ``pipeline_model_parallel_size`` P > 1) the chain is
    one stage's ``num_layers / P`` layers (``num_layers``: the whole model's, default the
    profile's), costed for Megatron's 1F1B schedule: the iteration takes ``(M + P − 1)`` stage
    micro-batch times (pipeline bubble, M micro-batches), and pipeline ``stage`` s holds the saved
    activations of ``min(P − s, M)`` micro-batches at its peak (stage 0, the default, holds the
    most). Each pass of a micro-batch pays one stage-to-stage send (the profile's
    ``pipeline_p2p`` fit; 0 without one). ``sequence_parallel``: Megatron's
    ``--sequence-parallel``; every layer at degree ``T`` (:func:`_sequence_parallel_degrees`).
    ``recompute_layers``: with ``recompute="full"``, Megatron's ``--recompute-method block
    --recompute-num-layers N``: only each stage's first N layers are recomputed, the others keep
    their activations (as the runtime does: their backward comes first, before any recompute).
    ``split``: ``"sequence"`` for sub-batches of sequence chunks (``--oases-split sequence``;
    uniform degree ``T``, :func:`_sequence_split_degrees`)."""
    check_schedule(schedule, source="--schedule")
    check_split(split, source="--split")
    recompute = recompute_mode(recompute, source="--recompute")
    if recompute in SELECTIVE_MODES:
        check_whole_layer_recompute(
            schedule,
            flag="--schedule",
            fix=f"use --recompute full, or --schedule off or overlap with --recompute {recompute}",
        )
    check_schedule_recompute(
        schedule, recompute == "full", flag="--schedule", fix="use --recompute full"
    )
    T, D = profile.tp, profile.dp
    pp = int(profile.data.get("pipeline_model_parallel_size", 1))
    total_layers = int(num_layers or profile.num_layers)
    if total_layers % pp:
        raise OasesConfigError(
            f"{total_layers} layers do not split evenly over {pp} pipeline stages; "
            "change --num-layers or --pipeline-model-parallel-size"
        )
    if not 0 <= stage < pp:
        raise OasesConfigError(f"pipeline stage {stage} is out of range (0–{pp - 1})")
    L = total_layers // pp
    N = _recomputed_layers(recompute, recompute_layers, L)
    shape = profile.shape
    p = profile.dtype_bytes
    if global_batch_size <= 0 or global_batch_size % D:
        raise OasesConfigError(
            f"--global-batch-size {global_batch_size} is not a positive multiple of the data-parallel "
            f"size {D}"
        )
    per_domain = global_batch_size // D
    m = int(micro_batch_size or per_domain)
    if m <= 0 or per_domain % m:
        raise OasesConfigError(
            f"--micro-batch-size {m} does not divide the {per_domain} samples per TMP domain "
            f"(global batch {global_batch_size} / DP {D})"
        )
    microbatches = per_domain // m
    # 1F1B: M micro-batches through P stages take M + P − 1 stage slots; stage s keeps up to
    # P − s micro-batches' activations alive
    repeats = microbatches + pp - 1
    in_flight = min(pp - stage, microbatches)
    chunks = split == "sequence"
    halves = schedule in SPLIT_SCHEDULES  # each micro-batch runs as two sub-batches
    available = profile.degrees
    if chunks:
        degrees = _sequence_split_degrees(profile, schedule, degrees, sequence_parallel)
    if sequence_parallel:
        degrees = _sequence_parallel_degrees(profile, degrees)
    cand = sorted(int(d) for d in (degrees or available))
    for d in cand:
        if d not in available:
            raise OasesConfigError(
                f"TMP degree {d} is not in the profile (it has {available}); re-profile or drop it"
            )
    usable, why = [], []
    for d in cand:
        n = m * d / T
        if n != int(n) or n < (2 if halves and not chunks and not allow_unsplit else 1):
            why.append(
                f"degree {d} gives {n:g} samples per group per micro-batch"
                + (
                    " (needs ≥ 2 to split; see allow_unsplit)"
                    if halves and not chunks and n == 1
                    else ""
                )
            )
            continue
        usable.append(d)
    if not usable:
        raise OasesConfigError(
            f"no candidate TMP degree works with micro-batch {m} and T={T}: {'; '.join(why)}; "
            "raise --micro-batch-size"
        )
    if degrees and len(usable) < len(cand):
        raise OasesConfigError(
            "; ".join(why) + "; drop it from --degrees or raise --micro-batch-size"
        )
    degs = usable
    K = len(degs)
    hid = shape["seq_length"] * shape["hidden_size"] * p  # bytes per sample of a hidden state

    def comp(block, phase, d, sizes):
        return [profile.compute_time(block, phase, d, n) if n else 0.0 for n in sizes]

    # per-degree tables: [sub][k]
    sizes = {d: _subs(m * d // T, halves, chunks) for d in degs}
    S = len(next(iter(sizes.values())))
    tab = {}
    for block in ("attention", "mlp"):
        for phase in ("forward_s", "recompute_s", "backward_s"):
            tab[block, phase] = np.array(
                [[comp(block, phase, d, sizes[d])[s] for d in degs] for s in range(S)]
            )
    comm = block_comm(profile, degs, sizes, hid, schedule, sequence_parallel)

    def blk(layer, name, comp_arr, comm_arr):
        return Block(layer, name, comp_arr, comm_arr)

    F = {b: tab[b, "forward_s"] for b in ("attention", "mlp")}
    R = {b: tab[b, "recompute_s"] for b in ("attention", "mlp")}
    B = {b: tab[b, "backward_s"] for b in ("attention", "mlp")}
    # core attention's forward seconds per sub-batch: at full length, and as it runs
    square = np.array(
        [
            [profile.core_attention_time(d, sizes[d][s]) if sizes[d][s] else 0.0 for d in degs]
            for s in range(S)
        ]
    )
    core = square * np.array([[_core_scale(s, chunks)] for s in range(S)])
    if chunks:  # the earlier chunk's attention is cheaper (its backward: twice the forward)
        F["attention"] = F["attention"] + core - square
        R["attention"] = R["attention"] + core - square
        B["attention"] = B["attention"] + 2 * (core - square)
    # core attention's forward runs again inside its backward (the norms' recomputation under
    # selective+ln is not costed: memory-bound and small, 0.3 % of an iteration on the testbed)
    if recompute in SELECTIVE_MODES:
        B["attention"] = B["attention"] + core

    fc, rc, bc = comm["forward"], comm["recompute"], comm["backward"]
    forward = [[]]
    for l in range(L):
        forward[0].append(blk(l, "attention.F", F["attention"], fc))
        forward[0].append(blk(l, "mlp.F", F["mlp"], fc))
    if halves and not sequence_parallel:  # the pass ends on a piece of its last block
        forward[0][-1].tail = fc[1] / TAIL_PIECES

    def kept_backward(l):  # a layer that is not recomputed
        return [blk(l, "mlp.B", B["mlp"], bc), blk(l, "attention.B", B["attention"], bc)]

    # the layers from N on keep their activations; their backward comes first (block method)
    kept = [b for l in reversed(range(N, L)) for b in kept_backward(l)]
    backward = []
    if schedule == "oases":
        seg = list(kept)
        for l in reversed(range(N)):
            seg.append(blk(l, "mlp.R+B", R["mlp"] + B["mlp"], rc + bc))
            seg.append(blk(l, "attention.R+B", R["attention"] + B["attention"], rc + bc))
        backward = [seg]
    elif schedule in ("cross-pass", "off") or not N:
        seg = list(kept)
        for l in reversed(range(N)):
            seg.append(blk(l, "attention.R", R["attention"], rc))
            seg.append(blk(l, "mlp.R", R["mlp"], rc))
            seg += kept_backward(l)
        backward = [seg]
    else:  # overlap with recompute: recompute pass and backward pass per layer, barriers between
        for l in reversed(range(N)):
            recompute_pass = [
                blk(l, "attention.R", R["attention"], rc),
                blk(l, "mlp.R", R["mlp"], rc),
            ]
            # the kept layers' backward opens the first recompute pass, as in the runtime
            backward.append((kept if l == N - 1 else []) + recompute_pass)
            backward.append(kept_backward(l))

    # re-shard all-gathers between adjacent layers (same for every boundary: layers are alike)
    g = np.zeros((K, K))
    for i, di in enumerate(degs):
        for j, dj in enumerate(degs):
            if di == dj:
                continue
            lo, hi = min(di, dj), max(di, dj)
            ranks = gather_ranks(lo, hi)
            g[i, j] = sum(profile.all_gather_time(ranks, n * hid) for n in sizes[hi])
    gather = np.broadcast_to(g, (max(L - 1, 0), K, K)).copy()

    # embedding (input, backward) and output layer (forward) run at T: re-shard at both ends
    boundary = np.zeros((L, K))
    for k, d in enumerate(degs):
        if d < T:
            t = profile.all_gather_time(gather_ranks(d, T), m * hid)
            boundary[0, k] += t
            boundary[L - 1, k] += t

    # memory (bytes per rank, eq. 6)
    parts, fixed_parts = memory_parts(
        profile,
        degs,
        num_layers=L,
        micro_batch=m,
        schedule=schedule,
        recompute=recompute,
        in_flight=in_flight,
        distributed_optimizer=distributed_optimizer,
        sequence_parallel=sequence_parallel,
        recompute_layers=N,
        split=split,
    )
    mem_add = parts["state"] + parts["saved"]
    mem_rt = parts["runtime"]
    mem_fixed = sum(fixed_parts.values())

    allowed = np.ones((L, K), dtype=bool)
    for layers, d in pins or ():
        if d not in degs:
            raise OasesConfigError(
                f"--pin degree {d} is not a candidate degree here ({', '.join(map(str, degs))})"
            )
        for l in layers:
            if not 0 <= l < L:
                raise OasesConfigError(f"--pin layer {l} is out of range (0–{L - 1})")
            allowed[l, :] = False
            allowed[l, degs.index(d)] = True

    # degree-independent work outside the layers, per micro-batch: the output layer's GEMMs; the
    # vocab-parallel embedding's forward all-reduce and the output layer's dgrad all-reduce over T
    # (under SP: the embedding's reduce-scatter and the output layer's all-gather, each pass)
    if sequence_parallel:
        edge_ar = profile.reduce_scatter_time(tp_ranks(T), m * hid) + profile.all_gather_time(
            tp_ranks(T), m * hid
        )
    else:
        edge_ar = profile.all_reduce_time(tp_ranks(T), m * hid)
    fixed_fwd = profile.fixed_compute("forward") * m + edge_ar
    fixed_bwd = profile.fixed_compute("backward") * m + edge_ar
    # 1F1B hands each micro-batch's activation (forward) and its gradient (backward) to the next
    # stage: one blocking send per pass on a stage's critical path (SP sends its s/T shard)
    p2p = profile.pipeline_p2p_time(m * hid / (T if sequence_parallel else 1)) if pp > 1 else 0.0
    fixed_fwd += p2p
    fixed_bwd += p2p

    sync = np.zeros((L, K))
    sync_available = True
    for k, d in enumerate(degs):
        t = profile.grad_sync_time(d, distributed_optimizer=distributed_optimizer)
        if t is None:
            sync_available = False
            t = 0.0
        sync[:, k] = t
    replica = np.zeros((L, K))
    for k, d in enumerate(degs):
        if d < T:
            nbytes = profile.mem("params_per_layer", d) * profile.dtype_bytes
            replica[:, k] = profile.all_reduce_time(tp_ranks(T // d), nbytes)
    if grad_sync and not sync_available:
        raise OasesConfigError(
            "this profile has no data-parallel gradient all-reduce timings (measured profiles lack "
            "them); drop --grad-sync or use an --analytic profile"
        )

    if max_switches is not None and max_switches < 0:
        raise OasesConfigError("--max-switches must be ≥ 0")
    memory_bytes = math.inf if memory_gb is None else float(memory_gb) * 1e9
    return ChainProblem(
        degrees=degs,
        num_layers=L,
        subs=2 if halves else 1,
        forward=forward,
        backward=backward,
        gather_fwd=gather,
        gather_bwd=gather.copy(),
        boundary=boundary,
        repeats=repeats,
        mem_add=mem_add,
        mem_runtime=mem_rt,
        mem_fixed=mem_fixed,
        memory_bytes=memory_bytes,
        margin=margin,
        granule=granule,
        allowed=allowed,
        max_switches=max_switches,
        fixed_forward_s=fixed_fwd,
        fixed_backward_s=fixed_bwd,
        grad_sync=sync,
        include_grad_sync=bool(grad_sync),
        replica_sync=replica,
        meta={
            "schedule": schedule,
            "recompute": recompute,
            # Megatron's --recompute-num-layers under the block method (None: every layer or none)
            "recompute_num_layers": N if recompute == "full" and N < L else None,
            "sequence_parallel": bool(sequence_parallel),
            "split": split,
            "tensor_model_parallel_size": T,
            "data_parallel_size": D,
            "global_batch_size": int(global_batch_size),
            "micro_batch_size": m,
            "num_microbatches": microbatches,
            "pipeline_model_parallel_size": pp,
            "pipeline_stage": stage,
            "pipeline_p2p_s": 2 * p2p,  # per micro-batch, both passes (in the fixed times)
            "in_flight_microbatches": in_flight,
            "total_layers": total_layers,
            "excluded_degrees": why,
            "unsplit_degrees": [d for d in degs if halves and not chunks and m * d // T < 2],
            "distributed_optimizer": bool(distributed_optimizer),
            "memory_parts": parts,
            "fixed_memory_parts": fixed_parts,
        },
    )


def _sequence_parallel_degrees(profile, degrees):
    """``[T]``: under ``--sequence-parallel`` the runtime runs uniform TMP only (no per-layer
    degrees), so the search is restricted to ``T`` and the result is its prediction."""
    profile.require_sequence_parallel()
    T = profile.tp
    if T == 1:
        raise OasesConfigError("--sequence-parallel needs a TMP domain T > 1")
    if degrees and sorted(set(int(d) for d in degrees)) != [T]:
        raise OasesConfigError(
            f"--sequence-parallel plans every layer at T={T} (per-layer degrees are not supported "
            "with sequence parallelism); drop --degrees or pass --degrees "
            f"{T}"
        )
    if profile.shape["seq_length"] % T:
        raise OasesConfigError(
            f"--sequence-parallel: seq_length {profile.shape['seq_length']} is not a multiple of "
            f"T={T}"
        )
    return [T]
