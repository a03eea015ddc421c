"""Measured profiles: one Megatron-Core ``TransformerLayer`` per candidate TMP degree, on real groups.

For every degree ``d`` the ranks are partitioned into groups of ``d`` (``torch.distributed.new_group``)
and each group builds one layer (local spec) with ``pg_collection.tp`` = its group, so all ranks work
at once as in training. Per block half (``_forward_attention`` / ``_forward_mlp``) and per sub-batch
size in play (``n = m·d/T`` samples per group and its halves) we time, with the TP all-reduces
switched off so that only computation is measured:

* forward (autograd recording on), recompute (= the same forward again), backward;

and the medians over ``--repeats`` (after a warm-up), maximum over ranks. Communication is timed on
its own: ``all_reduce`` on every TMP group size and ``all_gather_into_tensor`` on every re-shard group
(strided ranks), at the message sizes in play plus a spread, and fitted ``t = α + β·bytes``.

Memory: parameters per rank (× optimizer-state bytes per parameter), and the bytes each half saves for
backward, counted with ``torch.autograd.graph.saved_tensors_hooks`` (unique storages, parameters
excluded). Backward working set, embedding/logits memory come from :mod:`.layer_math`.

Under ``--emulate-link PROFILE`` the testbed's link emulator is installed first, so communication is
timed as emulated (and compute in host time): the profile then predicts the emulated testbed.

Profiles are cached under ``$OASES_CACHE_DIR`` (default ``~/.cache/megatron-oases/profiles``) by a
hardware fingerprint and a hash of shape, degrees, sizes and settings.
"""

import argparse
import copy
import os
import platform as _platform
import statistics
import time

from ..errors import OasesConfigError
from ..formats.profile import (
    PROFILE_VERSION,
    fit_alpha_beta,
    gather_ranks,
    load_profile,
    ranks_key,
    sha256_of,
    tp_ranks,
)
from . import layer_math
from .analytic import candidate_degrees, memory_section
from .model_config import shape_of

FP32_STATE_BYTES_PER_PARAM = 16  # fp32 param + fp32 grad + Adam exp_avg + exp_avg_sq


# ---------------------------------------------------------------------- fingerprint and cache
# Bumped whenever what is measured changes, so cached profiles measured the old way are not reused
# (2: the runtime peak frees each weight gradient once accumulated, as DDP does, the meter no longer
# counts views/in-place results of pre-existing tensors, per-block peaks, values per sample count;
# 3: the layer's TransformerConfig from Megatron-LM's core_transformer_config_from_args).
MEASUREMENT_REVISION = 3


def hardware_fingerprint(world_size, emulate_link=None):
    import torch

    cpu = _platform.processor() or _platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    try:
        from megatron.core import __version__ as mcore
    except Exception:  # noqa: BLE001
        mcore = "?"
    return {
        "cpu": cpu,
        "logical_cpus": os.cpu_count(),
        "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        "torch": torch.__version__,
        "megatron_core": mcore,
        "world_size": int(world_size),
        "threads_per_rank": int(os.environ.get("OMP_NUM_THREADS", "1")),
        "emulate_link": emulate_link,
        "emulate_dilation_env": os.environ.get("OASES_EMULATE_DILATION"),
        "host_flops_env": os.environ.get("OASES_HOST_FLOPS"),
    }


def default_cache_dir():
    return os.environ.get("OASES_CACHE_DIR") or os.path.join(
        os.path.expanduser("~"), ".cache", "megatron-oases", "profiles"
    )


