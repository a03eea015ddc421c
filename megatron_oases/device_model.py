"""The roofline device model: what one transformer layer costs a device, and the dilation D.

A layer is GEMMs *and* memory-bound work (norms, bias adds, activations, dropout, residual adds,
the softmax over the scores, layout copies). Devices differ far more in GEMM rate than in memory
bandwidth, so the time of a layer on a device is modelled as

    t = GEMM FLOPs ÷ sustained GEMM rate + memory-bound bytes ÷ sustained memory bandwidth

(no overlap between the two: the unfused kernels of the local spec run one at a time). The link
emulators dilate compute by ``D = host time of this layer ÷ target time of this layer``, per shape.

Memory-bound bytes of one block's forward, per rank per sample (``p`` = dtype bytes, ``s`` the
sequence, ``r`` = ``s`` or ``s/d`` under sequence parallelism for the tensors outside the
column→row span, ``q = kv·(a + 2g)`` the QKV width, ``n = a·s²/d`` the local scores). Each op
reads its inputs and writes its output once (DRAM traffic, caches ignored):

attention
    input norm ``2p·r·h``; QKV bias add ``2p·s·q/d``; Q, K, V layout copies ``2p·s·q/d``;
    core attention, unfused (scores materialised): per score a cast to fp32 ``p+4`` (none in fp32),
    mask ``8``, softmax ``8``, cast back ``4+p`` (the causal mask itself, broadcast over heads, is
    not counted), attention dropout ``2p+1`` (if ``attention_dropout`` > 0); fused (flash / SDPA,
    ``shape["core_attention"] == "fused"``): its I/O only, ``p·s·(q + a·kv)/d``; the context copy
    back to ``[s, b, h/d]`` ``2p·s·a·kv/d``; bias, dropout, residual add on ``r·h`` elements:
    ``2p`` (bias) + ``2p+1`` (if ``hidden_dropout`` > 0) + ``3p``.
mlp
    pre-MLP norm ``2p·r·h``; fc1 bias add ``2p·s·fc1/d``; activation ``2p·s·ffn/d`` (GeLU) or
    ``5p·s·ffn/d`` (SwiGLU: SiLU then the product); bias, dropout, residual add as above.

The GEMMs (QKV, QKᵀ, ·V, projection, fc1, fc2) are FLOPs only (the count of
:func:`megatron_oases.profiler.layer_math.block_flops_forward`, repeated here from
:func:`megatron_oases.formats.profile.attention_flops_forward` so that this module sits below the
profiler, whose analytic profiles use it). Backward is 2× forward for both
parts; a fully recomputed layer costs 4× forward. The fp32 weight-gradient accumulation of each
micro-batch (:func:`grad_accumulation_bytes`) does not scale with tokens and is left out of
:func:`layer_work`. How this count compares with the H100 measurements: ``docs/compare.md``
("The device model").
"""

from dataclasses import dataclass

from .errors import OasesConfigError
from .formats.profile import attention_flops_forward

#: The version of what the roofline computes (a layer's FLOPs and memory-bound bytes, the time
#: rule, hence D and the analytic profiles): bump it (to the day's date) in the same commit that
#: changes them; benchmark reports record it (tests/unit/test_report_versions.py).
DEVICE_MODEL_VERSION = "2026-12-07"

#: Bytes per score of the unfused softmax path in fp32 (mask 4+4, softmax 4+4), casts excluded.
_SOFTMAX_FP32_BYTES = 16


@dataclass(frozen=True)
class DeviceRates:
    """A device's two roofline rates (sustained, not peak)."""

    gemm_flops_per_s: float
    memory_bytes_per_s: float
    name: str = ""

    @classmethod
    def from_profile(cls, profile):
        """The target GPU of a :class:`~megatron_oases.testbed.clusters.ClusterProfile`."""
        bw = getattr(profile, "memory_bandwidth_gbs", None)
        if not bw or bw <= 0:
            raise OasesConfigError(
                f"cluster profile {profile.name!r} has no memory_bandwidth_gbs: add the GPU's "
                "sustained memory bandwidth in GB/s (about 85 % of its datasheet figure) to its YAML"
            )
        return cls(profile.sustained_tflops * 1e12, bw * 1e9, profile.gpu or profile.name)


@dataclass(frozen=True)
class Work:
    """What a piece of a layer costs a device: GEMM FLOPs plus memory-bound bytes."""

    gemm_flops: float
    memory_bytes: float

    def __add__(self, other):
        return Work(self.gemm_flops + other.gemm_flops, self.memory_bytes + other.memory_bytes)

    def scaled(self, factor):
        return Work(self.gemm_flops * factor, self.memory_bytes * factor)


def layer_dims(shape):
    """(hidden, heads, query groups, kv channels, FFN, fc1 width) of a layer ``shape``."""
    h = shape["hidden_size"]
    a = shape["num_attention_heads"]
    g = shape.get("num_query_groups") or a
    kv = shape.get("kv_channels") or h // a
    ffn = shape["ffn_hidden_size"]
    fc1 = ffn * (2 if shape.get("swiglu") else 1)
    return h, a, g, kv, ffn, fc1


def block_gemm_flops(shape, block, degree):
    """Forward GEMM FLOPs of one block per rank per sample (attention matmuls: the full s×s)."""
    h, a, g, kv, ffn, fc1 = layer_dims(shape)
    if block == "attention":
        f = attention_flops_forward(shape, degree)
        return f["qkv"] + f["core"] + f["proj"]
    if block == "mlp":
        return (2 * h * fc1 + 2 * ffn * h) * shape["seq_length"] / degree
    raise ValueError(block)


