"""Schedule tracer: compute segments and communications per rank, as Chrome-trace JSON.

File format (one file per rank; open in chrome://tracing or Perfetto)::

    {"traceEvents": [
        {"name": "F attention L0 sb0", "cat": "compute", "ph": "X", "pid": <rank>, "tid": 0,
         "ts": <µs since iteration start>, "dur": <µs>,
         "args": {"pass": "forward|recompute|backward", "layer": <global layer>,
                  "block": "attention|mlp|other", "sub_batch": 0|1|-1, "microbatch": <m>}},
        {"name": "all_reduce", "cat": "comm", "ph": "X", "pid": <rank>, "tid": 1,
         "ts": <issue µs>, "dur": <done − issue µs>,
         "args": {..same context.., "op": "all_reduce", "bytes": <n>, "async": true|false,
                  "group_size": <n>, "issue_us": .., "wait_us": <when wait began>, "done_us": ..}}],
     "metadata": {"rank": r, "world_size": n, "schedule": "...", "iteration": k,
                  "iteration_time_us": ...}}

``sub_batch`` is -1 for stock (unsplit) Megatron. Times come from ``time.perf_counter`` on the host;
on GPUs they would need stream events — the tracer is a CPU/testbed instrument.
"""

import contextlib
import json
import os
import time


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

    def _now(self):
        return (time.perf_counter() - self.t0) * 1e6

    def start_iteration(self, iteration):
        self.events, self.iteration, self.t0 = [], iteration, time.perf_counter()
        self._microbatch = 0

    def next_microbatch(self):
        """Index of the next micro-batch entering a TransformerBlock this iteration."""
        mb = getattr(self, "_microbatch", 0)
        self._microbatch = mb + 1
        return mb

    def end_iteration(self):
        self.iteration_time_us = self._now()

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
            start = self._now()
            try:
                yield
            finally:
                if self.enabled:
                    self.events.append(
                        _event(
                            name or _label(ctx),
                            "compute",
                            self.rank,
                            0,
                            start,
                            self._now() - start,
                            ctx,
                        )
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
        )
        rec["async"] = bool(async_op)
        return rec

    def comm_wait(self, rec):
        rec["wait_us"] = self._now()

    def comm_done(self, rec):
        rec["done_us"] = self._now()
        if rec["wait_us"] is None:
            rec["wait_us"] = rec["issue_us"]
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
        return {
            "traceEvents": sorted(self.events, key=lambda e: e["ts"]),
            "metadata": {
                "rank": self.rank,
                "world_size": self.world_size,
                "schedule": self.schedule,
                "iteration": self.iteration,
                "iteration_time_us": getattr(self, "iteration_time_us", self._now()),
            },
        }

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


def trace_path(pattern, rank):
    if "{rank}" in pattern:
        return pattern.format(rank=rank)
    root, ext = os.path.splitext(pattern)
    return f"{root}.rank{rank}{ext or '.json'}"


def load_trace(path):
    with open(path) as f:
        return json.load(f)
