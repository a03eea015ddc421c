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
from dataclasses import dataclass

import numpy as np

from ..errors import OasesConfigError
from ..formats.profile import gather_ranks, tp_ranks
from ..recompute_settings import SELECTIVE_MODES
from ..validation import SPLIT_SCHEDULES, TAIL_PIECES, check_schedule, samples_per_group
from .block_comm import block_comm
from .memory_model import memory_parts
from .problem import Block, ChainProblem
from .settings import recompute_label, recompute_mode  # noqa: F401 (re-exported)
from .sharding import check_profile as check_sharded_profile
from .sharding import exposed_times
from .time_model import evaluate


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


@dataclass(frozen=True)
class _Batch:
    """One stage's layer and batch arithmetic (1F1B: M micro-batches through P stages take
    M + P − 1 stage slots; stage s keeps up to P − s micro-batches' activations alive)."""

    T: int  # the TMP domain
    D: int  # data-parallel size
    pp: int  # pipeline stages
    total_layers: int
    L: int  # this stage's layers
    N: int  # … of them recomputed
    m: int  # samples per micro-batch per TMP domain
    microbatches: int
    repeats: int
    in_flight: int


def _batch(profile, settings, num_layers, stage):
    """The stage's :class:`_Batch`; one error line where the layers or the batch do not divide,
    or where the settings are for another layout than the profile's."""
    T, D = profile.tp, profile.dp
    pp = int(profile.data.get("pipeline_model_parallel_size", 1))
    for name, ours, what in (
        ("tensor_model_parallel_size", T, "TMP domain T"),
        ("data_parallel_size", D, "data-parallel size"),
        ("pipeline_model_parallel_size", pp, "pipeline-parallel size"),
    ):
        theirs = getattr(settings, name)
        if theirs is not None and theirs != ours:
            raise OasesConfigError(
                f"{settings.source(name)} is for a {what} of {theirs}, but the profile has "
                f"{ours}; use a profile of that layout"
            )
    total_layers = int(num_layers or profile.num_layers)
    if total_layers % pp:
        raise OasesConfigError(
            f"{total_layers} layers do not split evenly over {pp} pipeline stages; "
            "change --num-layers or --pipeline-model-parallel-size"
        )
    if not 0 <= stage < pp:
        raise OasesConfigError(f"pipeline stage {stage} is out of range (0–{pp - 1})")
    L = total_layers // pp
    N = _recomputed_layers(settings.recompute, settings.recompute_layers, L)
    gbs = settings.global_batch_size
    if gbs is None:
        raise OasesConfigError("--global-batch-size is required")
    if gbs <= 0 or gbs % D:
        raise OasesConfigError(
            f"--global-batch-size {gbs} is not a positive multiple of the data-parallel "
            f"size {D}"
        )
    per_domain = gbs // D
    m = int(settings.micro_batch_size or per_domain)
    if m <= 0 or per_domain % m:
        raise OasesConfigError(
            f"--micro-batch-size {m} does not divide the {per_domain} samples per TMP domain "
            f"(global batch {gbs} / DP {D})"
        )
    microbatches = per_domain // m
    return _Batch(
        T,
        D,
        pp,
        total_layers,
        L,
        N,
        m,
        microbatches,
        microbatches + pp - 1,
        min(pp - stage, microbatches),
    )


def _candidate_degrees(profile, settings, m, halves, chunks):
    """(usable degrees, why each other candidate is excluded): a degree must give its groups a
    whole number of samples, two under a split unless ``allow_unsplit``."""
    degrees, available, T = settings.degrees, profile.degrees, profile.tp
    if chunks:
        degrees = _sequence_split_degrees(
            profile, settings.schedule, degrees, settings.sequence_parallel
        )
    if settings.sequence_parallel:
        degrees = _sequence_parallel_degrees(profile, degrees)
    if settings.data_parallel_sharding:
        degrees = _sharded_degrees(profile, degrees)
    cand = sorted(int(d) for d in (degrees or available))
    for d in cand:
        if d not in available:
            raise OasesConfigError(
                f"TMP degree {d} is not in the profile (it has {available}); re-profile or drop it"
            )
    usable, why = [], []
    need = 2 if halves and not chunks and not settings.allow_unsplit else 1
    for d in cand:
        n = samples_per_group(m, d, T)
        if n != int(n) or n < need:
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
    return usable, why


