"""The profile file (``oases profile --out profile.json``) and its reader.

A profile describes one transformer layer (all layers of a GPT model are alike) for every candidate
TMP degree ``d`` (powers of two up to the TMP domain ``T``)::

    {
      "version": 1, "kind": "analytic" | "measured",
      "model": {shape fields, "name"}, "tensor_model_parallel_size": T, "data_parallel_size": D,
      "degrees": [1, 2, 4], "dtype_bytes": 2, "state_bytes_per_param": 18,
      "cluster": "rtx3090-pcie" | null, "hardware": {fingerprint}, "cache_key": "...",
      "compute": {                      # seconds per rank, keyed by samples per (sub-)batch
        "attention": {"4": {"forward_s": [[n, t], ...], "recompute_s": [...], "backward_s": [...],
                            "core_attention_forward_s": [...]}},  # optional (measured)
        "mlp": {...}},
      "fixed_compute": {"forward_s_per_sample": t, "backward_s_per_sample": t},  # output layer
      "grad_sync": {"bytes_per_layer": {"4": b}, "all_reduce": {"4": {α, β}}},  # DP, optional
      "comm": {                         # ring α–β fits, keyed by the group's ranks inside the domain
        "all_reduce": {"0,1,2,3": {"alpha_s": a, "beta_s_per_byte": b, "points": [[bytes, t]]}},
        "all_gather": {"0,2": {...}},   # all-gather: bytes = gathered output per rank
        "reduce_scatter": {"0,1": {...}}},  # SP only: bytes = the full (unscattered) input
      "memory": {
        "state_bytes_per_layer": {"4": bytes},   # params + grads + optimizer state, per rank
        "params_per_layer": {"4": n}, "fixed_params": n,  # parameters per rank
        "bytes_per_param": {"weights_and_grads": 6, "optimizer": 12},
        "fixed_state_bytes": bytes,              # embeddings, final norm (at T), per rank
        "layer_activation_bytes_per_sample": {"4": bytes},  # saved by a layer forward, no recompute
        "checkpoint_bytes_per_sample": {"layer_input": b, "block_inputs": b},
        "backward_transient_bytes_per_sample": {"4": bytes},
        "core_attention_activation_bytes_per_sample": {"4": bytes},  # optional, see below
        "core_attention_activation_bytes": {"4": [[n, bytes], ...]},  # optional (measured)
        "fixed_activation_bytes_per_sample": bytes,  # logits/loss at T, per sample of the micro-batch
        "overhead_bytes": bytes,                 # framework/context constant
        "sequence_parallel": {                   # SP only, per degree > 1, bytes per sample
          "activation_saving_bytes_per_sample": {"4": b},  # saved activations SP removes
          "transient_saving_bytes_per_sample": {"4": b},   # backward working set SP removes
          "gathered_input_bytes_per_sample": {"4": b}}},   # one block's gathered input − its shard
      "sequence_parallel": true | false   # made with --sequence-parallel (absent: false)
    }

Sequence-parallel data (``--sequence-parallel``) is an optional extension of version 1: a profile
without it still loads, and :meth:`Profile.require_sequence_parallel` names the fix when SP is
planned with it. Under SP the all-gather and reduce-scatter of a TMP group are keyed by its ranks
``0..d-1``, like its all-reduce.

Core attention (QKᵀ, softmax, attention dropout, ·V) is what Megatron's selective recomputation
(``--recompute-granularity selective --recompute-modules core_attn``) recomputes in backward:
``core_attention_activation_bytes*`` is the part of a layer's saved activations it no longer keeps
and ``core_attention_forward_s`` the forward it runs again. Both are optional extensions of
version 1 (profiles made before them still load): :meth:`Profile.core_attention_activation` and
:meth:`Profile.core_attention_time` then count them from the model shape
(:func:`core_attention_activation_bytes`, :func:`attention_flops_forward`).

Degree ``d`` groups are the contiguous ranks ``[0, d)`` of the domain; a re-shard from degree ``d1``
to ``d2 > d1`` all-gathers over ranks ``0, d1, 2·d1, …`` (``d2/d1`` of them).
"""

