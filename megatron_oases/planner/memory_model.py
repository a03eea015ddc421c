"""Memory model of the Oases paper (eq. 6, TP-aware): per-layer memory terms and the breakdown.

Peak memory per rank is ``fixed state + Σ_l [state(d_l) + saved(d_l, n_l)] + max_l runtime(d_l,
n_l) + fixed activations·m + overhead``, where ``saved`` is the layer input (Megatron full
recompute), the two block inputs (``oases`` fine-grained recompute) or all activations (no
recompute), and ``runtime`` is the forward+backward peak of what is recomputed at once — the whole
layer, or for ``oases`` the larger block of one sub-batch — measured at the group's sample count
``n_l`` (not a per-sample value times ``n_l``: weight-gradient temporaries do not grow with the
batch). Split schedules with full recomputation add one sub-batch's backward working set (peak −
activations at ``⌈n_l/2⌉``): the two sub-batches' backward passes interleave. The constraint is
``peak × (1 + margin) ≤ memory`` (:class:`~.problem.ChainProblem`).

Selective recomputation of core attention (``recompute="selective"``; ``off``/``overlap``) saves
what no recompute saves minus core attention's intermediates ``c(d_l, n_l)`` (softmax output,
attention-dropout mask and output: Korthikanti et al.'s ``5·a·s²·b/t`` of ``34·s·b·h/t +
5·a·s²·b/t``, measured or counted: the profile's ``core_attention_activation``), and the layer
being back-propagated holds them again (recomputed): ``saved = act − c``, ``runtime = peak − act +
c``. Core attention is inside the column→row span, so SP does not change ``c``. ``selective+ln``
(``--recompute-modules core_attn layernorm``) also drops the two norms' outputs, each the size of
the layer input (``s/d`` under SP), and the block being back-propagated holds one again.

Megatron's ``--recompute-method block --recompute-num-layers N`` (``recompute_layers=N`` with
``full``): the stage's first N layers take full recompute's terms, the others no recompute's;
a recomputed layer's runtime term is lowered by what the kept layers have freed when backward
reaches it (the least that any of their degrees would free, so the bound stays safe).

Under sequence parallelism (SP) checkpoints are ``s/d`` (layer input, block inputs ÷ d) and the
profile's ``memory.sequence_parallel`` savings (the sequence-long tensors outside the column→row
span, now ``s/d``) come off the activations and the backward working set. The overlapped schedules
keep a block's all-gathered column input for its weight gradient instead of re-gathering it (stock
does): ``g = hidden·(1 − 1/d)`` per sample more, for every block without recompute (saved), for
the recomputed layer's two blocks (cross-pass/overlap) or the one recomputed block (``oases``) in
the runtime term.

Sequence chunks (``split="sequence"``): a chunk holds all ``n`` samples over half the tokens, so
its working set is that of ``n/2`` samples (the later chunk's scores, (s/2)×s, are half a sample's
square); the two chunks' saved core-attention bytes are 1/4 + 1/2 of stock's square, and the two
chunks' backward working sets interleave (``2 × working set(n/2)``). Under full recomputation the
earlier chunk's keys and values are kept from forward for the later chunk's attention
(:func:`~megatron_oases.formats.profile.key_value_bytes` × n/2).

Sharded data parallelism (``sharding``: torch FSDP2 or a Megatron-FSDP strategy): each layer's
and the fixed parameters' state is what the strategy keeps per rank, plus its gathered units
(:mod:`.sharding`, where those rules live).

Separate from :mod:`.build` (which also costs time) because these terms read only the profile's
memory section, and :func:`memory_breakdown` explains a plan's peak from them.
"""

import numpy as np

from ..errors import OasesConfigError
from ..formats.profile import key_value_bytes
from ..recompute_settings import SELECTIVE_MODES
from ..validation import SPLIT_SCHEDULES, samples_per_group
from .sharding import bytes_per_param, gathered_fixed_bytes, gathered_layer_bytes


