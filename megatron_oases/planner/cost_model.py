"""Overlap-aware cost model of the Oases paper (§4.2, eq. 3–4, 6) over a chain of TMP blocks.

Model
-----
A transformer layer is two blocks (attention, MLP); a block is a computation sequence followed by its
all-reduce. Every layer ``l`` runs at one TMP degree ``d_l`` dividing the TMP domain ``T``: the
domain's micro-batch of ``m`` samples is split over ``T/d_l`` groups of ``d_l`` ranks, so a group
processes ``n_l = m·d_l/T`` samples (two sub-batches ``⌈n_l/2⌉, ⌊n_l/2⌋`` under the overlapped
schedules). Each training pass is a chain of blocks (processing order) cut into *segments* at pass
barriers; for a segment with blocks ``0..k`` and two sub-batches, eq. (3)::

    T_V = d_0^0 + Σ_{i≥1} max{d_i^0, c_{i-1}^1} + Σ_i max{d_i^1, c_i^0} + c_k^1

with ``d`` the block's compute and ``c`` its communication on that sub-batch. With one sub-batch
(``off``) a block costs ``d + c``. Backward chains per schedule (layers in reverse):

* ``off`` (stock Megatron, no split): recompute ``R+C`` of both blocks, then ``B+C`` of both.
* ``overlap``: split; recompute pass and backward pass of each layer are separate segments (the
  pass barrier of Fig. 3b); without recompute the whole backward is one segment.
* ``cross-pass``: split; blocks ``(R_a,C) (R_m,C) (B_m,C) (B_a,C)`` of all layers in one segment.
* ``oases``: split; fine-grained recompute drops the recompute all-reduce: ``(R_m+B_m, C)
  (R_a+B_a, C)`` in one segment.

Re-sharding (eq. 4): between adjacent layers with different degrees the batch is re-split; when the
degree *grows* along a pass's processing order (forward: ``d_l < d_{l+1}``; backward: ``d_{l+1} <
d_l``) a blocking all-gather over ``d_large/d_small`` ranks is needed for each sub-batch, and the
overlap across that boundary is lost: the ``max{d^0, c^1}`` term becomes ``c^1 + AG + d^0``, i.e. eq.
(4)'s ``T_allgather + min{c^1, d^0}`` on top of the max. The embedding and output layer run at ``T``,
so a first/last layer below ``T`` adds one all-gather each (backward at the embedding, forward at the
output). The output layer's GEMMs and the embedding/output all-reduces over ``T`` are a
degree-independent constant per micro-batch. The iteration time is ``(num_microbatches + P − 1) ×
(forward + backward + edges)`` (1F1B over P pipeline stages; P = 1 without PP), plus, once per
iteration, the all-reduce of each degree-d < T layer's gradients over its T/d replicas (the per-layer
runtime's replica sync; not in the paper's eq. 5) — or, with ``grad_sync=True``, each layer's whole
data-parallel gradient all-reduce of its ``params/d`` over ``D·T/d`` replicas.

Memory (eq. 6, TP-aware): ``fixed state + Σ_l [state(d_l) + saved(d_l, n_l)] + max_l runtime(d_l,
n_l) + fixed activations·m + overhead``, where ``saved`` is the layer input (Megatron full
recompute), the two block inputs (``oases`` fine-grained recompute) or all activations (no
recompute), and ``runtime`` is the forward+backward peak of what is recomputed at once — the whole
layer, or for ``oases`` the larger block of one sub-batch — measured at the group's sample count
``n_l`` (not a per-sample value times ``n_l``: weight-gradient temporaries do not grow with the
batch). Split
schedules with recomputation add one sub-batch's backward working set (peak − activations at
``⌈n_l/2⌉``): the two sub-batches' backward passes interleave. The constraint is
``peak × (1 + margin) ≤ memory``. Solvers see memory in integer *granules* (rounded up, so never
optimistic); the DP and the ILP share those integers and therefore the same feasible set.
"""