import bisect
import hashlib
import json

from ..errors import OasesConfigError
from . import (
    RANGES,
    count_fault,
    is_finite,
    is_number,
    number_fault,
    quote,
    read_json,
    write_atomic,
)

PROFILE_VERSION = 1
PHASES = ("forward_s", "recompute_s", "backward_s")


def ranks_key(ranks):
    return ",".join(str(int(r)) for r in ranks)


def tp_ranks(degree):
    return list(range(degree))


def gather_ranks(d_small, d_large):
    return list(range(0, d_large, d_small))


def interpolate(points, x):
    """Piecewise-linear through ``points`` ([[x, y], ...]); linear extrapolation at both ends."""
    pts = sorted((float(a), float(b)) for a, b in points)
    if not pts:
        raise ValueError("no points")
    if len(pts) == 1:
        x0, y0 = pts[0]
        return y0 * x / x0 if x0 else y0
    xs = [p[0] for p in pts]
    i = bisect.bisect_left(xs, x)
    if i < len(xs) and xs[i] == x:
        return pts[i][1]
    i = min(max(i, 1), len(pts) - 1)
    (x0, y0), (x1, y1) = pts[i - 1], pts[i]
    return max(0.0, y0 + (y1 - y0) * (x - x0) / (x1 - x0))


def canonical_json(obj):
    return json.dumps(obj, sort_keys=True, separators=(",", ":"))


def sha256_of(obj):
    return hashlib.sha256(canonical_json(obj).encode()).hexdigest()


# ---------------------------------------------------------------------- core attention, by shape
#: FLOPs per attention score of the softmax (scale, subtract the max, exp, sum, divide).
SOFTMAX_FLOPS_PER_SCORE = 5


def _attention_dims(shape):
    """(s, h, a, g, kv): sequence, hidden, heads, query groups, channels per head."""
    h, a = shape["hidden_size"], shape["num_attention_heads"]
    g = shape.get("num_query_groups") or a
    kv = shape.get("kv_channels") or h // a
    return shape["seq_length"], h, a, g, kv


def attention_flops_forward(shape, degree):
    """Forward FLOPs of one attention block per rank per sample at TMP ``degree``, by part:
    ``qkv`` and ``proj`` (the GEMMs), ``core`` (QKᵀ and ·V, the full s×s square; ``4·s²·h/t``
    with ``a·kv = h``) and ``softmax`` (:data:`SOFTMAX_FLOPS_PER_SCORE` per score). The profiler's
    block FLOPs are ``qkv + core + proj`` (:mod:`megatron_oases.profiler.layer_math`)."""
    s, h, a, g, kv = _attention_dims(shape)
    return {
        "qkv": 2 * s * h * kv * (a + 2 * g) / degree,
        "core": 2 * 2 * s * s * kv * a / degree,
        "softmax": SOFTMAX_FLOPS_PER_SCORE * a * s * s / degree,
        "proj": 2 * s * kv * a * h / degree,
    }


def key_value_bytes(shape, degree, dtype_bytes):
    """Bytes per rank per sample of one layer's keys and values (``2·s·g·kv/t``): what a
    sequence chunk keeps from forward for the later chunks' attention."""
    s, h, a, g, kv = _attention_dims(shape)
    return 2 * s * g * kv * dtype_bytes / degree


def core_attention_activation_bytes(shape, degree, dtype_bytes):
    """Bytes per rank per sample of core attention's intermediates kept for backward (no
    recompute): the softmax output and, with attention dropout, its mask (1 byte) and output —
    Korthikanti et al.'s ``5·a·s²·b/t`` at fp16 with dropout. Selective recomputation drops them;
    its checkpoint keeps Q, K, V, which a layer saves either way."""
    s, h, a, g, kv = _attention_dims(shape)
    dropout = 1 if shape.get("attention_dropout", 0.0) > 0 else 0
    return (dtype_bytes * a * s * s + dropout * (a * s * s + dtype_bytes * a * s * s)) / degree


