"""Host roofline rates (matmul FLOP/s and memory bandwidth), measured once per host and thread
count, cached on disk.

The link emulator (:mod:`.emulator`) needs the host's two rates for the roofline dilation
``D = host time of a layer ÷ target time of the layer`` (:mod:`megatron_oases.device_model`).
Measuring takes about a second, so the results are cached in
``~/.cache/megatron-oases/host-flops.json`` (``$OASES_CACHE_DIR`` overrides the folder), keyed by a
host fingerprint (host name, CPU model, logical CPUs, CPU capability, torch version) and the torch
intra-op thread count. ``oases calibrate --refresh`` measures again.

What is measured, one warm-up then the best of five (the best, not the mean, so that a momentarily
busy machine does not lower the estimate): an fp32 ``2048×2048 @ 2048×2048`` matmul, and an fp32
element-wise add of two 32 Mi-element tensors into a third (3 × 128 MiB moved: the shape of the
layer's unfused element-wise ops, not a pure copy).
"""

import argparse
import hashlib
import json
import os
import platform
import socket
import time

DEFAULT_N = 2048
DEFAULT_REPS = 5


def cache_dir():
    return os.environ.get("OASES_CACHE_DIR") or os.path.join(
        os.path.expanduser("~"), ".cache", "megatron-oases"
    )


def cache_path():
    return os.path.join(cache_dir(), "host-flops.json")


def _cpu_model():
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.lower().startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def host_fingerprint():
    import torch

    try:
        capability = torch.backends.cpu.get_cpu_capability()
    except Exception:  # noqa: BLE001 - older torch
        capability = "unknown"
    return {
        "hostname": socket.gethostname(),
        "cpu": _cpu_model(),
        "machine": platform.machine(),
        "logical_cpus": os.cpu_count(),
        "cpu_capability": capability,
        "torch": torch.__version__,
    }


def cache_key(threads, fingerprint=None):
    fp = fingerprint or host_fingerprint()
    digest = hashlib.sha1(json.dumps(fp, sort_keys=True).encode()).hexdigest()[:16]
    return f"{digest}-threads{int(threads)}"


def measure_host_flops(threads=None, n=DEFAULT_N, reps=DEFAULT_REPS):
    """Best fp32 matmul FLOP/s of ``reps`` timed ``n³`` products with ``threads`` torch threads."""
    import torch

    old = torch.get_num_threads()
    threads = int(threads or old)
    torch.set_num_threads(threads)
    try:
        gen = torch.Generator().manual_seed(0)
        a = torch.randn(n, n, generator=gen)
        b = torch.randn(n, n, generator=gen)
        torch.mm(a, b)  # warm-up
        best = float("inf")
        for _ in range(reps):
            t0 = time.perf_counter()
            torch.mm(a, b)
            best = min(best, time.perf_counter() - t0)
    finally:
        torch.set_num_threads(old)
    return 2.0 * n**3 / best


MEM_ELEMENTS = 32 * 1024 * 1024


def measure_memory_bandwidth(threads=None, n=MEM_ELEMENTS, reps=DEFAULT_REPS, device="cpu"):
    """Best bytes/s of ``reps`` fp32 ``c = a + b`` over ``n`` elements (reads 2n, writes n)."""
    import torch

    old = torch.get_num_threads()
    threads = int(threads or old)
    torch.set_num_threads(threads)
    cuda = str(device).startswith("cuda")
    try:
        a = torch.ones(n, device=device)
        b = torch.ones(n, device=device)
        c = torch.empty(n, device=device)
        torch.add(a, b, out=c)  # warm-up
        best = float("inf")
        for _ in range(reps):
            if cuda:
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            torch.add(a, b, out=c)
            if cuda:
                torch.cuda.synchronize()
            best = min(best, time.perf_counter() - t0)
    finally:
        torch.set_num_threads(old)
    return 3 * 4 * n / best


def _load_cache():
    try:
        with open(cache_path()) as f:
            data = json.load(f)
        return data if isinstance(data, dict) else {}
    except (OSError, ValueError):
        return {}


def _store_cache(data):
    os.makedirs(cache_dir(), exist_ok=True)
    tmp = f"{cache_path()}.{os.getpid()}.tmp"
    with open(tmp, "w") as f:
        json.dump(data, f, indent=1, sort_keys=True)
    os.replace(tmp, cache_path())


