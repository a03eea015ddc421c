"""``oases profile --analytic --cluster PROFILE``: a profile from FLOP counts and a cluster profile.

Compute: each block's roofline time on the cluster's GPU,
``roofline_time(block_work(...), DeviceRates.from_profile(cluster))`` of
:mod:`megatron_oases.device_model` (the function the emulators dilate compute with): GEMM FLOPs at
the sustained TFLOP/s plus memory-bound bytes (norms, bias adds, activations, dropout, residual
adds, the unfused softmax, layout copies) at the sustained memory bandwidth; recompute = forward,
backward = 2 × forward; the output layer (one GEMM) at the sustained rate; core attention's forward (what selective recomputation runs again) is not
written: the planner takes its FLOP share of the attention block's forward
(``Profile.core_attention_time``). Communication: the cluster's ring α–β model for each group
(placement rules of :mod:`megatron_oases.testbed.clusters`); with sequence parallelism also the
all-gather and reduce-scatter on every TMP group. Memory: ``layer_math`` counts (with the
core-attention bytes selective recomputation does not keep). Nothing is measured, so paper-scale
clusters can be planned on a laptop.
"""

import time

from ..device_model import DeviceRates, block_work, roofline_time
from ..formats.profile import PROFILE_VERSION, gather_ranks, ranks_key, tp_ranks
from ..testbed.clusters import load_cluster
from . import layer_math
from .model_config import shape_of

SAMPLE_POINTS = (1, 2, 4, 8, 16, 32, 64)
COMM_POINTS = (1 << 16, 1 << 20, 1 << 24, 1 << 28)
# Framework constant per GPU: CUDA context, cuBLAS workspaces, NCCL buffers (measured ~0.6–1 GB on
# PyTorch/NCCL; we count 1 GiB).
GPU_OVERHEAD_BYTES = 1 << 30


def candidate_degrees(args, tp):
    """Powers of two up to T that divide T, the heads, query groups, hidden and FFN sizes."""
    out, d = [], 1
    while d <= tp:
        if (
            tp % d == 0
            and args.num_attention_heads % d == 0
            and args.num_query_groups % d == 0
            and args.ffn_hidden_size % d == 0
            and args.hidden_size % d == 0
        ):
            out.append(d)
        d *= 2
    return out


def param_bytes(dtype_bytes):
    """Bytes per parameter: (weights + gradient buffer, optimizer state). Megatron mixed precision
    with Adam: 16-bit param + fp32 main grad = 6, fp32 master + 2 fp32 moments = 12 (18 in all);
    fp32 training: param + grad = 8, 2 moments = 8 (16 in all)."""
    return (6, 12) if dtype_bytes == 2 else (8, 8)


def state_bytes_per_param(dtype_bytes):
    return sum(param_bytes(dtype_bytes))


def sequence_parallel_memory(shape, degrees, dtype_bytes):
    """The profile's ``memory.sequence_parallel``: per degree > 1, what SP removes from a layer's
    saved activations and backward working set (bytes per sample; subtracted from the non-SP
    values, measured or counted) and one block's all-gathered column input beyond its shard."""
    degs = [d for d in degrees if d > 1]

    def saving(fn):
        return {str(d): fn(shape, d, dtype_bytes) - fn(shape, d, dtype_bytes, True) for d in degs}

    return {
        "activation_saving_bytes_per_sample": saving(layer_math.layer_activation_bytes),
        "transient_saving_bytes_per_sample": saving(layer_math.backward_transient_bytes),
        "gathered_input_bytes_per_sample": {
            str(d): layer_math.gathered_input_bytes(shape, d, dtype_bytes) for d in degs
        },
    }


def memory_section(shape, tp, degrees, dtype_bytes, overhead_bytes, sequence_parallel=False):
    per_param = state_bytes_per_param(dtype_bytes)
    wg, opt = param_bytes(dtype_bytes)
    out = {
        "params_per_layer": {str(d): layer_math.layer_params(shape, d) for d in degrees},
        "fixed_params": layer_math.fixed_params(shape, tp),
        "bytes_per_param": {"weights_and_grads": wg, "optimizer": opt},
        "state_bytes_per_layer": {
            str(d): layer_math.layer_params(shape, d) * per_param for d in degrees
        },
        "fixed_state_bytes": layer_math.fixed_params(shape, tp) * per_param,
        "layer_activation_bytes_per_sample": {
            str(d): layer_math.layer_activation_bytes(shape, d, dtype_bytes) for d in degrees
        },
        "checkpoint_bytes_per_sample": {
            "layer_input": layer_math.hidden_bytes(shape, dtype_bytes),
            "block_inputs": 2 * layer_math.hidden_bytes(shape, dtype_bytes),
        },
        "backward_transient_bytes_per_sample": {
            str(d): layer_math.backward_transient_bytes(shape, d, dtype_bytes) for d in degrees
        },
        # what selective recomputation (core attention) does not keep; the same under SP
        "core_attention_activation_bytes_per_sample": {
            str(d): layer_math.core_attention_activation_bytes(shape, d, dtype_bytes)
            for d in degrees
        },
        "fixed_activation_bytes_per_sample": layer_math.logits_bytes(shape, tp, dtype_bytes)
        + 2 * layer_math.hidden_bytes(shape, dtype_bytes),
        "overhead_bytes": overhead_bytes,
    }
    if sequence_parallel:
        out["sequence_parallel"] = sequence_parallel_memory(shape, degrees, dtype_bytes)
    return out