class Profile:
    """Read access to a profile dict (see module docstring)."""

    def __init__(self, data, path=None):
        self.data = data
        self.path = path
        self._check()

    # ------------------------------------------------------------------ basics
    def _check(self):
        d = self.data
        where = self.path or "profile"
        if not isinstance(d, dict) or d.get("version") != PROFILE_VERSION:
            raise OasesConfigError(
                f"{where}: not an oases profile (version {PROFILE_VERSION}); "
                "create one with `oases profile`"
            )
        for key in ("model", "tensor_model_parallel_size", "degrees", "compute", "comm", "memory"):
            if key not in d:
                raise OasesConfigError(f"{where}: missing key {key!r}")
        check_profile_types(d, where)

    @property
    def shape(self):
        return self.data["model"]

    @property
    def num_layers(self):
        return int(self.shape["num_layers"])

    @property
    def tp(self):
        return int(self.data["tensor_model_parallel_size"])

    @property
    def dp(self):
        return int(self.data.get("data_parallel_size", 1))

    @property
    def degrees(self):
        return [int(x) for x in self.data["degrees"]]

    @property
    def dtype_bytes(self):
        return int(self.data.get("dtype_bytes", 2))

    @property
    def sha256(self):
        return sha256_of(self.data)

    # ------------------------------------------------------------------ costs
    def compute_time(self, block, phase, degree, samples):
        try:
            pts = self.data["compute"][block][str(degree)][phase]
        except KeyError:
            raise OasesConfigError(
                f"profile has no {block} {phase} time for TMP degree {degree}; re-run oases profile "
                "with that degree"
            ) from None
        return interpolate(pts, samples)

    def _comm(self, kind, ranks, nbytes):
        if len(ranks) <= 1 or nbytes <= 0:
            return 0.0
        key = ranks_key(ranks)
        fit = self.data["comm"].get(kind, {}).get(key)
        if fit is None:
            raise OasesConfigError(
                f"profile has no {kind} fit for ranks [{key}]; re-run oases profile with the "
                "degrees you plan with"
            )
        return float(fit["alpha_s"]) + float(fit["beta_s_per_byte"]) * nbytes

    def all_reduce_time(self, ranks, nbytes):
        return self._comm("all_reduce", ranks, nbytes)

    def all_gather_time(self, ranks, nbytes_out):
        return self._comm("all_gather", ranks, nbytes_out)

    def reduce_scatter_time(self, ranks, nbytes_in):
        return self._comm("reduce_scatter", ranks, nbytes_in)

    @property
    def sequence_parallel(self):
        return bool(self.data.get("sequence_parallel")) and "sequence_parallel" in self.data.get(
            "memory", {}
        )

    def require_sequence_parallel(self):
        """One line naming the fix when a profile lacks SP data (older or made without SP)."""
        if not self.sequence_parallel:
            raise OasesConfigError(
                f"{self.path or 'profile'} has no sequence-parallel data (all-gather/"
                "reduce-scatter timings, SP memory); re-create it with `oases profile ... "
                "--sequence-parallel`"
            )

    def sp_memory(self, key, degree):
        """Bytes per sample of ``memory.sequence_parallel[key]`` at ``degree`` (0 at degree 1)."""
        if degree == 1:
            return 0.0
        value = self.data["memory"]["sequence_parallel"][key].get(str(degree))
        if value is None:
            raise OasesConfigError(
                f"profile has no sequence-parallel memory entry {key!r} for TMP degree {degree}"
            )
        return float(value)

    def fixed_compute(self, phase):
        """Seconds per sample outside the layers (output layer), 0 when the profile lacks it."""
        return float(self.data.get("fixed_compute", {}).get(f"{phase}_s_per_sample", 0.0))

    def pipeline_p2p_time(self, nbytes):
        """One stage-to-stage send of ``nbytes`` (0 when the profile has no ``pipeline_p2p`` fit:
        a measured profile, or one stage)."""
        fit = self.data.get("pipeline_p2p")
        if not fit:
            return 0.0
        return float(fit["alpha_s"]) + float(fit["beta_s_per_byte"]) * nbytes

    def grad_sync_time(self, degree, distributed_optimizer=False):
        """Data-parallel gradient sync of one layer at ``degree`` (None: not in profile): the
        all-reduce of its gradients, or with ``distributed_optimizer`` (ZeRO-1) the reduce-scatter
        of its gradients plus the all-gather of its updated parameters over the same replicas."""
        gs, key = self.data.get("grad_sync"), str(degree)
        fit = gs and gs.get("reduce_scatter" if distributed_optimizer else "all_reduce", {}).get(
            key
        )
        if not fit:
            return None
        nbytes = float(gs["bytes_per_layer"][key])
        if distributed_optimizer:  # two collectives: the gradients out, the parameters back
            nbytes += float(gs["param_bytes_per_layer"][key])
        hops = 2 if distributed_optimizer else 1
        return hops * float(fit["alpha_s"]) + float(fit["beta_s_per_byte"]) * nbytes

    def layer_memory(self, kind, degree, samples):
        """Bytes of one layer at ``degree`` for ``samples`` samples per group: ``kind`` is
        ``"activation"`` (saved for backward) or ``"runtime_peak"`` (forward+backward peak).
        Measured profiles hold the value at each sample count in play (interpolated); analytic
        ones a per-sample value."""
        points = self.data["memory"].get(f"layer_{kind}_bytes", {}).get(str(degree))
        if points:
            return interpolate(points, samples)
        if kind == "activation":
            return self.mem("layer_activation_bytes_per_sample", degree) * samples
        return (
            self.mem("layer_activation_bytes_per_sample", degree)
            + self.mem("backward_transient_bytes_per_sample", degree)
        ) * samples

    def core_attention_activation(self, degree, samples):
        """Bytes of one layer's core-attention intermediates at ``degree`` for ``samples`` samples
        per group (what selective recomputation does not keep): measured at the sample counts in
        play, a per-sample count, or — profiles made before the field — counted from the shape
        (:func:`core_attention_activation_bytes`)."""
        mem = self.data["memory"]
        points = mem.get("core_attention_activation_bytes", {}).get(str(degree))
        if points:
            return interpolate(points, samples)
        per_sample = mem.get("core_attention_activation_bytes_per_sample", {}).get(str(degree))
        if per_sample is None:
            per_sample = core_attention_activation_bytes(self.shape, degree, self.dtype_bytes)
        return float(per_sample) * samples

    def core_attention_time(self, degree, samples):
        """Seconds of one core-attention forward (what selective recomputation runs again in
        backward) at ``degree`` for ``samples`` samples: measured (``core_attention_forward_s``)
        or, when the profile lacks it (analytic profiles, profiles made before the field), the
        attention block's forward time × core attention's share of the block's forward FLOPs
        (QKᵀ, ·V and the softmax; :func:`attention_flops_forward`)."""
        points = self.data["compute"].get("attention", {}).get(str(degree), {})
        points = points.get("core_attention_forward_s")
        if points:
            return interpolate(points, samples)
        f = attention_flops_forward(self.shape, degree)
        share = (f["core"] + f["softmax"]) / sum(f.values())
        return share * self.compute_time("attention", "forward_s", degree, samples)

    def block_runtime_peak(self, degree, samples):
        """The larger block's forward+backward peak (what block-wise recomputation holds), or None
        when the profile has no per-block measurement (analytic profiles)."""
        blocks = self.data["memory"].get("block_runtime_peak_bytes") or {}
        points = [b.get(str(degree)) for b in blocks.values()]
        if not points or not all(points):
            return None
        return max(interpolate(p, samples) for p in points)

    def mem(self, key, degree=None):
        value = self.data["memory"][key]
        if degree is not None:
            try:
                value = value[str(degree)]
            except KeyError:
                raise OasesConfigError(
                    f"profile has no memory entry {key!r} for TMP degree {degree}"
                ) from None
        return float(value)