#: A measurement that got less than this share of its threads' CPU time is not cached: the host
#: was busy, and the rate of one rank alone would be understated for as long as the cache lives
#: (a 1-thread matmul measured under load at 21 GFLOP/s on a host that does 72 when quiet).
MIN_CPU_SHARE = 0.8
#: Shorter measurements (the tests' stand-ins) are too short to judge the share.
MIN_JUDGED_S = 0.05


def _measured_quietly(measure, threads):
    """``measure(threads)`` and, where it ran long enough to judge, the share of its threads'
    CPU time it got (process CPU time ÷ wall time ÷ threads); ``None`` where too short."""
    wall0, cpu0 = time.perf_counter(), time.process_time()
    value = float(measure(threads))
    wall = time.perf_counter() - wall0
    share = (time.process_time() - cpu0) / wall / threads if wall >= MIN_JUDGED_S else None
    return value, share


def _cached_rate(key, field, measure, threads, method, refresh):
    """The cached ``field`` under ``key``, or a new measurement, cached only if it ran quietly."""
    entry = _load_cache().get(key)
    if entry and not refresh and entry.get(field, 0) > 0:
        return float(entry[field]), dict(entry, key=key, cached=True)
    value, share = _measured_quietly(measure, threads)
    entry = {
        field: value,
        "threads": threads,
        "fingerprint": host_fingerprint(),
        "method": method,
        "measured_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "cpu_share": share,
    }
    if share is not None and share < MIN_CPU_SHARE:
        reason = (
            f"not cached: the measurement got {share:.0%} of its CPU time (host busy); "
            "run `oases calibrate --refresh` on a quiet host"
        )
        return value, dict(entry, key=key, cached=False, not_cached=reason)
    data = _load_cache()  # re-read: another process may have written meanwhile
    data[key] = entry
    try:
        _store_cache(data)
    except OSError:
        pass  # an unwritable cache only costs a re-measurement next time
    return value, dict(entry, key=key, cached=False)


def rate_source(info, cached="cached", measured="measured now"):
    """Where a rate came from, for the reports: the cache, or measured now (and why not kept)."""
    if info["cached"]:
        return cached
    return measured + (f"; {info['not_cached']}" if info.get("not_cached") else "")


def host_flops(threads=None, refresh=False, measure=measure_host_flops):
    """Host FLOP/s for ``threads`` torch threads (default: the current count): cached or measured.

    Returns ``(flops, info)``; ``info`` says whether it came from the cache, the key and the
    fingerprint, and (``not_cached``) why a measurement on a busy host was not kept.
    """
    import torch

    threads = int(threads or torch.get_num_threads())
    key = cache_key(threads, host_fingerprint())
    method = f"fp32 {DEFAULT_N}^3 torch.mm, best of {DEFAULT_REPS}"
    return _cached_rate(key, "flops", measure, threads, method, refresh)


def host_memory_bandwidth(threads=None, refresh=False, measure=measure_memory_bandwidth):
    """Host memory bandwidth (bytes/s) for ``threads`` torch threads: cached or measured; returns
    ``(bytes_per_s, info)`` as :func:`host_flops`."""
    import torch

    threads = int(threads or torch.get_num_threads())
    key = cache_key(threads, host_fingerprint()) + "-memory"
    method = (
        f"fp32 add of {MEM_ELEMENTS // 2**20} Mi elements (3 x 4 B each), best of {DEFAULT_REPS}"
    )
    return _cached_rate(key, "bytes_per_s", measure, threads, method, refresh)