def comm_groups(degrees, sequence_parallel=False):
    """{"all_reduce": [ranks...], "all_gather": [ranks...]} every plan over ``degrees`` may use;
    with ``sequence_parallel`` also each TMP group's all-gather and "reduce_scatter"."""
    reduce = [tp_ranks(d) for d in degrees if d > 1]
    gather = list(reduce) if sequence_parallel else []
    for i, d1 in enumerate(degrees):
        for d2 in degrees[i + 1 :]:
            gather.append(gather_ranks(d1, d2))
    top = max(degrees)
    for d in degrees:  # embedding/output layer boundary re-shards (domain T ↔ layer degree)
        if d < top:
            gather.append(gather_ranks(d, top))
    uniq = {}
    for g in gather:
        uniq[ranks_key(g)] = g
    groups = {"all_reduce": reduce, "all_gather": list(uniq.values())}
    if sequence_parallel:
        groups["reduce_scatter"] = reduce
    return groups


def analytic_profile(args, cluster_name, degrees=None, overhead_bytes=GPU_OVERHEAD_BYTES):
    cluster = load_cluster(cluster_name)
    tp = args.tensor_model_parallel_size
    shape = shape_of(args)
    shape["name"] = getattr(args, "name", None)
    degrees = degrees or candidate_degrees(args, tp)
    p = cluster.dtype_bytes
    rate = cluster.sustained_tflops * 1e12
    rates = DeviceRates.from_profile(cluster)
    sp = bool(getattr(args, "sequence_parallel", False))
    # the core attention the target GPU runs (Megatron's --attention-backend on CUDA), as the
    # emulator's dilation counts it
    attention = target_core_attention(args)
    work_shape = dict(shape, core_attention=attention)

    compute = {}
    for block in layer_math.BLOCKS:
        compute[block] = {}
        for d in degrees:
            fwd = forward_time(work_shape, block, d, p, rates, sequence_parallel=sp)
            compute[block][str(d)] = {
                "forward_s": [[n, fwd * n] for n in SAMPLE_POINTS],
                "recompute_s": [[n, fwd * n] for n in SAMPLE_POINTS],
                "backward_s": [[n, 2 * fwd * n] for n in SAMPLE_POINTS],
            }

    groups = comm_groups(degrees + ([tp] if tp not in degrees else []), sequence_parallel=sp)
    comm = {kind: {} for kind in groups}
    for kind in groups:
        fn = getattr(cluster, f"{kind}_time")
        for ranks in groups[kind]:
            pts = [[n, fn(n, ranks)] for n in COMM_POINTS]
            # The ring model is exactly α + β·n: read α and β off two points.
            (n0, t0), (n1, t1) = pts[0], pts[-1]
            beta = (t1 - t0) / (n1 - n0)
            comm[kind][ranks_key(ranks)] = {
                # max: at zero latency, rounding can leave α a hair below 0 (profiles hold α >= 0)
                "alpha_s": max(0.0, t0 - beta * n0),
                "beta_s_per_byte": beta,
                "points": pts,
                "link": _link_name(cluster, ranks),
            }

    head = layer_math.head_flops_forward(shape, tp) / rate
    fixed_compute = {"forward_s_per_sample": head, "backward_s_per_sample": 2 * head}
    grad_sync = grad_sync_section(cluster, shape, tp, args.data_parallel_size, degrees, p)
    pp = getattr(args, "pipeline_model_parallel_size", 1) or 1
    p2p = pipeline_p2p_section(cluster, tp * args.data_parallel_size) if pp > 1 else None

    return {
        "version": PROFILE_VERSION,
        "kind": "analytic",
        "model": shape,
        "tensor_model_parallel_size": tp,
        "data_parallel_size": args.data_parallel_size,
        "pipeline_model_parallel_size": args.pipeline_model_parallel_size,
        "degrees": degrees,
        "sequence_parallel": sp,
        "dtype_bytes": p,
        "state_bytes_per_param": state_bytes_per_param(p),
        "cluster": cluster.name,
        "memory_gb": cluster.memory_gb,
        "hardware": {
            "cluster": cluster.name,
            "gpu": cluster.gpu,
            "sustained_tflops": cluster.sustained_tflops,
            "memory_bandwidth_gbs": cluster.memory_bandwidth_gbs,
            "compute_model": "roofline",
            "core_attention": attention,
        },
        "compute": compute,
        "fixed_compute": fixed_compute,
        "comm": comm,
        "grad_sync": grad_sync,
        **({"pipeline_p2p": p2p} if p2p else {}),
        "memory": memory_section(shape, tp, degrees, p, overhead_bytes, sequence_parallel=sp),
        "created": time.strftime("%Y-%m-%dT%H:%M:%S"),
    }