def _fused_attention(shape):
    return shape.get("core_attention", "unfused") == "fused"


def block_memory_bytes(shape, block, degree, dtype_bytes, sequence_parallel=False):
    """Memory-bound bytes of one block's forward per rank per sample (the count in the module
    docstring)."""
    h, a, g, kv, ffn, fc1 = layer_dims(shape)
    s, p, d = shape["seq_length"], dtype_bytes, degree
    r = s / d if sequence_parallel else s
    bias = 0 if shape.get("disable_bias_linear") else 1
    hidden_drop = 1 if shape.get("hidden_dropout", 0.0) > 0 else 0
    norm = 2 * p * r * h
    bias_dropout_add = r * h * (bias * 2 * p + hidden_drop * (2 * p + 1) + 3 * p)
    if block == "attention":
        q = kv * (a + 2 * g)
        qkv = bias * 2 * p * s * q / d + 2 * p * s * q / d  # bias add; Q, K, V copies
        context_copy = 2 * p * s * a * kv / d
        if _fused_attention(shape):
            core = p * s * (q + a * kv) / d
        else:
            casts = 0 if p >= 4 else (p + 4) + (4 + p)
            drop = 2 * p + 1 if shape.get("attention_dropout", 0.0) > 0 else 0
            core = a * s * s / d * (casts + _SOFTMAX_FP32_BYTES + drop)
        return norm + qkv + core + context_copy + bias_dropout_add
    if block == "mlp":
        act = (5 if shape.get("swiglu") else 2) * p * s * ffn / d
        return norm + bias * 2 * p * s * fc1 / d + act + bias_dropout_add
    raise ValueError(block)


def block_work(shape, block, degree, dtype_bytes, samples=1, sequence_parallel=False):
    """One block (``"attention"`` | ``"mlp"``), forward, per rank, for ``samples`` sequences."""
    flops = block_gemm_flops(shape, block, degree)
    mem = block_memory_bytes(shape, block, degree, dtype_bytes, sequence_parallel)
    return Work(flops * samples, mem * samples)


def layer_work(shape, degree, dtype_bytes, samples=1, sequence_parallel=False):
    """Both blocks of one layer, forward, per rank."""
    return block_work(
        shape, "attention", degree, dtype_bytes, samples, sequence_parallel
    ) + block_work(shape, "mlp", degree, dtype_bytes, samples, sequence_parallel)


def grad_accumulation_bytes(shape, degree, dtype_bytes, main_grad_bytes=4):
    """Bytes of one micro-batch's weight-gradient accumulation into fp32 ``main_grad`` without
    Megatron's fused accumulation (a cast of the gradient, then the add): per layer per rank.
    Not part of :func:`layer_work` (it does not scale with tokens); given for the comparison."""
    h, a, g, kv, ffn, fc1 = layer_dims(shape)
    bias = 0 if shape.get("disable_bias_linear") else 1
    split = h * kv * (a + 2 * g) + kv * a * h + h * fc1 + ffn * h
    split += bias * (kv * (a + 2 * g) + fc1)
    params = split / degree + 2 * (2 * h + bias * h)  # norms and row-parallel biases replicated
    cast = dtype_bytes + main_grad_bytes if dtype_bytes != main_grad_bytes else 0
    return params * (cast + 3 * main_grad_bytes)


@dataclass(frozen=True)
class RooflineTime:
    gemm_s: float
    memory_s: float
    total_s: float  # gemm_s + memory_s (no overlap: unfused kernels run one at a time)


def roofline_time(work, rates):
    gemm = work.gemm_flops / rates.gemm_flops_per_s
    mem = work.memory_bytes / rates.memory_bytes_per_s
    return RooflineTime(gemm, mem, gemm + mem)


@dataclass(frozen=True)
class Dilation:
    host: RooflineTime  # the layer on the host that runs the emulation
    target: RooflineTime  # the layer on the target GPU of the cluster profile
    d: float  # host.total_s / target.total_s

    def describe(self):
        t, h = self.target, self.host
        return (
            f"target layer: GEMM {t.gemm_s * 1e3:.3g} ms + memory {t.memory_s * 1e3:.3g} ms; "
            f"host: GEMM {h.gemm_s * 1e3:.3g} ms + memory {h.memory_s * 1e3:.3g} ms; "
            f"D = {self.d:.4g}"
        )


def dilation(work, host, target, host_work=None):
    """D for ``work`` on ``target`` emulated by ``host`` (rates: :class:`DeviceRates`).

    ``host_work`` is the same layer as the host runs it when that differs (e.g. fp32 and unfused
    attention on a CPU against bf16 and flash attention on the target); default ``work``."""
    h = roofline_time(work if host_work is None else host_work, host)
    t = roofline_time(work, target)
    return Dilation(h, t, h.total_s / t.total_s)


def roofline_dilation(
    profile, shape, degree, host, host_dtype_bytes, samples=1, sp=False, host_attention=None
):
    """The :class:`Dilation` of one layer of ``shape`` at TMP ``degree`` emulating ``profile``'s GPU
    (a :class:`~megatron_oases.testbed.clusters.ClusterProfile`) on ``host``
    (:class:`DeviceRates`): the target runs the layer in the profile's dtype with ``shape``'s core
    attention, the host in ``host_dtype_bytes`` with ``host_attention`` (default: unfused, as
    Megatron's default backend on a CPU)."""
    target_work = layer_work(shape, degree, profile.dtype_bytes, samples, sp)
    host_shape = dict(shape, core_attention=host_attention or "unfused")
    host_work = layer_work(host_shape, degree, host_dtype_bytes, samples, sp)
    return dilation(target_work, host, DeviceRates.from_profile(profile), host_work=host_work)
