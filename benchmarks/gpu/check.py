"""The GPU check: what a lent GPU machine must tell us, in one command of a few minutes.

Steps (each in its own process, under its own time limit, its result kept when a later one fails):

* ``env``: torch, CUDA, the GPU, megatron-core, Triton/TE, the GPU's GEMM rate and memory
  bandwidth (the host rates the link emulator's device model divides by).
* ``parity``: every schedule against stock Megatron on this device (loss and every gradient), two
  ranks sharing it through gloo with device tensors; fp32, ``--bf16``, sequence parallelism and
  ``--attention-backend flash``.
* ``timing``: ``--one-rank`` iteration times of stock, ``oases`` and ``overlap-norecompute`` at the
  report's shape under the ``rtx3090-pcie`` and ``h100-nvlink`` link models, TMP 2/4/8 (rank 0
  alone on the fake process group; each collective a spin kernel on its stream on CUDA), and at
  a shape that keeps the GPU busy (``busy``: H=4096, seq 2048, micro-batch 8; TMP 2 and 8).
* ``host``: the host-issue floor: aten calls per layer per micro-batch (8 layers − 4 layers), the
  host's time per call at a negligible shape, and the GPU's idle time inside a step at the report's
  shape (``torch.profiler``), for stock and ``oases``.
* ``split``: the compute cost of splitting: one micro-batch of 2 against two of 1, no
  communication (stock, no recompute).
* ``graphs``: ``--oases-cuda-graphs``: parity of ``oases`` and ``overlap`` (no recompute) with
  graphs against stock (fp32, ``--bf16``), calls and kernels per layer, GPU idle share, memory and
  the one-rank emulated timing with and without graphs (on the CPU its ``eager`` bookkeeping).

* ``faithful`` (run on its own: ``--steps env,faithful``): device-bound one-rank rows
  ``profile:TP:micro-batch`` in priority order (:data:`FAITHFUL_ROWS`, ``--rows``), each with
  stock full recompute, stock without recompute, ``oases``, ``overlap-norecompute`` and
  ``oases``+graphs, two passes in alternating order, each job's GPU busy share (a row counts at
  >= 0.85; below, the micro-batch is doubled once), speed-ups against the fair baseline and the
  best stock variant beside the roofline prediction, and the first row's kernel traces analysed
  here (:mod:`megatron_oases.instrument.kernel_trace`). The emulator's host rates are this
  device's (``OASES_HOST_FLOPS``, ``OASES_HOST_MEM_GBS`` from ``env``), so its per-shape D
  applies. Rows that no longer fit the step's budget are skipped with a line.

``--dry-run`` runs the same steps on the CPU with tiny shapes (CI runs it). Writes
``report.json`` and ``report.md`` (and ``check.log``) into ``--out``: by default
``benchmarks/results/gpu/<date>-<device>/``; on the device tool's machine pass ``--out $OUT/...``.
"""

import argparse
import contextlib
import datetime
import json
import os
import platform
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path[:0] = [ROOT, os.path.join(ROOT, "tests")]

#: Megatron fusions that need Apex / TE kernels: off, so the check runs on a bare CUDA torch too.
KERNEL_FLAGS = [
    "--no-gradient-accumulation-fusion",
    "--no-persist-layer-norm",
    "--no-masked-softmax-fusion",
    "--no-rope-fusion",
]
FULL_RECOMPUTE = "--recompute-granularity full --recompute-method uniform --recompute-num-layers 1"


def shapes(dry):
    """Model flags of the parity, timing and host steps (the report's H=2048 shape on a GPU)."""
    if dry:
        small = (
            "--hidden-size 64 --num-attention-heads 8 --seq-length 32 --max-position-embeddings 32"
        )
        return {
            "parity": small,
            "timing": small,
            "busy": small,
            "host": small,
            "probe": small,
            "vocab": 512,
        }
    return {
        "parity": "--hidden-size 256 --num-attention-heads 8 --seq-length 128 "
        "--max-position-embeddings 128",
        "timing": "--hidden-size 2048 --num-attention-heads 32 --seq-length 1024 "
        "--max-position-embeddings 1024",
        # enough work per layer to keep an H100 busy at TMP 2 (~20 ms of GPU per layer against
        # ~10 ms of host issue at the report's shape): does the schedule pay once the GPU is busy?
        "busy": "--hidden-size 4096 --num-attention-heads 32 --seq-length 2048 "
        "--max-position-embeddings 2048",
        "host": "--hidden-size 2048 --num-attention-heads 32 --seq-length 1024 "
        "--max-position-embeddings 1024",
        "probe": "--hidden-size 64 --num-attention-heads 8 --seq-length 32 "
        "--max-position-embeddings 32",
        "vocab": 512,
    }


def _cuda():
    import torch

    return torch.cuda.is_available()


def _argv(text):
    import shlex

    return shlex.split(text)


# -- env -------------------------------------------------------------------------------------


def gemm_tflops(dtype_name, dry):
    """Sustained GEMM rate of this device (TFLOP/s): median of a few square products."""
    import torch

    cuda = _cuda()
    n = 512 if dry or not cuda else 8192
    dtype = getattr(torch, dtype_name)
    dev = "cuda" if cuda else "cpu"
    a = torch.randn(n, n, device=dev, dtype=dtype)
    b = torch.randn(n, n, device=dev, dtype=dtype)
    times = []
    for i in range(6):
        if cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        a @ b
        if cuda:
            torch.cuda.synchronize()
        if i >= 2:
            times.append(time.perf_counter() - t0)
    return 2 * n**3 / statistics.median(times) / 1e12


def memory_gbs(dry):
    """Sustained memory bandwidth of this device (GB/s): a large copy reads and writes each byte
    once (median of a few); the emulator's host memory rate (``OASES_HOST_MEM_GBS``)."""
    import torch

    cuda = _cuda()
    n = (1 << 28) if cuda and not dry else (1 << 22)  # 1 GiB of fp32 on a GPU
    dev = "cuda" if cuda else "cpu"
    src = torch.ones(n, device=dev)
    dst = torch.empty_like(src)
    times = []
    for i in range(7):
        if cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        dst.copy_(src)
        if cuda:
            torch.cuda.synchronize()
        if i >= 2:
            times.append(time.perf_counter() - t0)
    return 2 * n * src.element_size() / statistics.median(times) / 1e9


def step_env(dry):
    import torch

    out = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda_available": _cuda(),
        "cuda": torch.version.cuda,
    }
    try:
        from importlib.metadata import version

        out["megatron_core"] = version("megatron-core")
    except Exception as exc:  # noqa: BLE001
        out["megatron_core"] = f"missing: {exc}"
    for mod in ("triton", "transformer_engine", "apex"):
        try:
            m = __import__(mod)
            out[mod] = getattr(m, "__version__", "present")
        except Exception:  # noqa: BLE001
            out[mod] = None
    if _cuda():
        p = torch.cuda.get_device_properties(0)
        out.update(device=p.name, sms=p.multi_processor_count, memory_gb=p.total_memory / 1e9)
        try:
            out["nvidia_smi"] = subprocess.run(
                ["nvidia-smi", "-L"], capture_output=True, text=True, timeout=20
            ).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            pass
    else:
        out["device"] = "cpu (" + (platform.processor() or platform.machine()) + ")"
    out["gemm_tflops"] = {d: gemm_tflops(d, dry) for d in ("float32", "bfloat16")}
    out["memory_gbs"] = memory_gbs(dry)
    return out


# -- parity ----------------------------------------------------------------------------------