def target_core_attention(args):
    """``"fused"`` or ``"unfused"``: the core attention Megatron runs on the target GPU for
    ``args`` (:func:`megatron_oases.testbed.emulator.shape_of_args`, the emulator's count)."""
    from ..testbed.emulator import shape_of_args

    return shape_of_args(args)["core_attention"]


def forward_time(shape, block, degree, dtype_bytes, rates, sequence_parallel=False):
    """One block's forward per rank per sample on a device of ``rates``: its roofline time
    (GEMM FLOPs ÷ the GEMM rate + memory-bound bytes ÷ the memory bandwidth)."""
    work = block_work(shape, block, degree, dtype_bytes, sequence_parallel=sequence_parallel)
    return roofline_time(work, rates).total_s


def grad_bytes(dtype_bytes):
    """Bytes per gradient element the data-parallel sync moves: Megatron accumulates and reduces
    bf16/fp16 gradients in fp32 (``--accumulate-allreduce-grads-in-fp32``, on by default with
    ``--bf16``), fp32 training in fp32."""
    return 4 if dtype_bytes == 2 else dtype_bytes


def grad_sync_section(cluster, shape, tp, dp, degrees, dtype_bytes):
    """Data-parallel gradient sync of one layer at degree d over the ``dp·T/d`` replicas of its
    shard (ranks ``0, d, 2d, …`` of the whole job): the all-reduce of its ``params/d`` gradients
    (fp32, :func:`grad_bytes`), and for the distributed optimizer (ZeRO-1) the reduce-scatter of
    those gradients plus the all-gather of the updated parameters (model dtype) on the same link."""
    fits, rs_fits, nbytes, pbytes = {}, {}, {}, {}
    for d in degrees:
        ranks = list(range(0, tp * dp, d))
        params = layer_math.layer_params(shape, d)
        nbytes[str(d)] = params * grad_bytes(dtype_bytes)
        pbytes[str(d)] = params * dtype_bytes
        if len(ranks) <= 1:
            fits[str(d)] = {"alpha_s": 0.0, "beta_s_per_byte": 0.0, "replicas": len(ranks)}
            rs_fits[str(d)] = dict(fits[str(d)])
            continue
        for fn, out in ((cluster.all_reduce_time, fits), (cluster.reduce_scatter_time, rs_fits)):
            n0, n1 = COMM_POINTS[0], COMM_POINTS[-1]
            t0, t1 = fn(n0, ranks), fn(n1, ranks)
            beta = (t1 - t0) / (n1 - n0)
            out[str(d)] = {
                "alpha_s": max(0.0, t0 - beta * n0),
                "beta_s_per_byte": beta,
                "replicas": len(ranks),
                "link": _link_name(cluster, ranks),
            }
    return {
        "bytes_per_layer": nbytes,
        "param_bytes_per_layer": pbytes,
        "all_reduce": fits,
        # ring reduce-scatter and all-gather cost the same per byte of the full tensor
        "reduce_scatter": rs_fits,
    }


def pipeline_p2p_section(cluster, stride):
    """A send between adjacent pipeline stages: rank 0 to rank ``stride`` (TP × DP ranks per stage,
    Megatron's default rank order), as α + β·n on the link between them."""
    n0, n1 = COMM_POINTS[0], COMM_POINTS[-1]
    t0, t1 = cluster.p2p_time(n0, 0, stride), cluster.p2p_time(n1, 0, stride)
    beta = (t1 - t0) / (n1 - n0)
    return {
        "alpha_s": max(0.0, t0 - beta * n0),
        "beta_s_per_byte": beta,
        "link": _link_name(cluster, [0, stride]),
    }


def _link_name(cluster, ranks):
    link = cluster.link_for(ranks)
    for name in ("nvlink", "intra_node", "inter_node"):
        if getattr(cluster, name) is link:
            return name
    return "?"
