"""Schedule tracer: compute segments and communications per rank, as Chrome-trace JSON.

File format (one file per rank; open in chrome://tracing or Perfetto)::

    {"traceEvents": [
        {"name": "F attention L0 sb0", "cat": "compute", "ph": "X", "pid": <rank>, "tid": 0,
         "ts": <µs since iteration start>, "dur": <µs>,
         "args": {"pass": "forward|recompute|backward", "layer": <global layer>,
                  "block": "attention|mlp|layer|other", "sub_batch": 0|1|-1, "microbatch": <m>,
                  "cpu_us": <CPU time of the tracing thread during the op>,
                  "runq_us": <time it waited for a CPU during the op>}},
        {"name": "all_reduce", "cat": "comm", "ph": "X", "pid": <rank>, "tid": 1,
         "ts": <issue µs>, "dur": <done − issue µs>,
         "args": {..same context.., "op": "all_reduce", "bytes": <n>, "async": true|false,
                  "group_size": <n>, "issue_us": .., "wait_us": <when wait began>, "done_us": ..,
                  "issue_cpu_us": .., "wait_cpu_us": .., "done_cpu_us": ..}}],
     "metadata": {"rank": r, "world_size": n, "schedule": "...", "iteration": k,
                  "iteration_time_us": ..., "iteration_cpu_us": <tracing thread>,
                  "iteration_runq_us": <tracing thread waiting for a CPU>,
                  "process_cpu_us": <all threads of the process>,
                  "threads_cpu_us": {"<thread name>": <µs>, ...},
                  "host_cpu": {"busy_us": <all CPUs of the host>, "steal_us": .., "cpus": n}}}

``sub_batch`` is -1 for stock (unsplit) Megatron. Times come from ``time.perf_counter`` on the host;
on GPUs they would need stream events — the tracer is a CPU/testbed instrument.

CPU times (``*cpu_us``) are ``time.thread_time`` of the thread that runs the iteration (the compute
thread; CPU autograd runs backward on it too), in µs since the iteration started, or ``null`` when
recorded from another thread. Wall minus CPU of an op is time the thread was descheduled (other
threads or processes had the core); CPU between a comm's wait and done is what waiting burnt.
``runq_us`` is the time the thread was runnable but waited for a CPU (``/proc/thread-self/
schedstat``): the part of wall − CPU that contention explains. ``threads_cpu_us`` is every thread's
CPU time over the iteration by thread name (``"compute"`` is the tracing thread; gloo's are
``gloo_tcp_loop`` and ``pt_gloo_runloop``); ``host_cpu`` the whole host's busy CPU time over the
iteration (``/proc/stat``; minus the ranks' own ``process_cpu_us`` it is the load of other
processes). The ``/proc`` figures are Linux-only and absent elsewhere.
"""

import contextlib
import json
import os
import threading
import time

from ..testbed.hostcpu import host_cpu_times, runqueue_us, thread_cpu_times