def parity_configs(dry):
    s = shapes(dry)
    base = (
        f"--num-layers 2 {s['parity']} --vocab-size {s['vocab']} --mock-data --lr 1e-2 "
        "--tensor-model-parallel-size 2 --micro-batch-size 2 --global-batch-size 4 "
        "--train-iters 2 --hidden-dropout 0 --attention-dropout 0 " + " ".join(KERNEL_FLAGS)
    )
    llama = (
        " --swiglu --normalization RMSNorm --group-query-attention --num-query-groups 4 "
        "--position-embedding-type rope --disable-bias-linear --untie-embeddings-and-output-weights"
    )
    hybrid = base.replace("--num-layers 2", "--hybrid-layer-pattern '*--*'")
    all4 = ["off", "overlap", "cross-pass", "oases"]
    # tolerances: fp32 on a GPU, a split's GEMMs may take other kernels (reassociated sums, ~1e-6
    # relative; 1e-4 leaves room); bf16 rounds at 2^-8 = 3.9e-3, and a reassociated gradient sum
    # differs by a few such units: 3e-2.
    cfgs = [
        ("gpt-fp32", base, all4, 1e-4),
        ("gpt-bf16", base + " --bf16", ["off", "oases", "overlap"], 3e-2),
        ("gpt-sp-fp32", base + " --sequence-parallel", ["off", "oases"], 1e-4),
        ("llama-fp32", base + llama, ["off", "oases"], 1e-4),
        # HybridModel: '*' attention and '-' MLP layers, not alternating, the stage ending on '*'
        ("hybrid-fp32", hybrid + llama, ["off", "oases", "overlap"], 1e-4),
        ("hybrid-bf16", hybrid + llama + " --bf16", ["off", "oases"], 3e-2),
    ]
    if dry:  # CI's time: the hybrid stack's bf16 adds nothing the CPU would show
        cfgs = [c for c in cfgs if c[0] != "hybrid-bf16"]
    if _cuda():  # PyTorch's flash kernel: CUDA and bf16 only
        cfgs.append(
            (
                "llama-bf16-flash",
                base + llama + " --bf16 --attention-backend flash",
                ["off", "oases"],
                3e-2,
            )
        )
    return cfgs


class _OneByOne:
    """What ``_coalescing_manager`` yields, for synchronous ops already completed."""

    def wait(self):
        return None


@contextlib.contextmanager
def _one_collective_at_a_time(group=None, device=None, async_ops=False):
    """Gloo has no coalesced all-reduce of CUDA tensors (two ranks share the GPU through gloo here;
    NCCL refuses two ranks on one device): Megatron's grad-buffer ops run one by one instead."""
    if async_ops:
        raise RuntimeError("the GPU check's gloo grad reduce is synchronous only")
    yield _OneByOne()


def _parity_worker(base, variants):
    """``variants_worker`` with Megatron's gradient-buffer collectives uncoalesced on CUDA."""
    import torch
    from helpers.runs import variants_worker
    from megatron.core.distributed import param_and_grad_buffer as buffers

    if not torch.cuda.is_available():
        return variants_worker(base, variants)
    original = buffers._coalescing_manager
    buffers._coalescing_manager = _one_collective_at_a_time
    try:
        return variants_worker(base, variants)
    finally:
        buffers._coalescing_manager = original


def parity_run(base, variants, pairs, tol, timeout):
    """Run ``variants`` on 2 ranks and compare each ``(got, ref)`` of ``pairs`` (loss and every
    gradient, worst over ranks): the config's result dict; a failed run is a result too."""
    from helpers.runs import max_rel_diff

    from megatron_oases.errors import last_line
    from megatron_oases.launch import run_distributed

    t0 = time.time()
    try:
        ranks = run_distributed(_parity_worker, 2, base, variants, timeout=timeout)
    except Exception as exc:  # noqa: BLE001 - one config's failure is a result
        return {"status": "failed", "error": last_line(exc)[:400]}
    worst = {}
    for res in ranks:
        for got, ref in pairs:
            if got not in res:
                continue
            diffs = [max_rel_diff(res[got]["losses"], res[ref]["losses"])]
            diffs += [max_rel_diff(res[got]["grads"][k], g) for k, g in res[ref]["grads"].items()]
            worst[got] = max(worst.get(got, 0.0), *diffs)
    return {
        "status": "ok" if all(v < tol for v in worst.values()) else "mismatch",
        "tolerance": tol,
        "worst_rel_diff": worst,
        "seconds": round(time.time() - t0, 1),
    }


def step_parity(dry, save=None, only=None):
    """Each config's result, passed to ``save`` as it completes (a time-out keeps the done ones);
    ``only``: the configs whose name starts with one of these prefixes."""
    results = {}
    for name, base, schedules, tol in parity_configs(dry):
        if only and not any(name.startswith(prefix) for prefix in only):
            continue
        if save:
            save(results)
        variants = [(sch, f"--oases-schedule {sch} {FULL_RECOMPUTE}") for sch in schedules]
        pairs = [(sch, "off") for sch in schedules[1:]]
        results[name] = parity_run(base, variants, pairs, tol, timeout=300)
    return results


# -- one-rank jobs (timing, host, split) --------------------------------------------------------


def _fake_group(world):
    import torch.distributed as dist

    from megatron_oases.launch import init_fake_process_group

    if dist.is_initialized():
        dist.destroy_process_group()
    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE=str(world), LOCAL_WORLD_SIZE="1")
    init_fake_process_group(world)


def one_rank_job(argv, iters, profile_at=None, trace_path=None):
    """One Megatron job on the current fake group; iteration times (s) and the profile record
    (``trace_path``: also the profiled step's Chrome trace)."""
    from helpers.runs import prepared

    from megatron_oases.instrument.host_calls import profiled_step_patch
    from megatron_oases.training.pretrain import run_in_process

    record = {}
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "golden.json")
        argv = list(argv) + ["--train-iters", str(iters), "--log-interval", "1"]
        argv += ["--log-json", path, "--fake-process-group"] + KERNEL_FLAGS
        extra = [profiled_step_patch(record, profile_at, trace_path)] if profile_at else []
        run_in_process(prepared(argv), demo=True, extra_patches=extra)
        with open(path) as f:
            times = json.load(f)["iteration-time"]["values"]
    return {"iteration_s": times, "median_s": statistics.median(times[1:] or times), **record}


def layers_argv(s, shape, layers, variant, extra=()):
    """A one-rank job of ``layers`` layers of ``variant`` (and ``extra`` flags) at ``shape``: TMP 2,
    micro-batch 2, dropout 0, bf16 on CUDA (the host-count steps: L and 2L layers)."""
    argv = _argv(
        f"--num-layers {layers} {s[shape]} --vocab-size {s['vocab']} --mock-data "
        "--tensor-model-parallel-size 2 --micro-batch-size 2 --global-batch-size 2 "
        "--hidden-dropout 0 --attention-dropout 0"
    )
    dtype = ["--bf16"] if _cuda() else []
    return argv + dtype + _variant_flags(variant, 2, layers) + list(extra)


def emulated_argv(s, shape, tp, mb, profile, variant, extra=()):
    """A 2-layer one-rank job of ``variant`` (and ``extra`` flags) under ``--emulate-link``. On
    CUDA with Megatron's default two data-loader workers: in-process loading (``--num-workers 0``,
    our CPU default) left the GPU idle 56-66 ms per step while the mock batch was collated
    (2026-11-27 H100 traces at micro-batch 128), which a training run does in its workers. And
    with Megatron's ``--manual-gc`` (its remedy for host jitter): the same traces show a 32 ms
    host stall inside one Dynamo guard check that emptied `oases`'s queue for 6 ms, and one timed
    iteration of 0.81 s against a 0.14 s median, both as a garbage collection would."""
    argv = _argv(
        f"--num-layers 2 {s[shape]} --vocab-size {s['vocab']} --mock-data "
        f"--tensor-model-parallel-size {tp} --micro-batch-size {mb} --global-batch-size {mb} "
        f"--hidden-dropout 0 --attention-dropout 0 --emulate-link {profile}"
    )
    device = ["--bf16", "--num-workers", "2", "--manual-gc"] if _cuda() else []
    return argv + device + _variant_flags(variant, mb, 2) + list(extra)


def timed_row(jobs, iters):
    """``{label: median iteration s}`` of one-rank ``jobs`` (``{label: argv}``; a failure is its
    line) and, with stock (``megatron``) among them, each one's speed-up over it."""
    from megatron_oases.errors import last_line

    row = {}
    for label, argv in jobs.items():
        try:
            row[label] = one_rank_job(argv, iters)["median_s"]
        except Exception as exc:  # noqa: BLE001
            row[label] = f"failed: {last_line(exc)[:300]}"
    if isinstance(row.get("megatron"), float):
        row["speedup"] = {n: row["megatron"] / v for n, v in row.items() if isinstance(v, float)}
    return row


def _variant_flags(name, micro_batch, layers):
    from megatron_oases.compare.variants import VARIANTS

    base = argparse.Namespace(
        micro_batch_size=micro_batch,
        global_batch_size=micro_batch,
        num_layers=layers,
        pipeline_model_parallel_size=1,
    )
    return list(VARIANTS[name].resolved_flags(base))