def _block_times(profile, recompute, degs, sizes, chunks):
    """``F``, ``R``, ``B``: per block (``"attention"``, ``"mlp"``), the forward, recompute and
    backward compute seconds as ``[sub][k]`` arrays, core attention corrected for sequence chunks
    and selective recomputation."""
    S = len(next(iter(sizes.values())))

    def table(block, phase):
        return np.array(
            [
                [
                    profile.compute_time(block, phase, d, sizes[d][s]) if sizes[d][s] else 0.0
                    for d in degs
                ]
                for s in range(S)
            ]
        )

    blocks = ("attention", "mlp")
    F = {b: table(b, "forward_s") for b in blocks}
    R = {b: table(b, "recompute_s") for b in blocks}
    B = {b: table(b, "backward_s") for b in blocks}
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
    return F, R, B


def _chains(schedule, L, N, times, comm, piecewise_tail):
    """(forward, backward): one stage's segments of :class:`Block` per schedule (module
    docstring); ``times``: :func:`_block_times`; ``piecewise_tail``: the forward pass ends on a
    piece of its last block's all-reduce."""
    F, R, B = times
    fc, rc, bc = comm["forward"], comm["recompute"], comm["backward"]
    forward = [[]]
    for l in range(L):
        forward[0].append(Block(l, "attention.F", F["attention"], fc))
        forward[0].append(Block(l, "mlp.F", F["mlp"], fc))
    if piecewise_tail:
        forward[0][-1].tail = fc[1] / TAIL_PIECES

    def kept_backward(l):  # a layer that is not recomputed
        return [Block(l, "mlp.B", B["mlp"], bc), Block(l, "attention.B", B["attention"], bc)]

    def recompute_pass(l):
        return [Block(l, "attention.R", R["attention"], rc), Block(l, "mlp.R", R["mlp"], rc)]

    # the layers from N on keep their activations; their backward comes first (block method)
    kept = [b for l in reversed(range(N, L)) for b in kept_backward(l)]
    if schedule == "oases":
        seg = list(kept)
        for l in reversed(range(N)):
            seg.append(Block(l, "mlp.R+B", R["mlp"] + B["mlp"], rc + bc))
            seg.append(Block(l, "attention.R+B", R["attention"] + B["attention"], rc + bc))
        return forward, [seg]
    if schedule in ("cross-pass", "off") or not N:
        seg = list(kept)
        for l in reversed(range(N)):
            seg += recompute_pass(l) + kept_backward(l)
        return forward, [seg]
    # overlap with recompute: recompute pass and backward pass per layer, barriers between; the
    # kept layers' backward opens the first recompute pass, as in the runtime
    backward = []
    for l in reversed(range(N)):
        backward.append((kept if l == N - 1 else []) + recompute_pass(l))
        backward.append(kept_backward(l))
    return forward, backward


def _reshard(profile, degs, sizes, hid, L, m):
    """(gather, boundary): the all-gathers between adjacent layers of different degrees
    (``(L−1, K, K)``, alike at every boundary) and at the embedding and output layer, which run
    at ``T`` (``(L, K)``)."""
    K, T = len(degs), profile.tp
    g = np.zeros((K, K))
    for i, di in enumerate(degs):
        for j, dj in enumerate(degs):
            if di == dj:
                continue
            lo, hi = min(di, dj), max(di, dj)
            ranks = gather_ranks(lo, hi)
            g[i, j] = sum(profile.all_gather_time(ranks, n * hid) for n in sizes[hi])
    gather = np.broadcast_to(g, (max(L - 1, 0), K, K)).copy()
    boundary = np.zeros((L, K))
    for k, d in enumerate(degs):
        if d < T:
            t = profile.all_gather_time(gather_ranks(d, T), m * hid)
            boundary[0, k] += t
            boundary[L - 1, k] += t
    return gather, boundary