class Tracer:
    """Collects events of the current iteration; ``context`` sets pass/layer/sub-batch labels."""

    def __init__(self, rank=0, world_size=1, schedule="off"):
        self.rank, self.world_size, self.schedule = rank, world_size, schedule
        self.events = []
        self.iteration = None
        self.t0 = time.perf_counter()
        self._ctx = [
            {"pass": "forward", "layer": -1, "block": "other", "sub_batch": -1, "microbatch": -1}
        ]
        self.enabled = True
        self._open = {}
        self._mark_cpu()

    def _now(self):
        return (time.perf_counter() - self.t0) * 1e6

    def _mark_cpu(self):
        self._thread = threading.get_ident()
        self._native_id = threading.get_native_id()
        self.c0 = time.thread_time()
        self._proc0 = time.process_time()
        self._threads0 = thread_cpu_times()
        self._runq0 = runqueue_us()
        self._host0 = host_cpu_times()

    def cpu_now(self):
        """CPU time (µs) of the tracing thread since the iteration started; None on another thread."""
        if threading.get_ident() != self._thread:
            return None
        return (time.thread_time() - self.c0) * 1e6

    def start_iteration(self, iteration):
        self.events, self.iteration, self.t0 = [], iteration, time.perf_counter()
        self._microbatch = 0
        self._open = {}
        self._mark_cpu()

    def next_microbatch(self):
        """Index of the next micro-batch entering a TransformerBlock this iteration."""
        mb = getattr(self, "_microbatch", 0)
        self._microbatch = mb + 1
        return mb

    def end_iteration(self):
        self.iteration_time_us = self._now()
        self.iteration_cpu_us = self.cpu_now()
        self.process_cpu_us = (time.process_time() - self._proc0) * 1e6
        self.threads_cpu_us = _thread_deltas(self._threads0, thread_cpu_times(), self._native_id)
        runq = runqueue_us()
        self.iteration_runq_us = None if runq is None or self._runq0 is None else runq - self._runq0
        host = host_cpu_times()
        self.host_cpu = None
        if host and self._host0:
            self.host_cpu = {k: host[k] - self._host0[k] for k in ("busy_us", "steal_us")}
            self.host_cpu["cpus"] = host["cpus"]

    @property
    def current(self):
        return self._ctx[-1]

    @contextlib.contextmanager
    def context(self, **labels):
        self._ctx.append(dict(self._ctx[-1], **labels))
        try:
            yield
        finally:
            self._ctx.pop()

    @contextlib.contextmanager
    def compute(self, name=None, **labels):
        """Time a compute segment under the current context (plus ``labels``)."""
        with self.context(**labels):
            ctx = dict(self.current)
            start, cpu, runq = self._now(), self.cpu_now(), runqueue_us()
            try:
                yield
            finally:
                if self.enabled:
                    self._append_compute(name, ctx, start, cpu, runq)

    def open_compute(self, key, **labels):
        """Start a compute segment that :meth:`close_compute` (same ``key``) ends: for code that
        cannot be wrapped in :meth:`compute` (stock Megatron's backward, bracketed by gradient
        hooks). A segment still open at the next iteration is dropped."""
        ctx = dict(self.current, **labels)
        self._open[key] = (ctx, self._now(), self.cpu_now(), runqueue_us())

    def close_compute(self, key, name=None):
        opened = self._open.pop(key, None)
        if opened is not None and self.enabled:
            self._append_compute(name, *opened)

    def _append_compute(self, name, ctx, start, cpu, runq):
        end, cpu_end, runq_end = self._now(), self.cpu_now(), runqueue_us()
        ctx["cpu_us"] = None if cpu is None or cpu_end is None else cpu_end - cpu
        ctx["runq_us"] = None if runq is None or runq_end is None else runq_end - runq
        self.events.append(
            _event(name or _label(ctx), "compute", self.rank, 0, start, end - start, ctx)
        )

    def comm_issue(self, op, nbytes, group_size, async_op):
        """Record a communication issue; returns a record to pass to wait/done."""
        rec = dict(
            self.current,
            op=op,
            bytes=int(nbytes),
            group_size=group_size,
            issue_us=self._now(),
            wait_us=None,
            done_us=None,
            issue_cpu_us=self.cpu_now(),
            wait_cpu_us=None,
            done_cpu_us=None,
        )
        rec["async"] = bool(async_op)
        return rec

    def comm_wait(self, rec):
        rec["wait_us"], rec["wait_cpu_us"] = self._now(), self.cpu_now()

    def comm_done(self, rec):
        rec["done_us"], rec["done_cpu_us"] = self._now(), self.cpu_now()
        if rec["wait_us"] is None:
            rec["wait_us"], rec["wait_cpu_us"] = rec["issue_us"], rec["issue_cpu_us"]
        if self.enabled:
            self.events.append(
                _event(
                    rec["op"],
                    "comm",
                    self.rank,
                    1,
                    rec["issue_us"],
                    rec["done_us"] - rec["issue_us"],
                    rec,
                )
            )

    def to_json(self):
        md = {
            "rank": self.rank,
            "world_size": self.world_size,
            "schedule": self.schedule,
            "iteration": self.iteration,
            "iteration_time_us": getattr(self, "iteration_time_us", self._now()),
        }
        keys = ("iteration_cpu_us", "iteration_runq_us", "process_cpu_us", "threads_cpu_us")
        for key in keys + ("host_cpu",):
            if getattr(self, key, None) is not None:
                md[key] = getattr(self, key)
        return {"traceEvents": sorted(self.events, key=lambda e: e["ts"]), "metadata": md}

    def dump(self, path):
        os.makedirs(os.path.dirname(os.path.abspath(path)) or ".", exist_ok=True)
        with open(path, "w") as f:
            json.dump(self.to_json(), f)


def _label(ctx):
    p = {"forward": "F", "recompute": "R", "backward": "B"}.get(ctx["pass"], ctx["pass"])
    sb = "" if ctx["sub_batch"] < 0 else f" sb{ctx['sub_batch']}"
    return f"{p} {ctx['block']} L{ctx['layer']}{sb}"


def _event(name, cat, pid, tid, ts, dur, args):
    return {
        "name": name,
        "cat": cat,
        "ph": "X",
        "pid": pid,
        "tid": tid,
        "ts": ts,
        "dur": dur,
        "args": dict(args),
    }


def _thread_deltas(before, after, compute_tid):
    """CPU µs per thread name between two :func:`thread_cpu_times`; ``compute`` = ``compute_tid``."""
    if not after:
        return None
    out = {}
    for tid, (name, cpu) in after.items():
        key = "compute" if tid == compute_tid else name
        out[key] = out.get(key, 0.0) + max(0.0, cpu - before.get(tid, (name, 0.0))[1]) * 1e6
    return out


def trace_path(pattern, rank):
    if "{rank}" in pattern:
        return pattern.format(rank=rank)
    root, ext = os.path.splitext(pattern)
    return f"{root}.rank{rank}{ext or '.json'}"