def step_timing(dry, gemm_rate=None):
    import torch

    s = shapes(dry)
    if gemm_rate:  # the emulator's "host" rate: this device's, in the run's dtype
        os.environ["OASES_HOST_FLOPS"] = repr(gemm_rate * 1e12)
    # (link profile, TMP, shape, micro-batch): the report's shape on both links, TMP 2/4/8; the
    # busy shape (H=4096, seq 2048, micro-batch 8) on h100-nvlink where it keeps the GPU busy
    # (TMP 2) and where it does not (TMP 8)
    grid = [(p, tp, "timing", 2) for p in ("rtx3090-pcie", "h100-nvlink") for tp in (2, 4, 8)]
    grid += [("h100-nvlink", 2, "busy", 8), ("h100-nvlink", 8, "busy", 8)]
    if dry:  # both links and both ends of the TMP range, in CI's time
        grid = [("rtx3090-pcie", 8, "timing", 2), ("h100-nvlink", 2, "busy", 2)]
    results = {}
    for profile, tp, shape, mb in grid:
        _fake_group(tp)
        jobs = {
            name: emulated_argv(s, shape, tp, mb, profile, name)
            for name in ("megatron", "oases", "overlap-norecompute")
        }
        row = timed_row(jobs, 2 if dry else 5)
        results[f"{profile}-tp{tp}" + ("" if shape == "timing" else f"-{shape}-mb{mb}")] = row
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    from megatron_oases.testbed.link_model import CudaLink

    # which stand-in the collectives were on CUDA (None on the CPU: host-clock waits)
    results["collective_kernel"] = {
        "kernel": CudaLink.last_kernel,
        "fallback_reason": CudaLink.fallback_reason,
    }
    return results


def step_host(dry):
    """Calls per layer (8 − 4 layers) ÷ 4 at the probe shape (negligible tensors: step time ≈ the
    host's issue time) and at the report's shape (GPU busy vs step wall)."""
    s = shapes(dry)
    _fake_group(2)
    out = {}
    for shape_name in ("probe", "host"):
        rows = {}
        for name in ("megatron", "oases"):
            per = {}
            for layers in (4, 8):
                argv = layers_argv(s, shape_name, layers, name)
                per[layers] = one_rank_job(argv, 4, profile_at=4)
            a4, a8 = per[4]["aten_calls"], per[8]["aten_calls"]
            unprofiled = statistics.median(per[8]["iteration_s"][1:3])  # iterations 2 and 3
            row = {
                "aten_calls_per_layer": (a8 - a4) / 4,
                "aten_calls_per_step_8_layers": a8,
                "step_wall_s_8_layers": per[8]["wall_s"],
                "step_wall_s_8_layers_unprofiled": unprofiled,
                "host_us_per_call": 1e6 * per[8]["wall_s"] / a8,
                "host_us_per_call_unprofiled": 1e6 * unprofiled / a8,
            }
            if "gpu_busy_s" in per[8]:
                busy = per[8]["gpu_busy_s"]
                row.update(
                    gpu_busy_s_8_layers=busy,
                    gpu_idle_share=max(0.0, 1 - busy / per[8]["wall_s"]),
                    gpu_us_per_layer=1e6 * (busy - per[4]["gpu_busy_s"]) / 4,
                    kernels_per_layer=(per[8]["kernels"] - per[4]["kernels"]) / 4,
                )
            rows[name] = row
        out[shape_name] = rows
    # negligible tensors: the step is the host's issue time (the profiler's own cost excluded)
    probe = out["probe"]["megatron"]["host_us_per_call_unprofiled"]
    out["host_us_per_call"] = probe
    out["host_us_per_call_profiled"] = out["probe"]["megatron"]["host_us_per_call"]
    for name, row in out["host"].items():
        row["host_floor_us_per_layer"] = row["aten_calls_per_layer"] * probe
        if "gpu_us_per_layer" in row:
            row["host_bound"] = row["host_floor_us_per_layer"] > row["gpu_us_per_layer"]
    return out


def step_split(dry):
    """Compute cost of the split: stock without recompute at micro-batch 2 against micro-batch 1
    twice, no communication cost (the fake group's collectives return at once)."""
    s = shapes(dry)
    _fake_group(2)
    out = {}
    for name in ("megatron-norecompute", "megatron-halfmb-norecompute"):
        argv = _argv(
            f"--num-layers 2 {s['timing']} --vocab-size {s['vocab']} --mock-data "
            "--tensor-model-parallel-size 2 --micro-batch-size 2 --global-batch-size 2 "
            "--hidden-dropout 0 --attention-dropout 0"
        )
        argv += (["--bf16"] if _cuda() else []) + _variant_flags(name, 2, 2)
        out[name] = one_rank_job(argv, 3 if dry else 6)["median_s"]
    out["half_x2_over_full"] = out["megatron-halfmb-norecompute"] / out["megatron-norecompute"]
    return out


def step_python(dry, save=None):
    """Where the host's time per layer goes: one rank at the host shape, L and 2L layers, the
    fastest of 4 steps under cProfile (thread CPU time), Python self time per layer by package
    (megatron_oases, megatron, torch, C functions) and the schedule's costliest own functions.
    The issue-30 target: megatron_oases frames at most 10 % of the layer's host time."""
    s = shapes(dry)
    save = save or (lambda result: None)
    graphs = ["--oases-cuda-graphs"] + ([] if _cuda() else ["eager"])
    variants = [
        ("megatron", []),
        ("oases", []),
        ("oases", graphs),
        ("megatron-norecompute", []),
        ("overlap-norecompute", []),
        ("overlap-norecompute", graphs),
    ]
    if dry:
        variants = variants[:3]
    _fake_group(2)
    from helpers.runs import prepared

    from megatron_oases.errors import last_line
    from megatron_oases.instrument.host_calls import python_time_patch
    from megatron_oases.training.pretrain import run_in_process

    out = {}
    for name, extra in variants:
        label = name + ("+graphs" if extra else "")
        per = {}
        try:
            for layers in (4, 8):
                argv = layers_argv(s, "host", layers, name, extra) + KERNEL_FLAGS
                argv += ["--train-iters", "9", "--log-interval", "1", "--fake-process-group"]
                record = {}
                patch = python_time_patch(record, 2, 4)
                run_in_process(prepared(argv), demo=True, extra_patches=[patch])
                per[layers] = record
        except Exception as exc:  # noqa: BLE001
            out[label] = {"error": last_line(exc)[:400]}
            continue
        a, b = per[4], per[8]
        layer_s = (b["thread_s"] - a["thread_s"]) / 4
        by_package = {
            k: (b["by_package"].get(k, 0.0) - a["by_package"].get(k, 0.0)) / 4
            for k in set(a["by_package"]) | set(b["by_package"])
        }
        ours = by_package.get("megatron_oases", 0.0)
        out[label] = {
            "host_ms_per_layer": 1e3 * layer_s,
            "host_ms_per_layer_unprofiled": 1e3
            * (b["thread_s_unprofiled"] - a["thread_s_unprofiled"])
            / 4,
            "ms_per_layer_by_package": {k: 1e3 * v for k, v in sorted(by_package.items())},
            "oases_share": ours / layer_s if layer_s > 0 else None,
            "step_thread_s_8_layers": b["thread_s"],
            "top_oases_8_layers": b["top_oases"],
        }
        save(out)
    return out


