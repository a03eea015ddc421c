"""What one training step costs the host: its aten calls (counted, so the same on every host of one
kind for one shape; some kernels issue nested calls by shape), its wall time and, on CUDA, how long
the GPU was busy inside it (``torch.profiler``).

:func:`profiled_step_patch` wraps Megatron-LM's ``train_step`` so that one chosen call runs under
the profiler. Calls are the ``count`` of every ``aten::`` entry of ``key_averages()``, nested ones
included (``aten::linear`` and the ``aten::mm`` it runs both count): the measure the host-cost
issue's figures use. Per layer = (calls at 2L layers − calls at L layers) ÷ L; the schedule's
extra work per layer shows there, the stage ends (embedding, loss, optimizer) cancel out.
"""

import time

from ..patching import Patch


def _cuda():
    import torch

    return torch.cuda.is_available()


def count_aten_calls(prof):
    """aten calls of a finished ``torch.profiler.profile``."""
    return sum(e.count for e in prof.key_averages() if e.key.startswith("aten::"))


def aten_calls_by_op(prof):
    """``{aten op name: calls}`` of a finished ``torch.profiler.profile``."""
    return {e.key: e.count for e in prof.key_averages() if e.key.startswith("aten::")}


def gpu_busy_us(prof):
    """Length of the union of the profile's CUDA kernel intervals (µs), and the kernel count."""
    spans = sorted(
        (e.time_range.start, e.time_range.end)
        for e in prof.events()
        if getattr(e.device_type, "name", "") == "CUDA"
    )
    busy, end = 0.0, float("-inf")
    for a, b in spans:
        if b > end:
            busy += b - max(a, end)
            end = b
    return busy, len(spans)


def profiled_step_patch(record, at_call=2, trace_path=None):
    """A :class:`Patch` on ``training.train_step``: its ``at_call``-th call (the first warms lazy
    state up) runs under ``torch.profiler``; ``record`` gets ``aten_calls`` (and per op name
    ``aten_by_op``), ``wall_s`` and on
    CUDA ``gpu_busy_s`` and ``kernels``. ``trace_path``: also write that step's Chrome trace."""
    import torch
    from megatron.training import training

    original = training.train_step
    calls = {"train_steps": 0}

    def train_step(*args, **kwargs):
        calls["train_steps"] += 1
        if calls["train_steps"] != at_call:
            return original(*args, **kwargs)
        from torch.profiler import ProfilerActivity, profile

        cuda = _cuda()
        acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
        if cuda:
            torch.cuda.synchronize()
        with profile(activities=acts) as prof:
            t0 = time.perf_counter()
            out = original(*args, **kwargs)
            if cuda:
                torch.cuda.synchronize()
            wall = time.perf_counter() - t0
        if trace_path:
            prof.export_chrome_trace(trace_path)
        by_op = aten_calls_by_op(prof)
        record.update(aten_calls=sum(by_op.values()), aten_by_op=by_op, wall_s=wall)
        if cuda:
            busy, kernels = gpu_busy_us(prof)
            record.update(gpu_busy_s=busy * 1e-6, kernels=kernels)
        return out

    return Patch("step-profiler", [(training, "train_step", train_step)])


#: Python self time is bucketed by the package a frame's file lives in (the first that matches).
PACKAGES = ("megatron_oases", "megatron", "torch")


def _package(filename):
    import os

    for name in PACKAGES:
        if f"{os.sep}{name}{os.sep}" in filename:
            return name
    return "builtin" if filename == "~" else "other"


def python_time_patch(record, first_call=2, calls=6, top=12, unprofiled_calls=None):
    """A :class:`Patch` on ``training.train_step``: calls ``first_call`` .. ``first_call + calls -
    1`` run under cProfile timed by the thread's CPU time (the host's own cost, unmoved by other
    processes; waiting on the GPU is not counted unless the driver spins), the next
    ``unprofiled_calls`` (default ``calls``) without it. ``record`` gets the fastest profiled
    call's ``thread_s``, its self time per package (``by_package``: megatron_oases, megatron,
    torch, builtin (C functions), other), the part of megatron_oases' in its CPU platform
    stand-ins (``platform_s``: ``megatron_oases/platform``, which replace ``torch.cuda`` calls on a
    machine without CUDA and do not run on a GPU host), its ``top`` megatron_oases functions by
    self time (``top_oases``: ``[function, self s, calls]``) and the fastest unprofiled call's
    ``thread_s_unprofiled`` (cProfile slows Python frames more than C calls, so the profiled
    shares are upper bounds).

    Backward runs on this thread in these calls (``set_multithreading_enabled(False)``): on CUDA
    autograd otherwise runs it on a device thread, which one cProfile (``sys.monitoring`` since
    Python 3.12, process-wide) would mix into this thread's stack and clock."""
    import cProfile
    import time as _time

    import torch
    from megatron.training import training

    original = training.train_step
    state = {"train_steps": 0}
    record.update(thread_s=float("inf"), thread_s_unprofiled=float("inf"))
    unprofiled_calls = calls if unprofiled_calls is None else unprofiled_calls

    def train_step(*args, **kwargs):
        state["train_steps"] += 1
        k = state["train_steps"] - first_call
        if not 0 <= k < calls + unprofiled_calls:
            return original(*args, **kwargs)
        prof = cProfile.Profile(_time.thread_time) if k < calls else None
        with torch.autograd.set_multithreading_enabled(False):
            t0 = _time.thread_time()
            if prof is not None:
                prof.enable()
            try:
                return original(*args, **kwargs)
            finally:
                if prof is not None:
                    prof.disable()
                spent = _time.thread_time() - t0
                if prof is None:
                    record["thread_s_unprofiled"] = min(record["thread_s_unprofiled"], spent)
                elif spent < record["thread_s"]:
                    record.update(thread_s=spent, **_by_package(prof, top))

    return Patch("step-cprofile", [(training, "train_step", train_step)])


def _by_package(prof, top):
    import pstats

    by_package, ours, platform = {}, [], 0.0
    for (f, line, func), v in pstats.Stats(prof).stats.items():
        pkg = _package(f)
        by_package[pkg] = by_package.get(pkg, 0.0) + v[2]
        if pkg == "megatron_oases":
            where = f.rsplit("megatron_oases", 1)[-1].lstrip("/\\")
            ours.append([f"{where}:{line}({func})", v[2], v[1]])
            if where.startswith("platform"):
                platform += v[2]
    ours.sort(key=lambda r: -r[1])
    return {"by_package": by_package, "platform_s": platform, "top_oases": ours[:top]}