def host_cpus():
    """CPUs this process may run on (the affinity mask, not the machine's count)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def oversubscription_share(ranks_per_host, threads=1, cpus=None):
    """Share of its calibrated rate one rank gets when ``ranks_per_host`` ranks × ``threads`` threads
    compute at once on ``cpus`` CPUs: 1 when they fit, else cpus ÷ (ranks × threads). The calibration
    times one process alone; e.g. a TMP=4 run on a 2-CPU host time-shares each CPU between two
    ranks, so each rank's emulated GPU is half as fast and D must double to keep the target's
    communication/computation balance. (Tensor-parallel ranks compute and wait in step, so they
    contend for the CPUs together; the emulator's per-rank "CPU share" line shows what they got.)"""
    cpus = host_cpus() if cpus is None else cpus
    return min(1.0, cpus / max(1, int(ranks_per_host) * max(1, int(threads))))


def dilation_for(profile, flops):
    """GEMM-only D (the target GPU's sustained FLOP/s ÷ the host's FLOP/s), for comparison with the
    roofline D of :func:`megatron_oases.testbed.emulator.roofline_dilation`."""
    return profile.sustained_tflops * 1e12 / flops


def main(argv):
    """``oases calibrate``: the host's two rates and, per cluster profile, the roofline dilation of
    one layer of the given shape (its parts: GEMM ms and memory ms, target and host)."""
    from ..device_model import DeviceRates, roofline_dilation
    from .clusters import available, load_cluster

    parser = argparse.ArgumentParser(
        prog="oases calibrate",
        description="Measure (or show the cached) host matmul FLOP/s and memory bandwidth used by "
        "--emulate-link and the resulting time dilation per cluster profile, for one layer of the "
        "given shape (Megatron's flag names; CPU host: fp32, unfused attention; target: the "
        "profile's dtype, fused attention).",
    )
    parser.add_argument(
        "--threads", type=int, default=1, help="torch threads per rank (default 1, torchrun's)"
    )
    parser.add_argument("--refresh", action="store_true", help="measure again, ignore the cache")
    parser.add_argument(
        "--profile", action="append", default=None, help="cluster profile(s) to show; default: all"
    )
    parser.add_argument("--hidden-size", type=int, default=2048)
    parser.add_argument("--num-attention-heads", type=int, default=32)
    parser.add_argument("--ffn-hidden-size", type=int, default=None, help="default 4 x hidden")
    parser.add_argument("--seq-length", type=int, default=1024)
    parser.add_argument("--tensor-model-parallel-size", type=int, default=2)
    parser.add_argument("--micro-batch-size", type=int, default=2)
    parser.add_argument("--swiglu", action="store_true")
    args = parser.parse_args(argv)
    profiles = [load_cluster(p) for p in (args.profile or available())]
    flops, info = host_flops(args.threads, refresh=args.refresh)
    mem, minfo = host_memory_bandwidth(args.threads, refresh=args.refresh)
    h = args.hidden_size
    shape = {
        "hidden_size": h,
        "num_attention_heads": args.num_attention_heads,
        "ffn_hidden_size": args.ffn_hidden_size or 4 * h,
        "seq_length": args.seq_length,
        "swiglu": args.swiglu,
        "core_attention": "fused",  # the target: Megatron's default backend on CUDA
    }
    tp, mb = args.tensor_model_parallel_size, args.micro_batch_size
    src, msrc = rate_source(info), rate_source(minfo)
    print(
        f"host: {info['fingerprint']['cpu']} ({info['fingerprint']['logical_cpus']} logical CPUs)"
    )
    print(
        f"host matmul rate: {flops / 1e9:.1f} GFLOP/s with {args.threads} thread(s) ({src}; "
        f"{info['method']}; cache {cache_path()} key {info['key']})"
    )
    print(f"host memory bandwidth: {mem / 1e9:.2f} GB/s ({msrc}; {minfo['method']})")
    print(
        f"one layer, forward, per rank: H={h}, heads={args.num_attention_heads}, "
        f"ffn={shape['ffn_hidden_size']}, seq={args.seq_length}, TP={tp}, micro-batch={mb}"
    )
    host = DeviceRates(flops, mem, "host")
    for p in profiles:
        dl = roofline_dilation(p, shape, tp, host, host_dtype_bytes=4, samples=mb)
        print(
            f"  {p.name:17s} {p.sustained_tflops:6.1f} TFLOP/s, "
            f"{p.memory_bandwidth_gbs or 0:6.0f} GB/s: target GEMM {dl.target.gemm_s * 1e3:8.3f} ms"
            f" + memory {dl.target.memory_s * 1e3:7.3f} ms; host GEMM {dl.host.gemm_s * 1e3:9.1f}"
            f" ms + memory {dl.host.memory_s * 1e3:8.1f} ms => D = {dl.d:8.1f} "
            f"(GEMM-only {dilation_for(p, flops):8.1f})"
        )
    return 0