def step_graphs(dry, save=None, gemm_rate=None, trace_dir=None):
    """``--oases-cuda-graphs`` on this device (on the CPU its ``eager`` bookkeeping): parity of the
    graphed schedules against stock (2 ranks, fp32 and bf16, dropout 0), then one-rank calls per
    layer, GPU idle share and iteration time with and without, and the emulated-link timing."""
    import torch

    from megatron_oases.errors import last_line

    if gemm_rate:  # the emulator's "host" rate, as the timing step's
        os.environ["OASES_HOST_FLOPS"] = repr(gemm_rate * 1e12)
    save = save or (lambda result: None)
    graphs = "--oases-cuda-graphs" + ("" if _cuda() else " eager")
    s = shapes(dry)
    out = {"flag": graphs, "parity": {}, "host": {}, "timing": {}}
    base = next(b for name, b, _, _ in parity_configs(dry) if name == "gpt-fp32")
    variants = [
        ("off", f"--oases-schedule off {FULL_RECOMPUTE}"),
        ("oases+graphs", f"--oases-schedule oases {graphs} {FULL_RECOMPUTE}"),
        ("off-keep", "--oases-schedule off"),
        ("overlap-keep+graphs", f"--oases-schedule overlap {graphs}"),
    ]
    pairs = [("oases+graphs", "off"), ("overlap-keep+graphs", "off-keep")]
    configs = [("gpt-fp32", "", variants, 1e-4), ("gpt-bf16", " --bf16", variants[:2], 3e-2)]
    for name, flags, vs, tol in configs[:1] if dry else configs:  # the dry run: CI's time
        out["parity"][name] = parity_run(base + flags, vs, pairs, tol, timeout=240)
        save(out)
    # host floor: calls per layer (8 − 4 layers) and the GPU's idle share, one rank
    _fake_group(2)
    host_variants = [
        ("megatron", []),
        ("oases", []),
        ("oases", graphs.split()),
        ("megatron-norecompute", []),
        ("overlap-norecompute", []),
        ("overlap-norecompute", graphs.split()),
    ]
    if dry:  # stock and oases with and without graphs: CI's time
        host_variants = host_variants[:3]
    for name, extra in host_variants:
        label = name + ("+graphs" if extra else "")
        per = {}
        try:
            for layers in (4, 8):
                argv = layers_argv(s, "host", layers, name, extra)
                per[layers] = one_rank_job(argv, 5, profile_at=4)
        except Exception as exc:  # noqa: BLE001
            out["host"][label] = {"error": last_line(exc)[:400]}
            continue
        row = {
            "aten_calls_per_layer": (per[8]["aten_calls"] - per[4]["aten_calls"]) / 4,
            "iteration_s_8_layers": statistics.median(per[8]["iteration_s"][1:3]),
            "iteration_s_4_layers": statistics.median(per[4]["iteration_s"][1:3]),
        }
        if "gpu_busy_s" in per[8]:
            row.update(
                gpu_idle_share=max(0.0, 1 - per[8]["gpu_busy_s"] / per[8]["wall_s"]),
                gpu_us_per_layer=1e6 * (per[8]["gpu_busy_s"] - per[4]["gpu_busy_s"]) / 4,
                kernels_per_layer=(per[8]["kernels"] - per[4]["kernels"]) / 4,
            )
        if torch.cuda.is_available():
            row["max_allocated_gb_8_layers"] = torch.cuda.max_memory_allocated() / 1e9
            torch.cuda.reset_peak_memory_stats()
        out["host"][label] = row
        save(out)
    # the emulated links (rank 0 alone, collectives as spin kernels): does it pay now?
    grid = [("rtx3090-pcie", "timing", 2), ("h100-nvlink", "busy", 8)]
    if dry:
        grid = [("rtx3090-pcie", "timing", 2)]
    for profile, shape, mb in grid:
        jobs = {
            name
            + ("+graphs" if extra else ""): emulated_argv(s, shape, 2, mb, profile, name, extra)
            for name, extra in host_variants[:3] + host_variants[4:6]
        }
        row = timed_row(jobs, 2 if dry else 5)
        out["timing"][f"{profile}-tp2-{shape}-mb{mb}"] = row
        save(out)
    if trace_dir:  # the first row's kernel timeline, stock against oases with graphs
        profile, shape, mb = grid[0]
        for name, extra in (host_variants[0], host_variants[2]):
            label = name + ("+graphs" if extra else "")
            argv = emulated_argv(s, shape, 2, mb, profile, name, extra)
            path = os.path.join(trace_dir, f"trace-{profile}-{label.replace('+', '-')}.json")
            try:
                one_rank_job(argv, 3, profile_at=3, trace_path=path)
                subprocess.run(["gzip", "-f", path], check=False)
                out.setdefault("traces", []).append(os.path.basename(path) + ".gz")
            except Exception as exc:  # noqa: BLE001
                out.setdefault("traces", []).append(f"{label} failed: {last_line(exc)[:200]}")
        save(out)
    return out


# -- faithful: device-bound one-rank rows (issue 42) ---------------------------------------------

#: ``profile:TP:micro-batch[:D]`` in priority order (a cut budget keeps the first ones). The
#: communication/compute ratio of a TMP layer does not depend on the tokens per micro-batch, so a
#: micro-batch large enough to keep the H100 busy stands for the target's own. The last row is an
#: H100 group spanning two nodes (TP 16 over the profile's inter-node link): the GPU is the
#: target, so no dilation (D = 1).
FAITHFUL_ROWS = (
    "rtx4090-pcie:4:64",
    "rtx3090-pcie:2:32",
    "rtx4090-pcie:2:32",
    "l40s-pcie:2:32",
    "rtx3090-pcie:4:64",
    "h100-nvlink:2:32",
    "h100-nvlink:16:256:1",
)
#: the dry run forces D: a loaded CPU's measured rate puts D in the thousands (seconds of waiting
#: per collective); the host rates still reach the emulator and the prediction
FAITHFUL_DRY_ROWS = ("rtx4090-pcie:4:2:1",)
#: (label, variant, graphs?) and each one's fair baseline (the same recompute setting)
FAITHFUL_VARIANTS = (
    ("megatron", "megatron", False),
    ("megatron-norecompute", "megatron-norecompute", False),
    ("oases", "oases", False),
    ("overlap-norecompute", "overlap-norecompute", False),
    ("oases+graphs", "oases", True),
)
FAIR_BASELINE = {
    "megatron": "megatron",
    "megatron-norecompute": "megatron-norecompute",
    "oases": "megatron",
    "oases+graphs": "megatron",
    "overlap-norecompute": "megatron-norecompute",
}
STOCK = ("megatron", "megatron-norecompute")
BUSY_MIN = 0.85  # a row counts only where every job kept the GPU at least this busy
WARMUP = 2
PREDICTION_MODEL = (
    "roofline of the target GPU (megatron_oases.device_model: GEMM FLOPs at the profile's "
    "sustained rate + memory-bound bytes at its memory bandwidth) per layer forward T_f; "
    "backward 2 T_f, full recompute + T_f; 2 layers, embedding/loss/optimizer left out. "
    "All-reduce t_AR of b*s*h elements on the profile's link for the group (ring alpha-beta). "
    "Stock: every all-reduce exposed (6 per layer with full recompute, 4 without) except the "
    "2 backward ones, each hidden behind its block's weight-gradient GEMMs (~T_f of the block). "
    "Schedules, ideal overlap: max(compute, all-reduces) + one all-reduce per layer exposed "
    "(at most the serial time); "
    "serial (no overlap at all): compute + every all-reduce (oases issues none in recompute: 4 "
    "per layer). Split and graph-copy costs are left out."
)


def parse_rows(text):
    """``profile:TP:mb[:D]`` items, comma-separated; one ``ValueError`` line for a bad one."""
    rows = []
    for item in [t.strip() for t in text.split(",") if t.strip()]:
        parts = item.split(":")
        try:
            if len(parts) not in (3, 4):
                raise ValueError
            tp, mb = int(parts[1]), int(parts[2])
            d = float(parts[3]) if len(parts) == 4 else None
            if tp < 1 or mb < 1 or (d is not None and d <= 0):
                raise ValueError
        except ValueError:
            raise ValueError(
                f"--rows item {item!r}: write profile:TP:micro-batch[:D], e.g. rtx4090-pcie:4:64"
            ) from None
        rows.append((parts[0], tp, mb, d))
    return rows


def _row_key(profile, tp, mb):
    return f"{profile}-tp{tp}-mb{mb}"


def _layer_shape(s):
    """The layer_math shape dict of the faithful model flags."""
    flags = dict(zip(_argv(s["timing"])[::2], _argv(s["timing"])[1::2]))
    h = int(flags["--hidden-size"])
    return {
        "hidden_size": h,
        "num_attention_heads": int(flags["--num-attention-heads"]),
        "num_query_groups": None,
        "kv_channels": None,
        "ffn_hidden_size": 4 * h,
        "swiglu": False,
        "seq_length": int(flags["--seq-length"]),
        "normalization": "LayerNorm",
        "hidden_dropout": 0.0,
        "attention_dropout": 0.0,
        # as the emulator counts the target (megatron_oases.testbed.emulator.shape_of_args):
        # Megatron's default attention backend picks a fused kernel on a GPU
        "core_attention": "fused",
    }