def sizes_in_play(micro_batch, tp, degrees):
    """Samples per group per (sub-)batch for each degree: n = m·d/T, ⌈n/2⌉, ⌊n/2⌋ (and 1, 2)."""
    out = {}
    for d in degrees:
        s = {1, 2}
        if (micro_batch * d) % tp == 0:
            n = micro_batch * d // tp
            s |= {n, n - n // 2, n // 2}
        out[d] = sorted(x for x in s if x >= 1)
    return out


# ---------------------------------------------------------------------- per-rank worker
class _NoComm:
    """Context: TP all-reduces become no-ops (compute-only timing)."""

    class _Done:
        def wait(self, *a, **k):
            return True

        def is_completed(self):
            return True

    def __enter__(self):
        import torch.distributed as dist

        self._orig = dist.all_reduce

        def all_reduce(tensor, op=None, group=None, async_op=False):
            return _NoComm._Done() if async_op else None

        dist.all_reduce = all_reduce
        return self

    def __exit__(self, *exc):
        import torch.distributed as dist

        dist.all_reduce = self._orig
        return False


def _median_time(fn, repeats, warmup=1):
    times = []
    for i in range(warmup + repeats):
        t0 = time.perf_counter()
        fn()
        dt = time.perf_counter() - t0
        if i >= warmup:
            times.append(dt)
    return statistics.median(times)


def _max_over_ranks(values):
    import torch
    import torch.distributed as dist

    t = torch.tensor(values, dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.tolist()


#: Settings of the profiled layer on this host: fp32, unfused kernels (as ``oases train`` on CPU).
CPU_LAYER_SETTINGS = {
    "use_cpu_initialization": True,
    "bias_gelu_fusion": False,
    "bias_swiglu_fusion": False,
    "masked_softmax_fusion": False,
    "bias_dropout_fusion": False,
    "apply_rope_fusion": False,
    "gradient_accumulation_fusion": False,
    "no_persist_layer_norm": True,
}


def _build_layer(margs, degree, tp_group, single_group):
    """One TransformerLayer (local spec) at TP ``degree`` on ``tp_group``, configured from the
    model's Megatron args by Megatron-LM's own ``core_transformer_config_from_args``."""
    import torch
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.transformer.spec_utils import build_module
    from megatron.training.argument_utils import core_transformer_config_from_args

    a = copy.copy(margs)
    a.tensor_model_parallel_size = degree
    a.pipeline_model_parallel_size = 1
    a.num_layers = 1
    a.recompute_granularity = a.recompute_method = a.recompute_num_layers = None
    if not torch.cuda.is_available():
        for key, value in CPU_LAYER_SETTINGS.items():
            setattr(a, key, value)
    config = core_transformer_config_from_args(a)
    pgc = ProcessGroupCollection()
    pgc.tp = tp_group
    pgc.pp = single_group
    pgc.cp = single_group
    pgc.tp_cp = tp_group
    spec = get_gpt_layer_local_spec(normalization=margs.normalization)
    torch.manual_seed(1234)
    layer = build_module(spec, config=config, layer_number=1, pg_collection=pgc)
    layer.train()
    return layer


def _saved_bytes(fn, exclude_ptrs):
    import torch

    seen = {}

    def pack(t):
        try:
            st = t.untyped_storage()
            ptr = st.data_ptr()
            if ptr not in exclude_ptrs:
                seen[ptr] = st.nbytes()
        except Exception:  # noqa: BLE001 - e.g. tensors without storage
            pass
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    return out, sum(seen.values())


def _profile_block_times(layer, margs, n, repeats):
    """{block: {phase: seconds}} and {block: saved bytes} for one layer at sub-batch ``n``."""
    import torch

    s, h = margs.seq_length, margs.hidden_size
    params = {p.untyped_storage().data_ptr() for p in layer.parameters()}
    x = torch.randn(s, n, h, requires_grad=True)

    def attn():
        out, _ = layer._forward_attention(hidden_states=x, attention_mask=None)
        return out

    y = attn().detach().requires_grad_(True)

    def mlp():
        out = layer._forward_mlp(y)
        return out[0] if isinstance(out, (tuple, list)) else out

    times, saved = {}, {}
    with _NoComm():
        for block, fn in (("attention", attn), ("mlp", mlp)):
            fwd = _median_time(fn, repeats)
            rec = _median_time(fn, repeats)
            grad = torch.randn(s, n, h)

            def bwd_once():
                out = fn()
                t0 = time.perf_counter()
                out.backward(grad)
                return time.perf_counter() - t0

            bwd_once()  # warm-up
            bwd = statistics.median(bwd_once() for _ in range(repeats))
            layer.zero_grad(set_to_none=True)
            _, nbytes = _saved_bytes(fn, params)
            times[block] = {"forward_s": fwd, "recompute_s": rec, "backward_s": bwd}
            saved[block] = nbytes
        saved["runtime_peak"] = _runtime_peak(layer, x, grad)
        for block in ("attention", "mlp"):
            saved[f"runtime_peak_{block}"] = _runtime_peak(layer, x, grad, blocks=(block,))
    return times, saved


def _runtime_peak(layer, x, grad, blocks=("attention", "mlp")):
    """Peak live bytes of a forward + backward of ``blocks`` of one layer (activations,
    temporaries, each weight gradient until it is accumulated; not parameters or gradient buffers),
    with the schedule package's allocator-independent meter. The whole layer's peak is what a
    layer-granular recomputation holds; a single block's is what ``oases``' block-wise
    recomputation holds."""
    from ..instrument.memory import LiveTensorMeter

    xin = x.detach().requires_grad_(True)

    def drop_grad(p):  # as Megatron's DDP: add into the pre-allocated main_grad, free param.grad
        p.grad = None

    hooks = [p.register_post_accumulate_grad_hook(drop_grad) for p in layer.parameters()]
    meter = LiveTensorMeter()
    try:
        with meter:
            out = xin
            if "attention" in blocks:
                out, _ = layer._forward_attention(hidden_states=out, attention_mask=None)
            if "mlp" in blocks:
                out = layer._forward_mlp(out)
                out = out[0] if isinstance(out, (tuple, list)) else out
            out.backward(grad)
    finally:
        for h in hooks:
            h.remove()
    layer.zero_grad(set_to_none=True)
    return meter.peak_bytes


def _comm_time(op, group, nbytes, repeats):
    import torch
    import torch.distributed as dist

    numel = max(1, int(nbytes // 4))
    size = dist.get_world_size(group)
    if op == "all_reduce":
        buf = torch.zeros(numel)

        def run():
            dist.all_reduce(buf, group=group)

    else:
        per = max(1, numel // size)
        inp, out = torch.zeros(per), torch.zeros(per * size)

        def run():
            dist.all_gather_into_tensor(out, inp, group=group)

    dist.barrier()
    return _median_time(run, repeats)


def _profile_worker(payload):
    """Runs on every rank (default process group up). Returns the profile pieces on every rank."""
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state, tensor_parallel

    from .. import platform

    margs = argparse.Namespace(**payload["args"])
    degrees, repeats = payload["degrees"], payload["repeats"]
    phases = {"start": time.time() - payload["t0"]}
    t_phase = time.time()

    def mark(name):
        nonlocal t_phase
        now = time.time()
        phases[name] = now - t_phase
        t_phase = now

    platform.install_cpu_shims()
    world, rank = dist.get_world_size(), dist.get_rank()
    parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=1)
    tensor_parallel.model_parallel_cuda_manual_seed(1234)
    patch = None
    if payload.get("emulate_link"):
        from ..patches import REGISTRY
        from ..testbed.emulator import make_patch

        patch = make_patch(argparse.Namespace(emulate_link=payload["emulate_link"]))
        REGISTRY.install(patch)
    try:
        # every rank creates every group in the same order
        singles = {r: dist.new_group([r]) for r in range(world)}
        tp_groups = {}
        for d in degrees:
            for base in range(0, world, d):
                ranks = list(range(base, base + d))
                g = dist.new_group(ranks)
                if rank in ranks:
                    tp_groups[d] = g
        gather_groups = {}
        for key, (lo, hi) in payload["gathers"].items():
            for base in range(0, world, hi):
                for o in range(lo):
                    ranks = [base + o + i * lo for i in range(hi // lo)]
                    g = dist.new_group(ranks)
                    if rank in ranks:
                        gather_groups[key] = g

        mark("setup_groups")
        compute, saved, params = {}, {}, {}
        for d in degrees:
            layer = _build_layer(margs, d, tp_groups[d], singles[rank])
            params[d] = sum(p.numel() for p in layer.parameters())
            compute[d], saved[d] = {}, {}
            for n in payload["sizes"][str(d)]:
                dist.barrier()
                t, b = _profile_block_times(layer, margs, n, repeats)
                flat = [
                    t[blk][ph]
                    for blk in ("attention", "mlp")
                    for ph in ("forward_s", "recompute_s", "backward_s")
                ]
                flat = _max_over_ranks(flat)
                it = iter(flat)
                compute[d][n] = {
                    blk: {ph: next(it) for ph in ("forward_s", "recompute_s", "backward_s")}
                    for blk in ("attention", "mlp")
                }
                saved[d][n] = b
            del layer

        mark("compute")
        comm = {"all_reduce": {}, "all_gather": {}}
        for d in degrees:
            if d == 1:
                continue
            pts = []
            for nbytes in payload["messages"]:
                t = _comm_time("all_reduce", tp_groups[d], nbytes, repeats)
                pts.append([nbytes, _max_over_ranks([t])[0]])
            comm["all_reduce"][ranks_key(tp_ranks(d))] = pts
        for key, (lo, hi) in payload["gathers"].items():
            pts = []
            for nbytes in payload["messages"]:
                t = _comm_time("all_gather", gather_groups[key], nbytes, repeats)
                pts.append([nbytes, _max_over_ranks([t])[0]])
            comm["all_gather"][key] = pts
        mark("comm")
        dilation = getattr(getattr(patch, "emulator", None), "dilation", None)
        return {
            "phase_seconds": phases,
            "compute": compute,
            "saved": saved,
            "params": params,
            "comm": comm,
            "dilation": dilation,
            "threads": torch.get_num_threads(),
        }
    finally:
        if patch is not None:
            from ..patches import REGISTRY

            REGISTRY.uninstall(patch.name)
        parallel_state.destroy_model_parallel()


# ---------------------------------------------------------------------- driver
def measured_profile(
    margs,
    degrees=None,
    nproc=None,
    emulate_link=None,
    repeats=3,
    cache_dir=None,
    use_cache=True,
    timeout=3600,
):
    """Measure (or load from cache) a profile for ``margs``; returns the profile dict (on rank 0
    under torchrun; None on the other ranks)."""
    import json

    T = margs.tensor_model_parallel_size
    degrees = sorted(degrees or candidate_degrees(margs, T))
    world = nproc or int(os.environ.get("WORLD_SIZE", "0")) or max(degrees)
    if max(degrees) > world or world % max(degrees):
        raise OasesConfigError(
            f"measuring degree {max(degrees)} needs a multiple of {max(degrees)} ranks; got {world}"
        )
    if margs.fp16 or margs.bf16:
        raise OasesConfigError(
            "measured profiles run in fp32 on CPU; drop fp16/bf16 from the model"
        )
    m = margs.micro_batch_size
    sizes = sizes_in_play(m, T, degrees)
    shape = shape_of(margs)
    shape["name"] = getattr(margs, "name", None)
    hid = margs.seq_length * margs.hidden_size * 4
    msgs = sorted(
        {n * hid for ns in sizes.values() for n in ns} | {m * hid} | {hid // 4, hid * 4 * max(1, m)}
    )
    gathers = {}
    top = max(degrees)
    for i, lo in enumerate(degrees):
        for hi in degrees[i + 1 :]:
            gathers[ranks_key(gather_ranks(lo, hi))] = (lo, hi)
    for d in degrees:
        if d < T and T <= world and T % d == 0:
            gathers.setdefault(ranks_key(gather_ranks(d, T)), (d, T))
    del top
    fp = hardware_fingerprint(world, emulate_link)
    settings = {
        "shape": shape,
        "T": T,
        "degrees": degrees,
        "sizes": sizes,
        "messages": msgs,
        "repeats": repeats,
        "micro_batch_size": m,
        "data_parallel_size": margs.data_parallel_size,
        "method": MEASUREMENT_REVISION,
    }
    cache_key = sha256_of({"hardware": fp, "settings": settings})
    cache_dir = cache_dir or default_cache_dir()
    cache_path = os.path.join(cache_dir, f"profile-{cache_key[:20]}.json")
    in_torchrun = (
        "WORLD_SIZE" in os.environ and "RANK" in os.environ and "MASTER_ADDR" in os.environ
    )
    rank = int(os.environ.get("RANK", "0")) if in_torchrun else 0
    if use_cache and os.path.exists(cache_path):
        data = load_profile(cache_path).data
        data["from_cache"] = True
        return data if rank == 0 else None

    payload = {
        "args": dict(vars(margs)),  # Megatron's validated args: the layer's TransformerConfig
        "degrees": degrees,
        "repeats": repeats,
        "sizes": {str(d): v for d, v in sizes.items()},
        "messages": msgs,
        "gathers": gathers,
        "emulate_link": emulate_link,
        "t0": time.time(),
    }
    if in_torchrun:
        import torch.distributed as dist

        if not dist.is_initialized():
            dist.init_process_group("gloo")
        if dist.get_world_size() != world:
            raise OasesConfigError("--nproc disagrees with the torchrun world size")
        result = _profile_worker(payload)
    else:
        from ..launch import run_distributed

        quiet = {"PYTHONWARNINGS": "ignore"}
        old = {k: os.environ.get(k) for k in quiet}
        os.environ.update(quiet)  # spawned ranks inherit it: no Megatron import warnings
        try:
            result = run_distributed(_profile_worker, world, payload, timeout=timeout)[0]
        finally:
            for k, v in old.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
    if rank != 0:
        return None
    data = assemble(margs, shape, T, degrees, result, fp, cache_key, emulate_link)
    os.makedirs(cache_dir, exist_ok=True)
    with open(cache_path, "w") as f:
        json.dump(data, f, indent=1, sort_keys=True)
    return data


def assemble(margs, shape, T, degrees, result, fingerprint, cache_key, emulate_link):
    p = 4  # fp32 on CPU
    compute = {}
    for block in layer_math.BLOCKS:
        compute[block] = {}
        for d in degrees:
            per = result["compute"][d]
            compute[block][str(d)] = {
                ph: [[n, per[n][block][ph]] for n in sorted(per)]
                for ph in ("forward_s", "recompute_s", "backward_s")
            }
    comm = {"all_reduce": {}, "all_gather": {}}
    for kind in comm:
        for key, pts in result["comm"][kind].items():
            alpha, beta = fit_alpha_beta(pts)
            comm[kind][key] = {"alpha_s": alpha, "beta_s_per_byte": beta, "points": pts}
    mem = memory_section(shape, T, degrees, p, overhead_bytes=0)
    mem["state_bytes_per_layer"] = {
        str(d): result["params"][d] * FP32_STATE_BYTES_PER_PARAM for d in degrees
    }
    mem["params_per_layer"] = {str(d): result["params"][d] for d in degrees}
    measured_act, peaks, act_points, peak_points, block_peaks = {}, {}, {}, {}, {}
    for d in degrees:
        per = result["saved"][d]
        measured_act[str(d)] = max((b["attention"] + b["mlp"]) / n for n, b in per.items())
        act_points[str(d)] = [[n, b["attention"] + b["mlp"]] for n, b in sorted(per.items())]
        if all(b.get("runtime_peak") for b in per.values()):
            peaks[str(d)] = max(b["runtime_peak"] / n for n, b in per.items())
            peak_points[str(d)] = [[n, b["runtime_peak"]] for n, b in sorted(per.items())]
            for block in layer_math.BLOCKS:
                block_peaks.setdefault(block, {})[str(d)] = [
                    [n, b[f"runtime_peak_{block}"]] for n, b in sorted(per.items())
                ]
    mem["layer_activation_bytes_per_sample"] = measured_act
    # the same as measured at each sample count in play: a per-sample maximum times n would count
    # n-independent parts (weight-gradient temporaries, masks) n times
    mem["layer_activation_bytes"] = act_points
    source = "layer activations: saved_tensors_hooks; logits: layer_math"
    if len(peaks) == len(degrees):
        # backward working set beyond the saved activations, as measured (never below zero)
        mem["backward_transient_bytes_per_sample"] = {
            d: max(0.0, peaks[d] - measured_act[d]) for d in peaks
        }
        mem["layer_runtime_peak_bytes_per_sample"] = peaks
        mem["layer_runtime_peak_bytes"] = peak_points
        mem["block_runtime_peak_bytes"] = block_peaks
        source += "; backward working set: LiveTensorMeter peak of forward+backward"
    else:
        source += "; backward working set: layer_math"
    mem["activation_source"] = source
    # output layer time from the measured MLP rate at the largest degree and sub-batch
    d = max(degrees)
    n = max(result["compute"][d])
    mlp_t = result["compute"][d][n]["mlp"]["forward_s"]
    rate = layer_math.block_flops_forward(shape, "mlp", d) * n / max(mlp_t, 1e-12)
    head = layer_math.head_flops_forward(shape, T) / rate
    return {
        "version": PROFILE_VERSION,
        "kind": "measured",
        "model": shape,
        "tensor_model_parallel_size": T,
        "data_parallel_size": margs.data_parallel_size,
        "pipeline_model_parallel_size": margs.pipeline_model_parallel_size,
        "degrees": degrees,
        "dtype_bytes": p,
        "state_bytes_per_param": FP32_STATE_BYTES_PER_PARAM,
        "cluster": None,
        "emulate_link": emulate_link,
        "emulate_dilation": result.get("dilation"),
        "hardware": fingerprint,
        "cache_key": cache_key,
        "compute": compute,
        "fixed_compute": {
            "forward_s_per_sample": head,
            "backward_s_per_sample": 2 * head,
            "source": "output-layer FLOPs at the measured MLP rate",
        },
        "comm": comm,
        "memory": mem,
        "measured_flops_per_s": rate,
        "phase_seconds": result.get("phase_seconds"),
        "created": time.strftime("%Y-%m-%dT%H:%M:%S"),
    }