import itertools
import math
from dataclasses import dataclass, field

import numpy as np

from ..errors import OasesConfigError
from ..formats.profile import gather_ranks, tp_ranks
from ..validation import SPLIT_SCHEDULES, check_schedule, check_schedule_recompute

DEFAULT_MARGIN = 0.10
DEFAULT_GRANULE = 1 << 20  # 1 MiB


@dataclass
class Block:
    """One block in a pass chain: ``comp[sub][k]`` and ``comm[sub][k]`` seconds at degree index k."""

    layer: int
    name: str
    comp: np.ndarray
    comm: np.ndarray


@dataclass
class ChainProblem:
    """A planning instance: costs of every block for every candidate degree, memory, constraints."""

    degrees: list  # candidate degrees (K of them)
    num_layers: int
    subs: int  # sub-batches per micro-batch: 2 (overlapped schedules) or 1 (off)
    forward: list  # segments: lists of Block in processing order
    backward: list
    gather_fwd: np.ndarray  # (L-1, K, K) all-gather seconds at boundary l→l+1 if used in forward
    gather_bwd: np.ndarray  # (L-1, K, K) … in backward
    boundary: np.ndarray  # (L, K) extra unary seconds (embedding/output re-shards)
    repeats: int  # micro-batches per iteration
    mem_add: np.ndarray  # (L, K) bytes per layer, additive
    mem_runtime: np.ndarray  # (L, K) bytes, max over layers
    mem_fixed: float  # bytes
    memory_bytes: float = math.inf  # device memory
    margin: float = DEFAULT_MARGIN
    granule: float = DEFAULT_GRANULE
    allowed: np.ndarray = None  # (L, K) bool
    max_switches: int = None
    fixed_forward_s: float = 0.0  # per micro-batch, degree-independent (output layer, embedding AR)
    fixed_backward_s: float = 0.0
    grad_sync: np.ndarray = None  # (L, K) seconds per iteration: DP gradient all-reduce per layer
    include_grad_sync: bool = False
    # (L, K) seconds per iteration: the per-layer TMP runtime sums a degree-d layer's gradients
    # over its T/d replicas inside the TMP domain (megatron_oases.hetero.model.sync_replica_grads);
    # always paid, and part of grad_sync when that is included.
    replica_sync: np.ndarray = None
    meta: dict = field(default_factory=dict)

    def __post_init__(self):
        if self.allowed is None:
            self.allowed = np.ones((self.num_layers, len(self.degrees)), dtype=bool)
        if self.grad_sync is None:
            self.grad_sync = np.zeros((self.num_layers, len(self.degrees)))
        if self.replica_sync is None:
            self.replica_sync = np.zeros((self.num_layers, len(self.degrees)))

    @property
    def per_iteration(self):
        """(L, K) seconds paid once per iteration (not per micro-batch)."""
        return self.grad_sync if self.include_grad_sync else self.replica_sync

    # ------------------------------------------------------------ memory (granules)
    @property
    def budget_bytes(self):
        return self.memory_bytes / (1.0 + self.margin)

    def quantized(self):
        """(A_q, R_q, fixed_q, budget_q): integer granules, usage rounded up, budget down."""
        g = self.granule
        A = np.ceil(self.mem_add / g - 1e-9).astype(np.int64)
        R = np.ceil(self.mem_runtime / g - 1e-9).astype(np.int64)
        fixed = int(math.ceil(self.mem_fixed / g - 1e-9))
        if math.isinf(self.memory_bytes):
            budget = None
        else:
            budget = int(math.floor(self.budget_bytes / g + 1e-9))
        return A, R, fixed, budget

    def index(self, degrees):
        try:
            return [self.degrees.index(int(d)) for d in degrees]
        except ValueError:
            raise OasesConfigError(
                f"plan uses a degree outside the candidates {self.degrees}: {list(degrees)}"
            ) from None

    def peak_memory_bytes(self, ks):
        ks = list(ks)
        rows = range(self.num_layers)
        return (
            self.mem_fixed
            + float(sum(self.mem_add[l, k] for l, k in zip(rows, ks)))
            + float(max(self.mem_runtime[l, k] for l, k in zip(rows, ks)))
        )

    def peak_memory_granules(self, ks):
        A, R, fixed, _ = self.quantized()
        rows = range(self.num_layers)
        return (
            fixed
            + int(sum(A[l, k] for l, k in zip(rows, ks)))
            + int(max(R[l, k] for l, k in zip(rows, ks)))
        )

    def switches(self, ks):
        return sum(1 for a, b in zip(ks, ks[1:]) if a != b)

    def feasible(self, ks):
        """Every constraint the solvers enforce: allowed degrees, switches, quantized memory."""
        if any(not self.allowed[l, k] for l, k in enumerate(ks)):
            return False
        if self.max_switches is not None and self.switches(ks) > self.max_switches:
            return False
        budget = self.quantized()[3]
        return budget is None or self.peak_memory_granules(ks) <= budget