def memory_parts(
    profile,
    degs,
    *,
    num_layers,
    micro_batch,
    schedule,
    recompute,
    in_flight,
    distributed_optimizer,
    sequence_parallel=False,
    recompute_layers=None,
    split="batch",
    sharding=None,
):
    """Eq. (6)'s terms in bytes per rank for candidate degrees ``degs``: ``(parts, fixed_parts)``
    with ``parts[name]`` an (L, K) array for ``state`` and ``saved`` (additive over layers) and
    ``runtime`` (max over layers), and ``fixed_parts`` the degree-independent bytes. ``in_flight``
    micro-batches keep their saved activations alive (1F1B); ``recompute``: ``"none"``,
    ``"selective"``, ``"selective+ln"`` or ``"full"``; ``sequence_parallel``: SP-sized terms (module docstring);
    ``recompute_layers``: with ``full``, only the first that many layers are recomputed (block);
    ``split``: ``"sequence"`` for sub-batches of sequence chunks (module docstring);
    ``sharding``: a data-parallel sharding strategy's name (:mod:`.sharding`: its state and
    gathered units), None for none.
    """
    if recompute == "full" and recompute_layers is not None and recompute_layers < num_layers:
        kw = dict(
            num_layers=num_layers,
            micro_batch=micro_batch,
            schedule=schedule,
            in_flight=in_flight,
            distributed_optimizer=distributed_optimizer,
            sequence_parallel=sequence_parallel,
            split=split,
            sharding=sharding,
        )
        parts, fixed_parts = memory_parts(profile, degs, recompute="full", **kw)
        kept, _ = memory_parts(profile, degs, recompute="none", **kw)
        n = recompute_layers
        for name in parts:
            parts[name][n:] = kept[name][n:]
        # Backward reaches the recomputed layers after the kept ones: the micro-batch being
        # back-propagated has freed its kept layers' activations by then, except (split
        # schedules) the other sub-batch's, which may still be back-propagating one of them.
        # Their degrees are not known here: take off the least any degree frees.
        freed_layers = num_layers - n - (1 if schedule in SPLIT_SCHEDULES else 0)
        freed = freed_layers * kept["saved"][n:].min() / in_flight if freed_layers > 0 else 0.0
        parts["runtime"][:n] = np.maximum(parts["runtime"][:n] - freed, 0.0)
        return parts, fixed_parts
    T, D = profile.tp, profile.dp
    L, K, m = num_layers, len(degs), micro_batch
    halves = schedule in SPLIT_SCHEDULES  # each micro-batch runs as two sub-batches
    chunks = halves and split == "sequence"
    mem = profile.data["memory"]
    ckpt = mem["checkpoint_bytes_per_sample"]
    if distributed_optimizer or sharding:
        if "params_per_layer" not in mem or "bytes_per_param" not in mem:
            raise OasesConfigError(
                "this profile predates optimizer-state sharding; re-run oases profile"
            )
        wg = float(mem["bytes_per_param"]["weights_and_grads"])
        opt = float(mem["bytes_per_param"]["optimizer"])

    def state_bytes(d):
        """Parameters, gradients and Adam state per rank for one layer at degree d. With a
        distributed optimizer the optimizer state is sharded over the layer's D·T/d replicas;
        with a sharding strategy what it shards (:mod:`.sharding`), plus, under the split
        schedules, the layer's gathered parameters and unsharded gradients."""
        if sharding:
            params = profile.mem("params_per_layer", d)
            per_param = bytes_per_param(sharding, wg, opt, profile.dtype_bytes, D * T // d)
            gathered, _ = gathered_layer_bytes(sharding, params, profile.dtype_bytes, schedule, L)
            return params * per_param + gathered
        if not distributed_optimizer:
            return profile.mem("state_bytes_per_layer", d)
        return profile.mem("params_per_layer", d) * (wg + opt / (D * T // d))

    parts = {k: np.zeros((L, K)) for k in ("state", "saved", "runtime")}
    for k, d in enumerate(degs):
        n = samples_per_group(m, d, T)
        sp = _SequenceParallel(profile, d, sequence_parallel)
        # one sub-batch: half the samples, or (sequence chunks) all samples over half the tokens,
        # which costs half the samples' bytes except in core attention (below)
        h = n / 2 if chunks else -(-n // 2)
        act = sp.activation(n)
        transient = max(0.0, sp.runtime_peak(n) - act)
        core_saved = core_live = min(act, profile.core_attention_activation(d, n))
        kv_kept = 0.0
        if chunks:
            # chunk c's scores are (s/2)×((c+1)·s/2): 1/4 and 1/2 of the s×s square stock
            # computes; the later chunk's half is what its backward holds. Two chunks' backward
            # working sets interleave; the earlier chunk's keys and values outlive its forward.
            act -= core_live / 4
            core_saved, core_live = core_live * 3 / 4, core_live / 2
            transient = 2 * max(0.0, sp.runtime_peak(h) - sp.activation(h))
            kv_kept = key_value_bytes(profile.shape, d, profile.dtype_bytes) * n / 2
        peak = act + transient
        if recompute in ("none",) + SELECTIVE_MODES:
            # core attention's intermediates, recomputed in backward: off the saved activations,
            # back in the working set of the layer being back-propagated (one chunk's at a time)
            core = norms = 0.0
            if recompute in SELECTIVE_MODES:
                core = core_saved
            if recompute == "selective+ln":  # the two norms' outputs, one live again in backward
                norms = 2 * float(ckpt["layer_input"]) / sp.divisor * n
            # the overlapped schedules' per-block graphs hold each gathered column input
            saved = act - core - norms + (2 * sp.gathered * n if halves else 0.0)
            runtime = transient + (core_live if core else 0.0) + norms / 2
        elif schedule == "oases":
            # block-wise recomputation, one sub-batch at a time (R_j+B_j of sub-batch 0, then of
            # sub-batch 1): one block's activations of one sub-batch are live at a time
            saved = float(ckpt["block_inputs"]) / sp.divisor * n + kv_kept
            runtime = sp.block_runtime_peak(h) or peak
            runtime += sp.gathered * n
        else:
            saved = float(ckpt["layer_input"]) / sp.divisor * n + kv_kept
            runtime = peak + (2 * sp.gathered * n if halves else 0.0)
        if halves and recompute == "full" and (schedule == "oases" or not chunks):
            # the two sub-batches' backward passes interleave: one sub-batch's backward working
            # set (gradients in flight, weight-gradient temporaries) is live on top (chunks:
            # already in the layer's working set above, except under block-wise recomputation)
            runtime += max(0.0, sp.runtime_peak(h) - sp.activation(h))
        if sharding:  # the units being gathered and reduced around the running layer
            params = profile.mem("params_per_layer", d)
            runtime += gathered_layer_bytes(sharding, params, profile.dtype_bytes, schedule, L)[1]
        parts["state"][:, k] = state_bytes(d)
        parts["saved"][:, k] = saved * in_flight
        parts["runtime"][:, k] = runtime
    if sharding:
        fixed = float(mem["fixed_params"])
        fixed_state = fixed * bytes_per_param(sharding, wg, opt, profile.dtype_bytes, D)
        fixed_state += gathered_fixed_bytes(sharding, fixed, profile.dtype_bytes)
    elif distributed_optimizer:
        fixed_state = float(mem["fixed_params"]) * (wg + opt / D)
    else:
        fixed_state = profile.mem("fixed_state_bytes")
    fixed_parts = {
        "fixed_state": fixed_state,
        "fixed_activations": profile.mem("fixed_activation_bytes_per_sample") * m,
        "overhead": profile.mem("overhead_bytes"),
    }
    return parts, fixed_parts


class _SequenceParallel:
    """A layer's memory at degree ``d``, with SP's savings applied when ``enabled`` (all zero
    and ``divisor`` 1 without SP)."""

    def __init__(self, profile, d, enabled):
        def per_sample(key):
            return profile.sp_memory(key, d) if enabled else 0.0

        self.profile, self.d, self.divisor = profile, d, d if enabled else 1
        self.act_saving = per_sample("activation_saving_bytes_per_sample")
        self.peak_saving = self.act_saving + per_sample("transient_saving_bytes_per_sample")
        self.gathered = per_sample("gathered_input_bytes_per_sample")

    def activation(self, n):
        return max(0.0, self.profile.layer_memory("activation", self.d, n) - self.act_saving * n)

    def runtime_peak(self, n):
        return max(0.0, self.profile.layer_memory("runtime_peak", self.d, n) - self.peak_saving * n)

    def block_runtime_peak(self, n):
        """The larger block's peak (measured profiles), with half the layer's SP saving."""
        peak = self.profile.block_runtime_peak(self.d, n)
        return None if peak is None else max(0.0, peak - self.peak_saving * n / 2)


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