def predict_row(s, profile_name, tp, mb, host=None, layers=2):
    """Modelled iteration time of each variant on the target and the speed-ups (see
    :data:`PREDICTION_MODEL`); ``host`` (GEMM TFLOP/s, memory GB/s): also the roofline D that
    the emulator's device model gives this row on this device."""
    from megatron_oases import device_model as dm
    from megatron_oases.testbed.clusters import load_cluster

    profile = load_cluster(profile_name)
    target = dm.DeviceRates.from_profile(profile)
    shape = _layer_shape(s)
    p = profile.dtype_bytes
    blocks = [dm.roofline_time(dm.block_work(shape, b, tp, p, mb), target).total_s
              for b in ("attention", "mlp")]  # fmt: skip
    t_f = sum(blocks)
    ar = profile.all_reduce_time(
        mb * shape["seq_length"] * shape["hidden_size"] * p, list(range(tp))
    )
    hidden_bwd = sum(min(ar, b) for b in blocks)  # stock: dgrad all-reduce behind the wgrad GEMMs
    c_full, c_nr = 4 * t_f * layers, 3 * t_f * layers
    t = {
        "megatron": c_full + layers * (6 * ar - hidden_bwd),
        "megatron-norecompute": c_nr + layers * (4 * ar - hidden_bwd),
    }
    serial = {"oases": c_full + 4 * ar * layers, "overlap-norecompute": c_nr + 4 * ar * layers}
    ideal = {  # never worse than no overlap at all
        "oases": min(serial["oases"], max(c_full, 4 * ar * layers) + ar * layers),
        "overlap-norecompute": min(
            serial["overlap-norecompute"], max(c_nr, 4 * ar * layers) + ar * layers
        ),
    }
    ideal["oases+graphs"], serial["oases+graphs"] = ideal["oases"], serial["oases"]
    best = min(t.values())
    out = {
        "target_layer_forward_ms": 1e3 * t_f,
        "all_reduce_ms": 1e3 * ar,
        "comm_over_compute_stock": 6 * ar / (4 * t_f),
        "iteration_ms": {k: 1e3 * v for k, v in t.items()},
        "speedup": {},
    }
    for label, base in FAIR_BASELINE.items():
        if label in STOCK:
            out["speedup"][label] = {"fair": 1.0, "best_stock": best / t[label]}
            continue
        out["speedup"][label] = {
            "fair_ideal": t[base] / ideal[label],
            "fair_serial": t[base] / serial[label],
            "best_stock_ideal": best / ideal[label],
            "best_stock_serial": best / serial[label],
        }
    if host:  # as the emulator computes it (resolve_dilation), this device as the host
        rates = dm.DeviceRates(host[0] * 1e12, host[1] * 1e9, "this device")
        cuda = _cuda()
        d = dm.roofline_dilation(
            profile, shape, tp, rates, 2 if cuda else 4, samples=mb,
            host_attention="fused" if cuda else "unfused",
        )  # fmt: skip
        out["roofline_d"] = d.d
        out["roofline_d_parts"] = d.describe()
    return out


def _job(argv, iters, dry):
    """One faithful job: ``WARMUP`` + ``iters`` timed iterations + one profiled (busy share); the
    D its emulator printed."""
    import io

    class Tee(io.StringIO):  # the log still gets every line as it comes (a hang shows where)
        def write(self, text):
            sys.__stdout__.write(text)
            return super().write(text)

    buf = Tee()
    total = WARMUP + iters + 1
    with contextlib.redirect_stdout(buf):
        r = one_rank_job(argv, total, profile_at=total)
    ds = re.findall(r"\bD = ([0-9.]+(?:e[+-]?[0-9]+)?)", buf.getvalue())
    busy = r["gpu_busy_s"] / r["wall_s"] if "gpu_busy_s" in r and r.get("wall_s") else None
    return {
        "timed_s": r["iteration_s"][WARMUP : WARMUP + iters],
        "busy_share": busy,
        "dilation": float(ds[-1]) if ds else None,
    }


def faithful_row(s, profile, tp, mb, d, iters, dry, graphs):
    """Every variant of one row, two passes in alternating order."""
    from megatron_oases.errors import last_line

    _fake_group(tp)
    if d is not None:
        os.environ["OASES_EMULATE_DILATION"] = repr(d)
    jobs = {
        label: emulated_argv(s, "timing", tp, mb, profile, name, graphs.split() if g else ())
        for label, name, g in FAITHFUL_VARIANTS
    }
    per = {label: {"timed_s": [], "busy_share": [], "dilation": None} for label in jobs}
    order = list(jobs)
    try:
        for pass_order in (order, order[::-1]):
            for label in pass_order:
                if "error" in per[label]:
                    continue
                try:
                    r = _job(jobs[label], iters, dry)
                except Exception as exc:  # noqa: BLE001 - one job's failure is a result
                    per[label]["error"] = last_line(exc)[:300]
                    continue
                per[label]["timed_s"] += r["timed_s"]
                per[label]["busy_share"].append(r["busy_share"])
                per[label]["dilation"] = r["dilation"]
    finally:
        os.environ.pop("OASES_EMULATE_DILATION", None)
    row = {"profile": profile, "tp": tp, "micro_batch": mb, "dilation_forced": d, "variants": {}}
    for label, v in per.items():
        t = v["timed_s"]
        busy = [b for b in v["busy_share"] if b is not None]
        out = {
            "iteration_s": t,
            "dilation": v["dilation"],
            "busy_share": min(busy) if busy else None,
        }
        if t:
            med = statistics.median(t)
            out.update(median_s=med, cv=statistics.pstdev(t) / statistics.fmean(t))
        if "error" in v:
            out["error"] = v["error"]
        row["variants"][label] = out
    med = {k: v.get("median_s") for k, v in row["variants"].items()}
    stock = [med[k] for k in STOCK if med.get(k)]
    best = min(stock) if stock else None
    row["speedup"] = {
        label: {
            "fair": (
                med[FAIR_BASELINE[label]] / med[label] if med.get(FAIR_BASELINE[label]) else None
            ),
            "best_stock": best / med[label] if best else None,
        }
        for label in row["variants"]
        if med.get(label)
    }
    known = [v["busy_share"] for v in row["variants"].values() if v["busy_share"] is not None]
    row["min_busy_share"] = min(known) if known else None
    row["counts"] = bool(known) and min(known) >= BUSY_MIN
    return row


def _trace_first_row(s, profile, tp, mb, d, trace_dir, dry):
    """Kernel traces of stock and ``oases`` at the first row, analysed here (on the device)."""
    from megatron_oases.errors import last_line
    from megatron_oases.instrument import kernel_trace
    from megatron_oases.testbed.link_model import CudaLink

    _fake_group(tp)
    out = {}
    if d is not None:
        os.environ["OASES_EMULATE_DILATION"] = repr(d)
    CudaLink.annotate = True
    try:
        for label in ("megatron", "oases"):
            argv = emulated_argv(s, "timing", tp, mb, profile, label)
            path = os.path.join(
                trace_dir, f"trace-faithful-{_row_key(profile, tp, mb)}-{label}.json"
            )
            try:
                one_rank_job(argv, 3, profile_at=3, trace_path=path)
                res = {"analysis": kernel_trace.analyse(path)}
                subprocess.run(["gzip", "-f", path], check=False)
                res["file"] = os.path.basename(path) + ".gz"
            except Exception as exc:  # noqa: BLE001
                res = {"error": last_line(exc)[:300]}
            if not _cuda():  # a CPU trace has no kernels: the analysis runs on a recorded one
                res["synthetic_analysis"] = kernel_trace.analyse(kernel_trace.synthetic_trace())
            out[label] = res
    finally:
        CudaLink.annotate = False
        os.environ.pop("OASES_EMULATE_DILATION", None)
    return out