def _allowed(pins, degs, L):
    """``(L, K)`` bool: the degrees each layer may take under ``--pin``."""
    allowed = np.ones((L, len(degs)), dtype=bool)
    for layers, d in pins:
        if d not in degs:
            raise OasesConfigError(
                f"--pin degree {d} is not a candidate degree here ({', '.join(map(str, degs))})"
            )
        for l in layers:
            if not 0 <= l < L:
                raise OasesConfigError(f"--pin layer {l} is out of range (0–{L - 1})")
            allowed[l, :] = False
            allowed[l, degs.index(d)] = True
    return allowed


def _fixed_times(profile, sequence_parallel, m, hid, pp):
    """(forward, backward, p2p): degree-independent seconds per micro-batch outside the layers.
    The output layer's GEMMs; the vocab-parallel embedding's forward all-reduce and the output
    layer's dgrad all-reduce over T (under SP: the embedding's reduce-scatter and the output
    layer's all-gather, each pass); with PP, 1F1B's blocking send of each micro-batch's
    activation (forward) and gradient (backward) to the next stage (SP sends its s/T shard)."""
    T = profile.tp
    if sequence_parallel:
        edge_ar = profile.reduce_scatter_time(tp_ranks(T), m * hid) + profile.all_gather_time(
            tp_ranks(T), m * hid
        )
    else:
        edge_ar = profile.all_reduce_time(tp_ranks(T), m * hid)
    p2p = profile.pipeline_p2p_time(m * hid / (T if sequence_parallel else 1)) if pp > 1 else 0.0
    fixed_fwd = profile.fixed_compute("forward") * m + edge_ar + p2p
    fixed_bwd = profile.fixed_compute("backward") * m + edge_ar + p2p
    return fixed_fwd, fixed_bwd, p2p


