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
    calls = {"n": 0}

    def train_step(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] != at_call:
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