# ====================================================================== evaluation (eq. 3, 4)
def _gather_if_grows(gather, ks, prev_layer, cur_layer):
    """All-gather seconds when the degree grows from ``prev_layer`` to ``cur_layer`` (processing
    order), else None. Degree indices are sorted ascending, so index order is degree order."""
    if prev_layer == cur_layer or ks[cur_layer] <= ks[prev_layer]:
        return None
    b = min(prev_layer, cur_layer)
    return float(gather[b, ks[b], ks[b + 1]])


def _segment_time(segment, ks, subs, gather, out):
    """Walk one segment (eq. 3 with eq. 4 at growing boundaries); accumulate per-layer
    [time, edge time] into ``out``; return (time, edge time)."""
    total = edge_total = 0.0
    last = len(segment) - 1
    for i, blk in enumerate(segment):
        k = ks[blk.layer]
        g = _gather_if_grows(gather, ks, segment[i - 1].layer, blk.layer) if i else None
        if subs == 1:
            t = blk.comp[0, k] + blk.comm[0, k]
            e = g or 0.0
        else:
            e = 0.0
            if i == 0:
                t = blk.comp[0, k]
            else:
                a, c = blk.comp[0, k], segment[i - 1].comm[1, ks[segment[i - 1].layer]]
                t = max(a, c)
                if g is not None:  # blocking all-gather: the overlap across the boundary is lost
                    e = g + min(a, c)
            t += max(blk.comp[1, k], blk.comm[0, k])
            if i == last:
                t += blk.comm[1, k]
        out[blk.layer][0] += t
        out[blk.layer][1] += e
        total += t
        edge_total += e
    return total, edge_total