def step_faithful(
    dry, save=None, gemm_rate=None, mem_gbs=None, trace_dir=None, rows=None, iters=None,
    deadline_s=None,
):  # fmt: skip
    """Device-bound one-rank rows (see :data:`FAITHFUL_ROWS`): each variant's iteration time, its
    GPU busy share, speed-ups against the fair baseline and the best stock variant beside the
    roofline prediction, and the first row's kernel traces analysed here."""
    import torch

    from megatron_oases.errors import last_line
    from megatron_oases.testbed.clusters import load_cluster

    t_end = time.time() + (deadline_s or 450)
    save = save or (lambda result: None)
    if gemm_rate:  # the emulator's "host" is this device: its GEMM rate and memory bandwidth
        os.environ["OASES_HOST_FLOPS"] = repr(gemm_rate * 1e12)
    if mem_gbs:
        os.environ["OASES_HOST_MEM_GBS"] = repr(mem_gbs)
    s = shapes(dry)
    rows = (
        parse_rows(rows)
        if rows
        else parse_rows(",".join(FAITHFUL_DRY_ROWS if dry else FAITHFUL_ROWS))
    )
    iters = iters or (2 if dry else 6)
    graphs = "--oases-cuda-graphs" + ("" if _cuda() else " eager")
    out = {
        "model": s["timing"]
        + " --num-layers 2"
        + (" --bf16 --num-workers 2 --manual-gc" if _cuda() else ""),
        "iterations": f"{WARMUP} warm-up + {iters} timed per pass, 2 passes in alternating order "
        "(+1 profiled for the busy share)",
        "host_rates": {"gemm_tflops": gemm_rate, "memory_gbs": mem_gbs},
        "busy_min": BUSY_MIN,
        "prediction_model": PREDICTION_MODEL,
        "rows": {},
        "skipped": [],
    }
    host = (gemm_rate, mem_gbs) if gemm_rate and mem_gbs else None
    row_s = None  # how long the last row took
    for i, (profile, tp, mb, d) in enumerate(rows):
        try:
            load_cluster(profile)
        except Exception as exc:  # noqa: BLE001
            out["skipped"].append(f"{profile}:{tp}:{mb}: not run: {last_line(exc)[:200]}")
            continue
        left = t_end - time.time()
        if row_s is not None and left < row_s:
            out["skipped"].append(
                f"{profile}:{tp}:{mb}: not run: {left:.0f} s of the step's budget left, a row "
                f"took {row_s:.0f} s"
            )
            continue
        t0 = time.time()
        row = faithful_row(s, profile, tp, mb, d, iters, dry, graphs)
        row_s = time.time() - t0
        if row["min_busy_share"] is not None and not row["counts"]:
            if t_end - time.time() > 2 * row_s:  # double the micro-batch once, and say so
                first = row
                row = faithful_row(s, profile, tp, 2 * mb, d, iters, dry, graphs)
                row["doubled_from"] = {"micro_batch": mb, "min_busy_share": first["min_busy_share"]}
                mb = 2 * mb
            else:
                row["not_doubled"] = "busy share below the minimum; no time left to double"
        try:
            row["prediction"] = predict_row(s, profile, tp, mb, host)
        except Exception as exc:  # noqa: BLE001
            row["prediction"] = {"error": last_line(exc)[:300]}
        out["rows"][_row_key(profile, tp, mb)] = row
        save(out)
        if i == 0 and trace_dir:
            out["traces"] = _trace_first_row(s, profile, tp, mb, d, trace_dir, dry)
            save(out)
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    from megatron_oases.testbed.link_model import CudaLink

    out["collective_kernel"] = {
        "kernel": CudaLink.last_kernel,
        "fallback_reason": CudaLink.fallback_reason,
    }
    return out


STEPS = {
    "env": (step_env, 60),
    "parity": (step_parity, 240),
    "timing": (step_timing, 240),
    "host": (step_host, 120),
    "split": (step_split, 60),
    "graphs": (step_graphs, 300),
    "python": (step_python, 180),
    "faithful": (step_faithful, 460),
}


# -- driver ----------------------------------------------------------------------------------


def _run_step(name, dry, limit, log, extra):
    """Run one step in its own process (a crash or hang loses that step only)."""
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
        result_path = f.name
    cmd = [sys.executable, __file__, "--step", name, "--result", result_path]
    cmd += (["--dry-run"] if dry else []) + extra
    t0 = time.time()
    log.write(f"\n===== step {name}: {' '.join(cmd)}\n")
    log.flush()
    try:
        proc = subprocess.run(
            cmd, stdout=log, stderr=subprocess.STDOUT, timeout=limit, cwd=ROOT, env=os.environ
        )
        rc = proc.returncode
    except subprocess.TimeoutExpired:
        rc = None
    seconds = round(time.time() - t0, 1)
    try:
        with open(result_path) as f:
            result = json.load(f)
    except (OSError, ValueError):
        result = None
    finally:
        if os.path.exists(result_path):
            os.remove(result_path)
    if rc == 0 and result is not None:
        return {"status": "ok", "seconds": seconds, "result": result}
    why = f"timed out after {limit:.0f} s" if rc is None else f"exit code {rc}"
    out = {"status": "failed", "seconds": seconds, "error": f"{why}; see check.log"}
    if result:  # what a step saved before it stopped (parity: its finished configs)
        out["result"] = result
    return out


def _slug(text):
    return re.sub(r"[^A-Za-z0-9._-]+", "-", text).strip("-")[:60] or "device"


def _fmt(x, spec="{:.3f}"):
    return spec.format(x) if isinstance(x, (int, float)) else str(x)


def write_report(report, out):
    with open(os.path.join(out, "report.json"), "w") as f:
        json.dump(report, f, indent=1, default=str)
    steps = report["steps"]
    lines = [
        f"# GPU check: {report['device']}",
        "",
        f"- date: {report['date']}; code: {report['commit']}; mode: "
        + ("**dry run on the CPU (tiny shapes): no GPU figure**" if report["dry_run"] else "GPU"),
        f"- command: `{report['command']}`",
        "- timing rows are **one-rank emulations**: rank 0 alone, the other TMP ranks virtual, each "
        "collective a modelled wait (on CUDA a spin kernel on its stream) of D x its time on the "
        "named link, D = target GPU rate / this device's GEMM rate; not a measured cluster.",
        "",
        "| step | status | seconds |",
        "|---|---|---|",
    ]
    lines += [f"| {n} | {s['status']} | {s['seconds']} |" for n, s in steps.items()]
    env = (steps.get("env") or {}).get("result")
    if env:
        lines += ["", "## Environment", "", "```", json.dumps(env, indent=1), "```"]
    par = (steps.get("parity") or {}).get("result")
    if par:
        lines += ["", "## Parity against stock (loss and every gradient, 2 ranks on gloo)", ""]
        lines += [
            "| config | status | tolerance | worst relative difference |",
            "|---|---|---|---|",
        ]
        for n, r in par.items():
            worst = ", ".join(f"{k} {v:.1e}" for k, v in (r.get("worst_rel_diff") or {}).items())
            lines.append(
                f"| {n} | {r['status']} | {r.get('tolerance', '')} | {worst or r.get('error')} |"
            )
    tim = (steps.get("timing") or {}).get("result")
    if tim:
        lines += ["", "## One-rank timing (median iteration s; speed-up over stock)", ""]
        lines += ["| link, TMP | megatron | oases | overlap-norecompute |", "|---|---|---|---|"]
        kernel = tim.get("collective_kernel") or {}
        for n, r in tim.items():
            if n == "collective_kernel":
                continue
            sp = r.get("speedup", {})
            cells = [
                f"{_fmt(r.get(v), '{:.4f}')}" + (f" ({sp[v]:.2f}x)" if v in sp else "")
                for v in ("megatron", "oases", "overlap-norecompute")
            ]
            lines.append(f"| {n}{_dilation(n, env)} | " + " | ".join(cells) + " |")
        lines += ["", f"collectives stood in for by: {kernel.get('kernel') or 'host-clock waits'}"
                  + (f" (Triton's kernel failed: {kernel['fallback_reason']})"
                     if kernel.get("fallback_reason") else "")]  # fmt: skip
    host = (steps.get("host") or {}).get("result")
    if host:
        lines += ["", "## Host floor", ""]
        lines.append(
            "host time per aten call (negligible tensors; Megatron's iteration time without the "
            f"profiler ÷ the step's aten calls): {_fmt(host['host_us_per_call'], '{:.1f}')} µs; "
            "the profiled train_step's wall ÷ its calls: "
            f"{_fmt(host.get('host_us_per_call_profiled'), '{:.1f}')} µs"
        )
        lines += ["", "| shape | variant | calls/layer | host floor µs/layer | GPU µs/layer | "
                  "GPU idle share | host-bound |", "|---|---|---|---|---|---|---|"]  # fmt: skip
        for shape in ("probe", "host"):
            for v, r in host[shape].items():
                lines.append(
                    f"| {shape} | {v} | {_fmt(r['aten_calls_per_layer'], '{:.0f}')} | "
                    f"{_fmt(r.get('host_floor_us_per_layer'), '{:.0f}')} | "
                    f"{_fmt(r.get('gpu_us_per_layer'), '{:.0f}')} | "
                    f"{_fmt(r.get('gpu_idle_share'), '{:.2f}')} | {r.get('host_bound', '')} |"
                )
    graphs = (steps.get("graphs") or {}).get("result")
    if graphs:
        lines += _graphs_report(graphs, env)
    python = (steps.get("python") or {}).get("result")
    if python:
        lines += _python_report(python)
    faithful = (steps.get("faithful") or {}).get("result")
    if faithful:
        lines += _faithful_report(faithful)
    split = (steps.get("split") or {}).get("result")
    if split:
        lines += [
            "",
            "## Split cost",
            "",
            f"micro-batch 1 twice ÷ micro-batch 2 once (stock, no recompute, no communication): "
            f"{split['half_x2_over_full']:.3f}",
        ]
    for n, s in steps.items():
        if s["status"] != "ok":
            lines += ["", f"**{n} failed**: {s['error']}"]
    with open(os.path.join(out, "report.md"), "w") as f:
        f.write("\n".join(lines) + "\n")


