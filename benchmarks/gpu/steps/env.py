"""``env``: torch, CUDA, the GPU, megatron-core, Triton/TE, the GPU's GEMM rate and memory
bandwidth (the host rates the link emulator's device model divides by)."""

import json
import platform
import statistics
import subprocess
import time

from .common import on_cuda

LIMIT_S = 60
OPTIONS = ()


def gemm_tflops(dtype_name, dry):
    """Sustained GEMM rate of this device (TFLOP/s): median of a few square products."""
    import torch

    cuda = on_cuda()
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

    cuda = on_cuda()
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


def run(dry):
    import torch

    out = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda_available": on_cuda(),
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
    if on_cuda():
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


def host_rate(env):
    """The env step's GEMM rate in the run's dtype (bf16 on CUDA, fp32 on the CPU), or None."""
    rates = (env or {}).get("gemm_tflops")
    if not rates:
        return None
    return rates["bfloat16" if env.get("cuda_available") else "float32"]


def report(env, _env=None):
    return ["", "## Environment", "", "```", json.dumps(env, indent=1), "```"]