def evaluate(problem, ks):
    """Per-iteration times for degree indices ``ks`` (one per layer): a dict of seconds and bytes.

    Direct implementation of eq. (3)–(4) walking the chains — independent of the solvers'
    unary/pairwise decomposition (:func:`decompose`), which the tests check against it.
    """
    L = problem.num_layers
    ks = list(ks)
    fwd_layers = [[0.0, 0.0] for _ in range(L)]
    bwd_layers = [[0.0, 0.0] for _ in range(L)]
    fwd = bwd = edges = 0.0
    for passes, gather, acc in (
        (problem.forward, problem.gather_fwd, fwd_layers),
        (problem.backward, problem.gather_bwd, bwd_layers),
    ):
        prev_last = None
        for seg in passes:
            t, e = _segment_time(seg, ks, problem.subs, gather, acc)
            if acc is fwd_layers:
                fwd += t
            else:
                bwd += t
            edges += e
            # A barrier between segments: a degree change across it still needs its gather.
            if prev_last is not None:
                g = _gather_if_grows(gather, ks, prev_last.layer, seg[0].layer)
                if g is not None:
                    acc[seg[0].layer][1] += g
                    edges += g
            prev_last = seg[-1]
    boundary = [float(problem.boundary[l, k]) for l, k in enumerate(ks)]
    edges += sum(boundary)
    fwd += problem.fixed_forward_s
    bwd += problem.fixed_backward_s
    r = problem.repeats
    sync = [float(problem.grad_sync[l, k]) for l, k in enumerate(ks)]
    grad_sync = sum(sync)
    per_iter = sum(float(problem.per_iteration[l, k]) for l, k in enumerate(ks))
    per_layer = []
    for l in range(L):
        per_layer.append(
            {
                "layer": l,
                "degree": problem.degrees[ks[l]],
                "forward_s": float(r * fwd_layers[l][0]),
                "backward_s": float(r * bwd_layers[l][0]),
                "edges_s": float(r * (fwd_layers[l][1] + bwd_layers[l][1] + boundary[l])),
                "grad_sync_s": sync[l],
                "replica_sync_s": float(problem.replica_sync[l, ks[l]]),
                "memory_bytes": float(problem.mem_add[l, ks[l]]),
            }
        )
    return {
        "iteration_time_s": float(r * (fwd + bwd + edges) + per_iter),
        "forward_s": float(r * fwd),
        "backward_s": float(r * bwd),
        "edges_s": float(r * edges),
        "grad_sync_s": float(grad_sync),
        "grad_sync_included": problem.include_grad_sync,
        "replica_sync_s": float(sum(problem.replica_sync[l, k] for l, k in enumerate(ks))),
        "peak_memory_bytes": problem.peak_memory_bytes(ks),
        "per_layer": per_layer,
    }


# ====================================================================== decomposition for solvers
def decompose(problem):
    """(U, P): unary (L, K) and pairwise (L-1, K, K) seconds per iteration with
    ``objective(ks) = Σ_l U[l, k_l] + Σ_l P[l, k_l, k_{l+1}]`` equal to ``evaluate``'s iteration time.
    """
    L, K = problem.num_layers, len(problem.degrees)
    U = np.zeros((L, K))
    P = np.zeros((max(L - 1, 0), K, K))
    kk = np.arange(K)

    for passes, gather in (
        (problem.forward, problem.gather_fwd),
        (problem.backward, problem.gather_bwd),
    ):
        prev_last = None
        for seg in passes:
            if prev_last is not None and prev_last.layer != seg[0].layer:
                _add_gather(P, gather, prev_last.layer, seg[0].layer, K)
            for i, blk in enumerate(seg):
                l = blk.layer
                if problem.subs == 1:
                    U[l] += blk.comp[0] + blk.comm[0]
                    if i > 0 and seg[i - 1].layer != l:
                        _add_gather(P, gather, seg[i - 1].layer, l, K)
                    continue
                U[l] += np.maximum(blk.comp[1], blk.comm[0])
                if i == 0:
                    U[l] += blk.comp[0]
                else:
                    prev = seg[i - 1]
                    if prev.layer == l:
                        U[l] += np.maximum(blk.comp[0], prev.comm[1])
                    else:
                        lp = prev.layer
                        # pair term over (k_prev, k_cur) oriented to (k_low_layer, k_high_layer)
                        c = prev.comm[1][:, None]  # indexed by k_prev
                        a = blk.comp[0][None, :]  # indexed by k_cur
                        grow = kk[None, :] > kk[:, None]  # k_cur > k_prev
                        b = min(lp, l)
                        g = gather[b] if lp < l else gather[b].T  # (k_prev, k_cur)
                        term = np.where(grow, c + a + g, np.maximum(a, c))
                        P[b] += term if lp < l else term.T
                if i == len(seg) - 1:
                    U[l] += blk.comm[1]
            prev_last = seg[-1]
    U += problem.boundary
    U[0] += problem.fixed_forward_s + problem.fixed_backward_s  # constant: same for every k
    U *= problem.repeats
    U += problem.per_iteration  # once per iteration, not per micro-batch
    return U, P * problem.repeats


