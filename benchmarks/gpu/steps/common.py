"""What several steps share: the model shapes, the one-rank Megatron jobs on the fake process
group (timing, host, split, graphs, python, faithful) and the report's number formats."""

import argparse
import contextlib
import json
import os
import shlex
import statistics
import tempfile

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


def on_cuda():
    import torch

    return torch.cuda.is_available()


def flags(text):
    return shlex.split(text)


def graphs_flag():
    """``--oases-cuda-graphs`` (on the CPU its ``eager`` bookkeeping)."""
    return "--oases-cuda-graphs" + ("" if on_cuda() else " eager")


# -- one-rank jobs (timing, host, split, graphs, python, faithful) -------------------------------


def fake_group(world):
    import torch.distributed as dist

    from megatron_oases.launch import init_fake_process_group

    if dist.is_initialized():
        dist.destroy_process_group()
    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE=str(world), LOCAL_WORLD_SIZE="1")
    init_fake_process_group(world)


def one_rank_job(argv, iters, profile_at=None, trace_path=None):
    """One Megatron job on the current fake group; iteration times (s) and the profile record
    (``trace_path``: also the profiled step's Chrome trace)."""
    from megatron_oases.instrument.host_calls import profiled_step_patch
    from megatron_oases.training.inprocess import prepared
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
    argv = flags(
        f"--num-layers {layers} {s[shape]} --vocab-size {s['vocab']} --mock-data "
        "--tensor-model-parallel-size 2 --micro-batch-size 2 --global-batch-size 2 "
        "--hidden-dropout 0 --attention-dropout 0"
    )
    dtype = ["--bf16"] if on_cuda() else []
    return argv + dtype + variant_flags(variant, 2, layers) + list(extra)


def emulated_argv(s, shape, tp, mb, profile, variant, extra=()):
    """A 2-layer one-rank job of ``variant`` (and ``extra`` flags) under ``--emulate-link``. On
    CUDA with Megatron's default two data-loader workers: in-process loading (``--num-workers 0``,
    our CPU default) left the GPU idle 56-66 ms per step while the mock batch was collated
    (2026-11-27 H100 traces at micro-batch 128), which a training run does in its workers. And
    with Megatron's ``--manual-gc`` (its remedy for host jitter): the same traces show a 32 ms
    host stall inside one Dynamo guard check that emptied `oases`'s queue for 6 ms, and one timed
    iteration of 0.81 s against a 0.14 s median, both as a garbage collection would."""
    argv = flags(
        f"--num-layers 2 {s[shape]} --vocab-size {s['vocab']} --mock-data "
        f"--tensor-model-parallel-size {tp} --micro-batch-size {mb} --global-batch-size {mb} "
        f"--hidden-dropout 0 --attention-dropout 0 --emulate-link {profile}"
    )
    device = ["--bf16", "--num-workers", "2", "--manual-gc"] if on_cuda() else []
    return argv + device + variant_flags(variant, mb, 2) + list(extra)


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


def variant_flags(name, micro_batch, layers):
    """The flags of ``oases compare``'s variant ``name`` at this micro-batch and depth."""
    from megatron_oases.compare.variants import VARIANTS

    base = argparse.Namespace(
        micro_batch_size=micro_batch,
        global_batch_size=micro_batch,
        num_layers=layers,
        pipeline_model_parallel_size=1,
    )
    return list(VARIANTS[name].resolved_flags(base))


@contextlib.contextmanager
def forced_dilation(d):
    """The in-process jobs inside run with D forced to ``d`` (None: the emulator's own D), handed
    over as ``oases compare`` hands it to its ranks (:func:`~megatron_oases.testbed.emulator.
    dilation_env`); no D is left forced afterwards."""
    from megatron_oases.testbed.emulator import DILATION_ENV, dilation_env

    if d is not None:
        os.environ.update(dilation_env(d))
    try:
        yield
    finally:
        os.environ.pop(DILATION_ENV, None)


def use_host_rates(gemm_rate=None, mem_gbs=None):
    """The emulator's "host" is this device: its GEMM rate (TFLOP/s, in the run's dtype) and
    memory bandwidth (GB/s), as the env step measured them (``OASES_HOST_FLOPS``,
    ``OASES_HOST_MEM_GBS``: what the in-process jobs' emulator reads)."""
    if gemm_rate:
        os.environ["OASES_HOST_FLOPS"] = repr(gemm_rate * 1e12)
    if mem_gbs:
        os.environ["OASES_HOST_MEM_GBS"] = repr(mem_gbs)


# -- the report's formats -------------------------------------------------------------------------


def fmt(x, spec="{:.3f}"):
    return spec.format(x) if isinstance(x, (int, float)) else str(x)


def times(v):
    return f"{v:.2f}x" if isinstance(v, (int, float)) else "-"


def dilation_note(row, env):
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