def _number(x):
    """A finite number (JSON spells NaN and infinity too: a profile holding them planned
    "peak memory inf GB" and negative iterations) that a float holds."""
    return is_finite(x)


def _positive_int(x):
    return count_fault(x) is None


def _points_fault(x, xs, ys):
    """None when ``x`` is ``[[x, y], ...]``, non-empty, every ``x`` positive (samples or bytes,
    the one rule's kind ``bytes``) and every ``y`` of kind ``ys`` (seconds or bytes); else what it
    must be."""
    ok = isinstance(x, list) and bool(x)
    ok = ok and all(
        isinstance(p, list)
        and len(p) == 2
        and number_fault(p[0], "bytes", positive=True) is None
        and number_fault(p[1], ys) is None
        for p in x
    )
    high = RANGES[ys][1]
    return None if ok else f"a list of [{xs}, {ys}], {xs} > 0 and {ys} from 0 to {high:g}"


def _numbers(value, path, kind, bad):
    """Every leaf of ``value`` a number of the one rule's ``kind`` (``*source`` and ``link``
    notes may be text); the first other leaf's dotted path, value and fault go to ``bad``."""
    if isinstance(value, dict):
        for k, v in value.items():
            if isinstance(v, str) and (str(k).endswith("source") or k == "link"):
                continue
            _numbers(v, f"{path}.{k}", kind, bad)
    elif isinstance(value, list):
        for i, v in enumerate(value):
            _numbers(v, f"{path}[{i}]", kind, bad)
    elif not bad:
        fault = number_fault(value, kind)
        if fault:
            bad.append((path, value, fault))