def _sync_times(profile, settings, degs, L):
    """(sync, replica), ``(L, K)`` seconds per iteration: each layer's data-parallel gradient
    all-reduce (or ZeRO-1's reduce-scatter + all-gather), and the per-layer runtime's sum of a
    degree-d layer's gradients over its T/d replicas."""
    T = profile.tp
    sync = np.zeros((L, len(degs)))
    sync_available = True
    for k, d in enumerate(degs):
        t = profile.grad_sync_time(d, distributed_optimizer=settings.distributed_optimizer)
        if t is None:
            sync_available = False
            t = 0.0
        sync[:, k] = t
    replica = np.zeros((L, len(degs)))
    for k, d in enumerate(degs):
        if d < T:
            nbytes = profile.mem("params_per_layer", d) * profile.dtype_bytes
            replica[:, k] = profile.all_reduce_time(tp_ranks(T // d), nbytes)
    if settings.grad_sync and not sync_available:
        raise OasesConfigError(
            "this profile has no data-parallel gradient all-reduce timings (measured profiles lack "
            "them); drop --grad-sync or use an --analytic profile"
        )
    return sync, replica


def build_problem(profile, settings, *, num_layers=None, stage=0):
    """A :class:`ChainProblem` for ``profile`` (:class:`~megatron_oases.formats.profile.Profile`)
    and ``settings`` (:class:`~.settings.PlanSettings`; where it names a layout, the profile's).

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
    s = settings
    check_schedule(s.schedule, source="--schedule")  # ("auto" is choose_plan's, not a schedule)
    b = _batch(profile, s, num_layers, stage)
    if s.data_parallel_sharding:
        check_sharded_profile(s.data_parallel_sharding, profile, b.pp)
    T, L, m = b.T, b.L, b.m
    chunks = s.split == "sequence"
    halves = s.schedule in SPLIT_SCHEDULES  # each micro-batch runs as two sub-batches
    degs, why = _candidate_degrees(profile, s, m, halves, chunks)
    hid = profile.shape["seq_length"] * profile.shape["hidden_size"] * profile.dtype_bytes
    sizes = {d: _subs(samples_per_group(m, d, T), halves, chunks) for d in degs}  # per sub-batch
    times = _block_times(profile, s.recompute, degs, sizes, chunks)
    comm = block_comm(profile, degs, sizes, hid, s.schedule, s.sequence_parallel)
    forward, backward = _chains(
        s.schedule, L, b.N, times, comm, piecewise_tail=halves and not s.sequence_parallel
    )
    gather, boundary = _reshard(profile, degs, sizes, hid, L, m)
    parts, fixed_parts = memory_parts(  # bytes per rank, eq. 6
        profile,
        degs,
        num_layers=L,
        micro_batch=m,
        schedule=s.schedule,
        recompute=s.recompute,
        in_flight=b.in_flight,
        distributed_optimizer=s.distributed_optimizer,
        sequence_parallel=s.sequence_parallel,
        recompute_layers=b.N,
        split=s.split,
        sharding=s.data_parallel_sharding,
    )
    allowed = _allowed(s.pins, degs, L)
    fixed_fwd, fixed_bwd, p2p = _fixed_times(profile, s.sequence_parallel, m, hid, b.pp)
    sync, replica = _sync_times(profile, s, degs, L)
    problem = ChainProblem(
        degrees=degs,
        num_layers=L,
        subs=2 if halves else 1,
        forward=forward,
        backward=backward,
        gather_fwd=gather,
        gather_bwd=gather.copy(),
        boundary=boundary,
        repeats=b.repeats,
        mem_add=parts["state"] + parts["saved"],
        mem_runtime=parts["runtime"],
        mem_fixed=sum(fixed_parts.values()),
        memory_bytes=math.inf if s.memory_gb is None else float(s.memory_gb) * 1e9,
        margin=s.margin,
        granule=s.granule,
        allowed=allowed,
        max_switches=s.max_switches,
        fixed_forward_s=fixed_fwd,
        fixed_backward_s=fixed_bwd,
        grad_sync=sync,
        include_grad_sync=s.grad_sync,
        replica_sync=replica,
        settings=s,
        meta=_meta(s, b, stage, p2p, why, degs, halves and not chunks, parts, fixed_parts),
    )
    if s.data_parallel_sharding:
        _shard(problem, profile)
    return problem


def _shard(problem, profile):
    """Sharded data parallelism's exposed collectives (:mod:`.sharding`), hidden behind each
    layer's pass as the time model costs it at the one degree a sharded plan runs: per
    micro-batch (``problem.sharding``) and, in place of the gradient all-reduce, per iteration
    (``problem.grad_sync``)."""
    r = problem.repeats
    passes = evaluate(problem, [0] * problem.num_layers)["per_layer"]
    forward = np.array([p["forward_s"] / r for p in passes])
    backward = np.array([p["backward_s"] / r for p in passes])
    settings = problem.settings
    micro, once = exposed_times(
        settings.data_parallel_sharding,
        profile,
        problem.degrees[0],
        settings.schedule,
        forward,
        backward,
    )
    problem.sharding[:, 0] = micro
    problem.grad_sync[:, 0] = once


def _meta(settings, b, stage, p2p, why, degs, sample_split, parts, fixed_parts):
    """What the builder derived from the settings and the profile (the settings themselves are
    ``problem.settings``)."""
    return {
        # Megatron's --recompute-num-layers under the block method (None: every layer or none)
        "recompute_num_layers": b.N if settings.recompute == "full" and b.N < b.L else None,
        "tensor_model_parallel_size": b.T,
        "data_parallel_size": b.D,
        "micro_batch_size": b.m,
        "num_microbatches": b.microbatches,
        "pipeline_model_parallel_size": b.pp,
        "pipeline_stage": stage,
        "pipeline_p2p_s": 2 * p2p,  # per micro-batch, both passes (in the fixed times)
        "in_flight_microbatches": b.in_flight,
        "total_layers": b.total_layers,
        "excluded_degrees": why,
        "unsplit_degrees": [d for d in degs if sample_split and samples_per_group(b.m, d, b.T) < 2],
        "memory_parts": parts,
        "fixed_memory_parts": fixed_parts,
    }


def _sharded_degrees(profile, degrees):
    """``[T]``: FSDP holds whole TP shards sharded over DP and the runtime refuses per-layer
    plans under it (``--oases-plan``), so every layer runs at ``T``: the plan is a prediction."""
    T = profile.tp
    if degrees and sorted(set(int(d) for d in degrees)) != [T]:
        raise OasesConfigError(
            f"--data-parallel-sharding plans every layer at T={T} (the runtime runs FSDP with "
            f"uniform TMP only); drop --degrees or pass --degrees {T}"
        )
    return [T]


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