def _x(v):
    return f"{v:.2f}x" if isinstance(v, (int, float)) else "-"


def _faithful_report(f):
    labels = [label for label, _, _ in FAITHFUL_VARIANTS]
    lines = [
        "",
        "## Faithful one-rank rows (device-bound; issue 42)",
        "",
        f"Model: `{f['model']}`; {f['iterations']}. Host rates given to the emulator (this "
        f"device's): GEMM {_fmt(f['host_rates'].get('gemm_tflops'), '{:.3g}')} TFLOP/s, memory "
        f"{_fmt(f['host_rates'].get('memory_gbs'), '{:.3g}')} GB/s. A row counts only where "
        f"every job kept the GPU at least {f['busy_min']:.0%} busy (the profiled iteration's "
        "kernel time ÷ its wall time; the profiler slows the host, so a lower bound).",
        "",
        "Speed-ups: **fair** = against stock with the same recompute setting (oases and "
        "oases+graphs against stock full recompute, overlap-norecompute against stock without "
        "recompute); **best** = against the faster stock variant. Predicted: ideal overlap / no "
        "overlap, from the roofline model below.",
        "",
    ]
    for key, row in f["rows"].items():
        pred = row.get("prediction") or {}
        head = f"### {key}"
        if row.get("dilation_forced"):
            head += f" (D forced to {row['dilation_forced']:g}: the GPU is the target)"
        lines += [head, ""]
        if row.get("doubled_from"):
            df = row["doubled_from"]
            lines.append(
                f"Micro-batch doubled from {df['micro_batch']}: its busy share was "
                f"{_fmt(df['min_busy_share'], '{:.2f}')} < {f['busy_min']}."
            )
        if row.get("not_doubled"):
            lines.append(f"Not doubled: {row['not_doubled']}.")
        counts = row.get("counts")
        lines.append(
            f"Lowest busy share {_fmt(row.get('min_busy_share'), '{:.2f}')}: "
            + ("**counts** (device-bound)." if counts else "**does not count** (host-bound or "
               "not measured: no CUDA).")  # fmt: skip
        )
        if "roofline_d" in pred:
            used = " (not used: the row forces D)" if row.get("dilation_forced") else ""
            lines.append(f"Roofline D on this device{used}: {pred['roofline_d_parts']}.")
        if "error" in pred:
            lines.append(f"Prediction: {pred['error']}.")
        lines += [
            "",
            "| variant | median s | CV | busy | D (emulator) | vs fair | vs best stock | "
            "predicted vs fair | predicted vs best |",
            "|---|---|---|---|---|---|---|---|---|",
        ]
        for label in labels:
            v = row["variants"].get(label, {})
            sp = row["speedup"].get(label, {})
            ps = (pred.get("speedup") or {}).get(label, {})
            if "fair_ideal" in ps:
                pf = f"{_x(ps['fair_ideal'])} / {_x(ps['fair_serial'])}"
                pb = f"{_x(ps['best_stock_ideal'])} / {_x(ps['best_stock_serial'])}"
            else:
                pf, pb = _x(ps.get("fair")), _x(ps.get("best_stock"))
            med = (
                _fmt(v.get("median_s"), "{:.4f}")
                if "median_s" in v
                else f"failed: {v.get('error')}"
            )
            lines.append(
                f"| {label} | {med} | {_fmt(v.get('cv'), '{:.1%}')} | "
                f"{_fmt(v.get('busy_share'), '{:.2f}')} | {_fmt(v.get('dilation'), '{:.4g}')} | "
                f"{_x(sp.get('fair'))} | {_x(sp.get('best_stock'))} | {pf} | {pb} |"
            )
        lines.append("")
    for line in f.get("skipped", []):
        lines.append(f"- skipped: {line}")
    tr = f.get("traces")
    if tr:
        lines += [
            "",
            "### Kernel traces of the first row (analysed on the device)",
            "",
            "| variant | busy share | compute ms | spin ms | spin beside compute | two streams at "
            "once ms | idle gaps > 100 µs (n, ms) | largest gap ms | stream waits (on spins, "
            "spin inputs, other) | waits that stalled on a spin (n, ms) |",
            "|---|---|---|---|---|---|---|---|---|---|",
        ]
        for label, r in tr.items():
            for kind in ("analysis", "synthetic_analysis"):
                a = r.get(kind)
                if not a:
                    continue
                if "spin_us" not in a:
                    lines.append(f"| {label} ({kind}) | {a.get('note', 'no kernels')} |||||||||")
                    continue
                w = a["stream_wait_summary"]
                k = w["by_kind"]
                name = label + (" (synthetic trace: the CPU's has no kernels)"
                                if kind == "synthetic_analysis" else "")  # fmt: skip
                lines.append(
                    f"| {name} | {_fmt(a['busy_share'], '{:.2f}')} | "
                    f"{a['compute_us'] / 1e3:.2f} | {a['spin_us'] / 1e3:.2f} | "
                    f"{a['spin_overlapped_us'] / 1e3:.2f} ms "
                    f"({_fmt(a['spin_overlapped_share'], '{:.0%}')}) | "
                    f"{a['concurrent_streams_us'] / 1e3:.2f} | {a['idle_gaps_over_100us']}, "
                    f"{a['idle_gaps_over_100us_total_us'] / 1e3:.2f} | "
                    f"{a['largest_gap_us'] / 1e3:.2f} | {k.get('spin', 0)}, {k.get('input', 0)}, "
                    f"{k.get('other', 0)} | {w['on_spins_that_stalled']}, "
                    f"{w['stalled_us'] / 1e3:.2f} |"
                )
            if r.get("error"):
                lines.append(f"| {label} | failed: {r['error']} |||||||||")
        files = [r["file"] for r in tr.values() if r.get("file")]
        if files:
            lines += ["", "Traces next to this report: " + ", ".join(f"`{x}`" for x in files)]
    lines += ["", f"Prediction model: {f['prediction_model']}"]
    ck = f.get("collective_kernel") or {}
    lines += ["", f"Collectives stood in for by: {ck.get('kernel') or 'host-clock waits (CPU)'}"]
    return lines


def _python_report(py):
    packages = ("megatron_oases", "megatron", "torch", "builtin", "other")
    lines = [
        "",
        "## Host time per layer by package (cProfile, thread CPU time, fastest of 4 steps)",
        "",
        "| variant | host ms/layer (unprofiled) | "
        + " | ".join(packages)
        + " | megatron_oases share |",
        "|---|---|" + "---|" * len(packages) + "---|",
    ]
    for v, r in py.items():
        if "error" in r:
            lines.append(f"| {v} | failed: {r['error']} |")
            continue
        ms = r["ms_per_layer_by_package"]
        cells = " | ".join(_fmt(ms.get(k, 0.0), "{:.2f}") for k in packages)
        lines.append(
            f"| {v} | {_fmt(r['host_ms_per_layer'], '{:.2f}')} "
            f"({_fmt(r.get('host_ms_per_layer_unprofiled'), '{:.2f}')}) | {cells} | "
            f"{_fmt(r['oases_share'], '{:.1%}')} |"
        )
    for v, r in py.items():
        if r.get("top_oases_8_layers"):
            lines += [
                "",
                f"{v}: costliest megatron_oases functions (8 layers, self ms, calls):",
                "",
            ]
            lines += [f"- `{f}` {1e3 * t:.2f} ms, {n}" for f, t, n in r["top_oases_8_layers"][:8]]
    return lines


def _dilation(row, env):
    """' (D = …)' for an emulated row named after its cluster profile: D < 1 shrinks the link
    instead of stretching compute, so the host's issue cost weighs 1/D times too much there."""
    from megatron_oases.testbed.clusters import load_cluster

    rates = (env or {}).get("gemm_tflops") or {}
    rate = rates.get("bfloat16" if (env or {}).get("cuda_available") else "float32")
    profile = next((p for p in ("rtx3090-pcie", "rtx3090-nvlink", "rtx4090-pcie", "a100-nvlink",
                                "h100-nvlink") if row.startswith(p)), None)  # fmt: skip
    if not rate or profile is None:
        return ""
    d = load_cluster(profile).sustained_tflops / rate
    note = f"; the host weighs {1 / d:.3g}x too much" if d < 1 else ""
    return f" (D = {d:.3g}{note})"