def check_profile_types(d, where="profile"):
    """The profile format's validator: the types and ranges the planner reads, so that a
    hand-edited or damaged profile is one line naming the entry (never a ``ValueError`` or
    ``OverflowError`` from deep in the cost model, nor a plan made of NaN, infinite, negative or
    absurd times and bytes). Every number follows the formats' one rule
    (:func:`megatron_oases.formats.number_fault`: times ``seconds``, sizes ``bytes``, a fit's
    slope ``s_per_byte``; counts :func:`~megatron_oases.formats.count_fault`)."""

    def fail(path, value, expected):
        raise OasesConfigError(
            f"{where}: {path} must be {expected}, got {quote(value)}; fix the entry or re-create "
            "the profile with `oases profile`"
        )

    if not isinstance(d["model"], dict):
        fail("model", d["model"], "a mapping of model settings")
    for key in ("num_layers", "hidden_size", "num_attention_heads", "seq_length"):
        if key in d["model"] and count_fault(d["model"][key]):
            fail(f"model.{key}", d["model"][key], count_fault(d["model"][key]))
    if "num_layers" not in d["model"]:
        raise OasesConfigError(f"{where}: missing key 'model.num_layers'")
    for key, value in d["model"].items():
        if is_number(value) and number_fault(value):
            fail(f"model.{key}", value, number_fault(value))
    for key in (
        "tensor_model_parallel_size",
        "data_parallel_size",
        "pipeline_model_parallel_size",
        "dtype_bytes",
    ):
        fault = key in d and count_fault(d[key], "dtype_bytes" if key == "dtype_bytes" else "size")
        if fault:
            fail(key, d[key], fault)
    if d.get("memory_gb") is not None and number_fault(d["memory_gb"], "memory_gb", True):
        fail(
            "memory_gb",
            d["memory_gb"],
            number_fault(d["memory_gb"], "memory_gb", True) + " or null",
        )
    if d.get("cluster") is not None and not isinstance(d["cluster"], str):
        fail("cluster", d["cluster"], "a cluster profile's name or path, or null")
    if not isinstance(d.get("sequence_parallel", False), bool):
        fail("sequence_parallel", d["sequence_parallel"], "true or false")
    degrees = d["degrees"]
    if not isinstance(degrees, list) or not degrees or not all(map(_positive_int, degrees)):
        fail("degrees", degrees, "a non-empty list of positive integers")
    if not isinstance(d["compute"], dict):
        fail("compute", d["compute"], "a mapping block -> degree -> phase -> [[samples, s], ...]")
    for block, per_degree in d["compute"].items():
        if not isinstance(per_degree, dict):
            fail(f"compute.{block}", per_degree, "a mapping degree -> phase -> points")
        for deg, phases in per_degree.items():
            if not isinstance(phases, dict):
                fail(f"compute.{block}.{deg}", phases, "a mapping phase -> points")
            for phase, pts in phases.items():
                fault = _points_fault(pts, "samples", "seconds")
                if fault:
                    fail(f"compute.{block}.{deg}.{phase}", pts, fault)
    for section in ("comm", "memory"):
        if not isinstance(d[section], dict):
            fail(section, d[section], "a mapping")
    fit_sections = [(f"comm.{kind}", fits) for kind, fits in d["comm"].items()]
    grad_sync = d.get("grad_sync")
    if grad_sync is not None:
        if not isinstance(grad_sync, dict):
            fail("grad_sync", grad_sync, "a mapping")
        for kind in ("all_reduce", "reduce_scatter"):
            fit_sections.append((f"grad_sync.{kind}", grad_sync.get(kind, {})))
    if d.get("pipeline_p2p"):
        fit_sections.append(("", {"pipeline_p2p": d["pipeline_p2p"]}))
    for where_fits, fits in fit_sections:
        if not isinstance(fits, dict):
            fail(where_fits, fits, "a mapping ranks -> fit")
        for key, fit in fits.items():
            at = f"{where_fits}.{key}".lstrip(".")
            if not isinstance(fit, dict):
                fail(at, fit, "a mapping with alpha_s and beta_s_per_byte")
            for name, kind in (("alpha_s", "seconds"), ("beta_s_per_byte", "s_per_byte")):
                fault = number_fault(fit.get(name), kind)
                if fault:
                    fail(f"{at}.{name}", fit.get(name), fault)
            fault = "points" in fit and _points_fault(fit["points"], "bytes", "seconds")
            if fault:
                fail(f"{at}.points", fit["points"], fault)
    numeric = {"memory": (d["memory"], "bytes")}
    numeric["fixed_compute"] = (d.get("fixed_compute") or {}, "seconds")
    if grad_sync is not None:
        for key in ("bytes_per_layer", "param_bytes_per_layer"):
            numeric[f"grad_sync.{key}"] = (grad_sync.get(key, {}), "bytes")
    for section, (value, kind) in numeric.items():
        bad = []
        _numbers(value, section, kind, bad)
        if bad:
            fail(*bad[0])


def load_profile(path):
    data = read_json(path, "profile", "create it with `oases profile`")
    return Profile(data, path=path)


def save_profile(data, path):
    """Validate ``data`` and write it to ``path`` whole or not at all (:func:`write_atomic`)."""
    Profile(data, path=path)  # validate
    write_atomic(path, json.dumps(data, indent=1, sort_keys=True) + "\n", "profile")


def fit_alpha_beta(points):
    """Least-squares t = α + β·n over [[n, t], ...] with α, β ≥ 0."""
    import numpy as np

    x = np.array([p[0] for p in points], dtype=float)
    y = np.array([p[1] for p in points], dtype=float)
    if len(x) == 1:
        return 0.0, float(y[0] / x[0]) if x[0] else 0.0
    A = np.stack([np.ones_like(x), x], axis=1)
    (alpha, beta), *_ = np.linalg.lstsq(A, y, rcond=None)
    if beta < 0:
        alpha, beta = float(y.mean()), 0.0
    if alpha < 0:
        alpha, beta = 0.0, float((x @ y) / (x @ x))
    return float(alpha), float(beta)