def _add_gather(P, gather, lp, lc, K):
    """Blocking gather (no overlap lost) between layers lp → lc when the degree grows."""
    b = min(lp, lc)
    kk = np.arange(K)
    if lp < lc:
        grow = kk[None, :] > kk[:, None]  # (k_b, k_b+1): k_{b+1} > k_b
    else:
        grow = kk[:, None] > kk[None, :]  # processing b+1 → b: grows if k_b > k_{b+1}
    P[b] += np.where(grow, gather[b], 0.0)


def objective(U, P, ks):
    return float(
        sum(U[l, k] for l, k in enumerate(ks))
        + sum(P[l, ks[l], ks[l + 1]] for l in range(len(ks) - 1))
    )


# ====================================================================== building from a profile
def _subs(n, split):
    if not split:
        return [n]
    return [n - n // 2, n // 2]


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
):
    """A :class:`ChainProblem` for ``profile`` (:class:`~megatron_oases.formats.profile.Profile`).

    With pipeline parallelism (the profile's ``pipeline_model_parallel_size`` P > 1) the chain is
    one stage's ``num_layers / P`` layers (``num_layers``: the whole model's, default the
    profile's), costed for Megatron's 1F1B schedule: the iteration takes ``(M + P − 1)`` stage
    micro-batch times (pipeline bubble, M micro-batches), and pipeline ``stage`` s holds the saved
    activations of ``min(P − s, M)`` micro-batches at its peak (stage 0, the default, holds the
    most). Stage-to-stage p2p transfers are not modelled."""
    check_schedule(schedule, source="--schedule")
    if recompute is None:
        recompute = True
    check_schedule_recompute(schedule, recompute, flag="--schedule", fix="drop --no-recompute")
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
    split = schedule in SPLIT_SCHEDULES
    available = profile.degrees
    cand = sorted(int(d) for d in (degrees or available))
    for d in cand:
        if d not in available:
            raise OasesConfigError(
                f"TMP degree {d} is not in the profile (it has {available}); re-profile or drop it"
            )
    usable, why = [], []
    for d in cand:
        n = m * d / T
        if n != int(n) or n < (2 if split and not allow_unsplit else 1):
            why.append(
                f"degree {d} gives {n:g} samples per group per micro-batch"
                + (" (needs ≥ 2 to split; see allow_unsplit)" if split and n == 1 else "")
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
    sizes = {d: _subs(m * d // T, split) for d in degs}
    S = len(next(iter(sizes.values())))
    tab = {}
    for block in ("attention", "mlp"):
        for phase in ("forward_s", "recompute_s", "backward_s"):
            tab[block, phase] = np.array(
                [[comp(block, phase, d, sizes[d])[s] for d in degs] for s in range(S)]
            )
    ar = np.array(
        [[profile.all_reduce_time(tp_ranks(d), sizes[d][s] * hid) for d in degs] for s in range(S)]
    )

    def blk(layer, name, comp_arr, comm_arr):
        return Block(layer, name, comp_arr, comm_arr)

    F = {b: tab[b, "forward_s"] for b in ("attention", "mlp")}
    R = {b: tab[b, "recompute_s"] for b in ("attention", "mlp")}
    B = {b: tab[b, "backward_s"] for b in ("attention", "mlp")}

    forward = [[]]
    for l in range(L):
        forward[0].append(blk(l, "attention.F", F["attention"], ar))
        forward[0].append(blk(l, "mlp.F", F["mlp"], ar))

    backward = []
    if schedule == "oases":
        seg = []
        for l in reversed(range(L)):
            seg.append(blk(l, "mlp.R+B", R["mlp"] + B["mlp"], ar))
            seg.append(blk(l, "attention.R+B", R["attention"] + B["attention"], ar))
        backward = [seg]
    elif schedule in ("cross-pass", "off") or not recompute:
        seg = []
        for l in reversed(range(L)):
            if recompute:
                seg.append(blk(l, "attention.R", R["attention"], ar))
                seg.append(blk(l, "mlp.R", R["mlp"], ar))
            seg.append(blk(l, "mlp.B", B["mlp"], ar))
            seg.append(blk(l, "attention.B", B["attention"], ar))
        backward = [seg]
    else:  # overlap with recompute: recompute pass and backward pass per layer, barriers between
        for l in reversed(range(L)):
            backward.append(
                [blk(l, "attention.R", R["attention"], ar), blk(l, "mlp.R", R["mlp"], ar)]
            )
            backward.append(
                [blk(l, "mlp.B", B["mlp"], ar), blk(l, "attention.B", B["attention"], ar)]
            )

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

    # memory (bytes per rank)
    mem = profile.data["memory"]
    ckpt = mem["checkpoint_bytes_per_sample"]
    if distributed_optimizer:
        if "params_per_layer" not in mem or "bytes_per_param" not in mem:
            raise OasesConfigError(
                "this profile predates optimizer-state sharding; re-run oases profile"
            )
        wg = float(mem["bytes_per_param"]["weights_and_grads"])
        opt = float(mem["bytes_per_param"]["optimizer"])

    def state_bytes(d):
        """Parameters, gradients and Adam state per rank for one layer at degree d. With a
        distributed optimizer the optimizer state is sharded over the layer's D·T/d replicas."""
        if not distributed_optimizer:
            return profile.mem("state_bytes_per_layer", d)
        return profile.mem("params_per_layer", d) * (wg + opt / (D * T // d))

    parts = {k: np.zeros((L, K)) for k in ("state", "saved", "runtime")}
    for k, d in enumerate(degs):
        n = m * d // T
        act = profile.layer_memory("activation", d, n)
        peak = max(act, profile.layer_memory("runtime_peak", d, n))
        if not recompute:
            saved, runtime = act, peak - act
        elif schedule == "oases":
            # block-wise recomputation, one sub-batch at a time (R_j+B_j of sub-batch 0, then of
            # sub-batch 1): one block's activations of one sub-batch are live at a time
            saved = float(ckpt["block_inputs"]) * n
            runtime = profile.block_runtime_peak(d, -(-n // 2)) or peak
        else:
            saved, runtime = float(ckpt["layer_input"]) * n, peak
        if split and recompute:
            # the two sub-batches' backward passes interleave: one sub-batch's backward working
            # set (gradients in flight, weight-gradient temporaries) is live on top
            h = -(-n // 2)
            runtime += max(
                0.0,
                profile.layer_memory("runtime_peak", d, h)
                - profile.layer_memory("activation", d, h),
            )
        parts["state"][:, k] = state_bytes(d)
        parts["saved"][:, k] = saved * in_flight
        parts["runtime"][:, k] = runtime
    mem_add = parts["state"] + parts["saved"]
    mem_rt = parts["runtime"]
    if distributed_optimizer:
        fixed_state = float(mem["fixed_params"]) * (wg + opt / D)
    else:
        fixed_state = profile.mem("fixed_state_bytes")
    fixed_parts = {
        "fixed_state": fixed_state,
        "fixed_activations": profile.mem("fixed_activation_bytes_per_sample") * m,
        "overhead": profile.mem("overhead_bytes"),
    }
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
    edge_ar = profile.all_reduce_time(tp_ranks(T), m * hid)
    fixed_fwd = profile.fixed_compute("forward") * m + edge_ar
    fixed_bwd = profile.fixed_compute("backward") * m + edge_ar

    sync = np.zeros((L, K))
    sync_available = True
    for k, d in enumerate(degs):
        t = profile.grad_sync_time(d)
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
        subs=2 if split else 1,
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
            "recompute": bool(recompute),
            "tensor_model_parallel_size": T,
            "data_parallel_size": D,
            "global_batch_size": int(global_batch_size),
            "micro_batch_size": m,
            "num_microbatches": microbatches,
            "pipeline_model_parallel_size": pp,
            "pipeline_stage": stage,
            "in_flight_microbatches": in_flight,
            "total_layers": total_layers,
            "excluded_degrees": why,
            "unsplit_degrees": [d for d in degs if split and m * d // T < 2],
            "distributed_optimizer": bool(distributed_optimizer),
            "memory_parts": parts,
            "fixed_memory_parts": fixed_parts,
        },
    )


def memory_breakdown(problem, ks):
    """Peak-memory components in bytes per rank (no margin): fixed parts, Σ layer state, Σ saved
    activations, the runtime peak of the worst layer and which layer it is."""
    parts = problem.meta.get("memory_parts")
    out = dict(problem.meta.get("fixed_memory_parts", {"fixed": problem.mem_fixed}))
    rows = list(enumerate(ks))
    if parts is None:
        out["layers"] = float(sum(problem.mem_add[l, k] for l, k in rows))
    else:
        out["layer_state"] = float(sum(parts["state"][l, k] for l, k in rows))
        out["saved_activations"] = float(sum(parts["saved"][l, k] for l, k in rows))
    worst = max(rows, key=lambda lk: problem.mem_runtime[lk[0], lk[1]])
    out["runtime_peak_layer"] = float(problem.mem_runtime[worst])
    out["runtime_peak_at_layer"] = int(worst[0])
    out["total"] = problem.peak_memory_bytes(ks)
    return out


def predict(profile, degrees, schedule="oases", global_batch=None, micro_batch=None, **kwargs):
    """Predicted iteration of a per-layer degree list under ``schedule``.

    Returns ``{iteration_time_s, forward_s, backward_s, edges_s, peak_memory_bytes, per_layer,
    memory_breakdown_bytes}`` (seconds per iteration; bytes per rank *without* the safety margin;
    the breakdown separates parameter/optimizer state from saved activations, the worst layer's
    backward working set, logits and framework overhead). ``profile`` is a Profile
    or a path. Extra keyword arguments go to :func:`build_problem` (``recompute``, ...).
    With pipeline parallelism ``degrees`` covers every layer; each stage's slice is costed on its
    own (times of the slowest stage, memory of the fullest, and ``stages``: both per stage).
    """
    from ..formats.profile import Profile, load_profile

    if not isinstance(profile, Profile):
        profile = load_profile(profile)
    if global_batch is None:
        raise OasesConfigError("predict needs global_batch")
    degrees = [int(d) for d in degrees]
    pp = int(profile.data.get("pipeline_model_parallel_size", 1))
    if len(degrees) % pp:
        raise OasesConfigError(
            f"{len(degrees)} layer degrees do not split evenly over {pp} pipeline stages"
        )
    per_stage = len(degrees) // pp
    stages = []
    for stage in range(pp):
        problem = build_problem(
            profile,
            schedule=schedule,
            global_batch_size=global_batch,
            micro_batch_size=micro_batch,
            degrees=sorted(set(degrees)),
            num_layers=len(degrees),
            stage=stage,
            **kwargs,
        )
        ks = problem.index(degrees[stage * per_stage : (stage + 1) * per_stage])
        out = evaluate(problem, ks)
        out["memory_breakdown_bytes"] = memory_breakdown(problem, ks)
        stages.append(out)
    # 1F1B runs at the pace of the slowest stage; memory binds on the fullest one
    out = dict(max(stages, key=lambda o: o["iteration_time_s"]))
    fullest = max(stages, key=lambda o: o["peak_memory_bytes"])
    out["peak_memory_bytes"] = fullest["peak_memory_bytes"]
    out["memory_breakdown_bytes"] = fullest["memory_breakdown_bytes"]
    if pp > 1:
        out["stages"] = [
            {k: o[k] for k in ("iteration_time_s", "peak_memory_bytes", "memory_breakdown_bytes")}
            for o in stages
        ]
    return out


def enumerate_assignments(problem):
    K = len(problem.degrees)
    choices = [[k for k in range(K) if problem.allowed[l, k]] for l in range(problem.num_layers)]
    return itertools.product(*choices)
