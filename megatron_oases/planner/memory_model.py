"""Memory model of the Oases paper (eq. 6, TP-aware): per-layer memory terms and the breakdown.

Peak memory per rank is ``fixed state + Σ_l [state(d_l) + saved(d_l, n_l)] + max_l runtime(d_l,
n_l) + fixed activations·m + overhead``, where ``saved`` is the layer input (Megatron full
recompute), the two block inputs (``oases`` fine-grained recompute) or all activations (no
recompute), and ``runtime`` is the forward+backward peak of what is recomputed at once — the whole
layer, or for ``oases`` the larger block of one sub-batch — measured at the group's sample count
``n_l`` (not a per-sample value times ``n_l``: weight-gradient temporaries do not grow with the
batch). Split schedules with recomputation add one sub-batch's backward working set (peak −
activations at ``⌈n_l/2⌉``): the two sub-batches' backward passes interleave. The constraint is
``peak × (1 + margin) ≤ memory`` (:class:`~.problem.ChainProblem`).

Separate from :mod:`.build` (which also costs time) because these terms read only the profile's
memory section, and :func:`memory_breakdown` explains a plan's peak from them.
"""

import numpy as np

from ..errors import OasesConfigError
from ..validation import SPLIT_SCHEDULES


def memory_parts(
    profile, degs, *, num_layers, micro_batch, schedule, recompute, in_flight, distributed_optimizer
):
    """Eq. (6)'s terms in bytes per rank for candidate degrees ``degs``: ``(parts, fixed_parts)``
    with ``parts[name]`` an (L, K) array for ``state`` and ``saved`` (additive over layers) and
    ``runtime`` (max over layers), and ``fixed_parts`` the degree-independent bytes. ``in_flight``
    micro-batches keep their saved activations alive (1F1B)."""
    T, D = profile.tp, profile.dp
    L, K, m = num_layers, len(degs), micro_batch
    split = schedule in SPLIT_SCHEDULES
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
    if distributed_optimizer:
        fixed_state = float(mem["fixed_params"]) * (wg + opt / D)
    else:
        fixed_state = profile.mem("fixed_state_bytes")
    fixed_parts = {
        "fixed_state": fixed_state,
        "fixed_activations": profile.mem("fixed_activation_bytes_per_sample") * m,
        "overhead": profile.mem("overhead_bytes"),
    }
    return parts, fixed_parts


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