def _graphs_report(g, env=None):
    lines = [
        "",
        f"## CUDA graphs (`{g['flag']}`)",
        "",
        "Parity against stock (2 ranks on gloo):",
        "",
    ]
    lines += ["| config | status | tolerance | worst relative difference |", "|---|---|---|---|"]
    for n, r in g["parity"].items():
        worst = ", ".join(f"{k} {v:.1e}" for k, v in (r.get("worst_rel_diff") or {}).items())
        lines.append(
            f"| {n} | {r['status']} | {r.get('tolerance', '')} | {worst or r.get('error')} |"
        )
    lines += [
        "",
        "One rank, TMP 2, the report's shape (H=2048, seq 1024, micro-batch 2), bf16:",
        "",
    ]
    lines += ["| variant | calls/layer | kernels/layer | GPU µs/layer | GPU idle | iteration s "
              "(8 layers) | max allocated GB |", "|---|---|---|---|---|---|---|"]  # fmt: skip
    for n, r in g["host"].items():
        if "error" in r:
            lines.append(f"| {n} | failed: {r['error']} | | | | | |")
            continue
        lines.append(
            f"| {n} | {_fmt(r['aten_calls_per_layer'], '{:.0f}')} | "
            f"{_fmt(r.get('kernels_per_layer'), '{:.0f}')} | "
            f"{_fmt(r.get('gpu_us_per_layer'), '{:.0f}')} | "
            f"{_fmt(r.get('gpu_idle_share'), '{:.2f}')} | "
            f"{_fmt(r['iteration_s_8_layers'], '{:.4f}')} | "
            f"{_fmt(r.get('max_allocated_gb_8_layers'), '{:.2f}')} |"
        )
    lines += ["", "One-rank emulated timing (median iteration s; speed-up over stock):", ""]
    for n, r in g["timing"].items():
        sp = r.get("speedup", {})
        cells = ", ".join(
            f"{k} {_fmt(v, '{:.4f}')}" + (f" ({sp[k]:.2f}x)" if k in sp else "")
            for k, v in r.items()
            if k != "speedup"
        )
        lines.append(f"- {n}{_dilation(n, env)}: {cells}")
    if g.get("traces"):
        lines += ["", "Kernel timelines of the first row (Chrome traces, next to this report): "
                  + ", ".join(f"`{t}`" for t in g["traces"])]  # fmt: skip
    return lines


def _commit():
    try:
        return (
            subprocess.run(
                ["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True
            ).stdout.strip()
            or "unknown"
        )
    except OSError:
        return "unknown"


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dry-run", action="store_true", help="the same steps on the CPU, tiny shapes")
    p.add_argument("--out", default=None, help="report directory")
    p.add_argument(
        "--steps",
        default=",".join(n for n in STEPS if n != "faithful"),
        help="comma-separated subset of the steps (default: all but faithful, which has a "
        "session of its own: --steps env,faithful)",
    )
    p.add_argument("--budget-s", type=float, default=480, help="stop starting steps after this")
    p.add_argument(
        "--parity-configs",
        default=None,
        help="parity: only the configs whose name starts with one of these (comma-separated, "
        "e.g. llama; default all)",
    )
    p.add_argument(
        "--rows",
        default=None,
        help="faithful: profile:TP:micro-batch[:D] rows in priority order (default: the issue's "
        "seven; D forces the dilation, 1 = the GPU is the target)",
    )
    p.add_argument("--iters", type=int, default=None, help="faithful: timed iterations per pass")
    p.add_argument("--step", default=None, help=argparse.SUPPRESS)
    p.add_argument("--result", default=None, help=argparse.SUPPRESS)
    p.add_argument("--gemm-tflops", type=float, default=None, help=argparse.SUPPRESS)
    p.add_argument("--trace-dir", default=None, help=argparse.SUPPRESS)
    p.add_argument("--mem-gbs", type=float, default=None, help=argparse.SUPPRESS)
    p.add_argument("--deadline-s", type=float, default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.rows:
        try:
            parse_rows(args.rows)
        except ValueError as exc:
            p.error(str(exc))
    if args.iters is not None and args.iters < 1:
        p.error("--iters must be at least 1")
    if args.step:  # inside a step's own process
        os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "1")
        fn = STEPS[args.step][0]

        def save(result):
            with open(args.result, "w") as f:
                json.dump(result, f, default=str)

        rated = ("timing", "graphs", "faithful")
        kwargs = {"gemm_rate": args.gemm_tflops} if args.step in rated else {}
        if args.step == "graphs":
            kwargs.update(save=save, trace_dir=args.trace_dir)
        if args.step == "python":
            kwargs = {"save": save}
        if args.step == "faithful":
            kwargs.update(save=save, mem_gbs=args.mem_gbs, trace_dir=args.trace_dir,
                          rows=args.rows, iters=args.iters, deadline_s=args.deadline_s)  # fmt: skip
        if args.step == "parity":
            only = args.parity_configs.split(",") if args.parity_configs else None
            kwargs = {"save": save, "only": only}
        save(fn(args.dry_run, **kwargs))
        return 0
    names = [n.strip() for n in args.steps.split(",") if n.strip()]
    unknown = [n for n in names if n not in STEPS]
    if unknown:
        p.error(f"unknown step(s) {', '.join(unknown)}; choose from {', '.join(STEPS)}")
    t_start = time.time()
    # Every in-process job of every step (helpers.runs.prepared): Megatron's mock-data indices
    # built once per shape, not per job and split, and its parser's docstrings read once per
    # step process: host seconds a GPU waits through between jobs.
    data_cache = None
    if "OASES_TEST_DATA_CACHE" not in os.environ:
        data_cache = os.environ["OASES_TEST_DATA_CACHE"] = tempfile.mkdtemp(prefix="gpu-check-")
    try:
        return _run_steps(args, argv, names, t_start)
    finally:
        if data_cache:
            shutil.rmtree(data_cache, ignore_errors=True)


def _run_steps(args, argv, names, t_start):
    date = datetime.date.today().isoformat()
    import torch

    device = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"
    out = args.out or os.path.join(ROOT, "benchmarks", "results", "gpu", f"{date}-{_slug(device)}")
    os.makedirs(out, exist_ok=True)
    report = {
        "date": date,
        "commit": _commit(),
        "dry_run": args.dry_run,
        "command": "benchmarks/gpu/check.sh "
        + " ".join(argv if argv is not None else sys.argv[1:]),
        "device": device,
        "steps": {},
    }
    with open(os.path.join(out, "check.log"), "w") as log:
        for name in names:
            # a step's limit guards the GPU's device time; the dry run checks the path, not
            # its speed, on a CPU that may be shared: twice the time there
            step_limit = STEPS[name][1] * (2 if args.dry_run else 1)
            limit = min(step_limit, args.budget_s - (time.time() - t_start))
            if limit < 10:
                report["steps"][name] = {"status": "failed", "seconds": 0,
                                         "error": f"not run: budget of {args.budget_s:g} s spent"}  # fmt: skip
                continue
            extra = []
            env = report["steps"].get("env", {}).get("result") or {}
            if name in ("timing", "graphs", "faithful") and env.get("gemm_tflops"):
                rate = env["gemm_tflops"]["bfloat16" if env.get("cuda_available") else "float32"]
                extra = ["--gemm-tflops", repr(rate)]
            if name == "faithful":
                if env.get("memory_gbs"):
                    extra += ["--mem-gbs", repr(env["memory_gbs"])]
                extra += ["--trace-dir", out, "--deadline-s", repr(max(limit - 20, 5))]
                extra += ["--rows", args.rows] if args.rows else []
                extra += ["--iters", str(args.iters)] if args.iters else []
            if name == "parity" and args.parity_configs:
                extra = ["--parity-configs", args.parity_configs]
            if name == "graphs":  # the kernel timelines go next to the report
                extra += ["--trace-dir", out]
            print(f"[gpu-check] {name} (limit {limit:.0f} s) ...", flush=True)
            report["steps"][name] = r = _run_step(name, args.dry_run, limit, log, extra)
            if name == "parity" and r.get("result"):  # a config that failed fails the step
                bad = [k for k, v in r["result"].items() if v["status"] != "ok"]
                if bad:
                    r.update(status="failed", error=f"not ok: {', '.join(bad)}")
            print(f"[gpu-check] {name}: {r['status']} in {r['seconds']} s", flush=True)
            write_report(report, out)  # after every step: a later crash keeps what was found
    failed = [n for n, s in report["steps"].items() if s["status"] != "ok"]
    print(f"[gpu-check] wrote {out}/report.md; {len(names) - len(failed)}/{len(names)} steps ok"
          + (f"; failed: {', '.join(failed)}" if failed else ""), flush=True)  # fmt: skip
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
