"""Metrics from schedule traces (:mod:`megatron_oases.instrument.trace` format), per rank and per run.

Per rank, over the traced iteration (``T`` = ``metadata.iteration_time_us``):

* ``compute_us``: the rank's busy time ``T − exposed_us``. A CPU rank runs one thread: whenever it is
  not blocked in a communication it is computing (layers, embedding, loss, optimizer, host overhead).
  This is the same for every variant, whatever its tracer labels. ``traced_compute_us`` is the length
  of the union of labelled compute events (tid 0), for the timeline; it can be smaller.
* ``comm_us``: length of the union of communication intervals ``[issue_us, end]`` (tid 1), where
  ``end`` is the modelled completion when known — the tracer's ``model_done_us``, or a replay of the
  emulator's channels (:func:`modelled_ends`, given the run's emulation parameters) — and ``done_us``
  otherwise; never later than ``done_us``. (An async op waited on late would otherwise count as
  communicating until the wait.)
* ``exposed_us``: length of the union of *blocked* intervals ``[wait_us, done_us]`` (the rank waits in
  a synchronous collective or in ``Work.wait()``); ``exposed_share`` = it ÷ T.
* ``efficiency`` = overlap bound ÷ measured time = ``max(compute_us, comm_us) ÷ T`` (1.0: everything
  that could hide did hide; the paper's Table 2 reports SM efficiency, which this approximates).

A run's value is the mean over ranks (per-rank values are kept).
"""

import glob
import json
import os


def union(intervals):
    """Merge ``[(start, end)]`` into sorted disjoint intervals."""
    out = []
    for s, e in sorted((float(s), float(e)) for s, e in intervals if e > s):
        if out and s <= out[-1][1]:
            if e > out[-1][1]:
                out[-1][1] = e
        else:
            out.append([s, e])
    return [tuple(x) for x in out]


def length(intervals):
    return sum(e - s for s, e in union(intervals))


def subtract(intervals, minus):
    """``intervals`` minus ``minus`` (both lists of (start, end)); returns disjoint intervals."""
    a, b = union(intervals), union(minus)
    out, j = [], 0
    for s, e in a:
        cur = s
        while j < len(b) and b[j][1] <= cur:
            j += 1
        k = j
        while k < len(b) and b[k][0] < e:
            if b[k][0] > cur:
                out.append((cur, b[k][0]))
            cur = max(cur, b[k][1])
            k += 1
        if cur < e:
            out.append((cur, e))
    return out


def compute_events(trace):
    return [
        e
        for e in trace.get("traceEvents", [])
        if e.get("cat") == "compute"
        or (e.get("cat") != "comm" and e.get("tid") == 0 and e.get("ph") == "X")
    ]


def comm_events(trace):
    return [
        e
        for e in trace.get("traceEvents", [])
        if e.get("cat") == "comm"
        or (e.get("cat") != "compute" and e.get("tid") == 1 and e.get("ph") == "X")
    ]


def comm_interval(ev, model_end=None):
    """``[issue, end]`` of a communication: ``end`` = the modelled completion when known (the
    tracer's ``model_done_us``, else ``model_end`` from :func:`modelled_ends`), never after
    ``done_us`` (when the wait returned)."""
    a = ev.get("args", {})
    issue = a.get("issue_us", ev["ts"])
    done = a.get("done_us", ev["ts"] + ev["dur"])
    end = a.get("model_done_us", model_end)
    end = done if end is None else min(float(end), done)
    return issue, max(issue, end)


def modelled_ends(comms, comm_model):
    """Replay the emulator's channels over a rank's comm events: modelled end time of each.

    ``comm_model(event)`` gives an op's emulated duration (µs) or None. Ops on one group (keyed by
    group size, which identifies the TP group in a TP-only layout) queue behind each other, as in
    :class:`megatron_oases.testbed.link_model.LinkEmulator`.
    """
    busy, ends = {}, [None] * len(comms)
    order = sorted(
        range(len(comms)), key=lambda i: comms[i].get("args", {}).get("issue_us", comms[i]["ts"])
    )
    for i in order:
        ev = comms[i]
        dur = comm_model(ev)
        if dur is None:
            continue
        a = ev.get("args", {})
        key = a.get("group_size")
        start = max(a.get("issue_us", ev["ts"]), busy.get(key, float("-inf")))
        ends[i] = busy[key] = start + dur
    return ends


def emulated_comm_model(emulation):
    """``comm_model`` for :func:`rank_metrics` from an ``oases compare`` emulation record.

    Trace ``bytes`` are CPU (fp32) bytes; the emulator counts them at the profile's dtype. Groups
    are taken as the first ``group_size`` global ranks (the TP group's link in a TP-only layout).
    """
    from ..testbed.clusters import load_cluster

    prof = load_cluster(emulation["profile"])
    d = float(emulation["dilation"])
    times = {
        "all_reduce": prof.all_reduce_time,
        "all_gather": prof.all_gather_time,
        "reduce_scatter": prof.reduce_scatter_time,
    }

    def model(ev):
        a = ev.get("args", {})
        fn = times.get(a.get("op"))
        n = int(a.get("group_size") or 1)
        if fn is None:
            return None
        nbytes = int(a.get("bytes", 0)) / 4 * prof.dtype_bytes
        return d * fn(nbytes, list(range(n))) * 1e6

    return model


def blocked_interval(ev):
    a = ev.get("args", {})
    issue = a.get("issue_us", ev["ts"])
    done = a.get("done_us", ev["ts"] + ev["dur"])
    wait = a.get("wait_us")
    wait = issue if wait is None else wait
    return min(max(wait, issue), done), done


def iteration_us(trace):
    md = trace.get("metadata", {})
    t = md.get("iteration_time_us")
    if t:
        return float(t)
    ends = [e["ts"] + e["dur"] for e in trace.get("traceEvents", [])]
    return max(ends, default=0.0)


def rank_metrics(trace, comm_model=None):
    """Metrics of one rank's trace (see module docstring); ``comm_model``: see
    :func:`modelled_ends`."""
    T = iteration_us(trace)
    comp = [(e["ts"], e["ts"] + e["dur"]) for e in compute_events(trace)]
    comms = comm_events(trace)
    ends = modelled_ends(comms, comm_model) if comm_model else [None] * len(comms)
    comm = [comm_interval(e, end) for e, end in zip(comms, ends)]
    blocked = [blocked_interval(e) for e in comms]
    exposed = length(blocked)
    traced_compute = length(comp)
    compute = max(0.0, T - exposed)
    comm_us = length(comm)
    md = trace.get("metadata", {})
    return {
        "rank": md.get("rank"),
        "schedule": md.get("schedule"),
        "iteration_us": T,
        "compute_us": compute,
        "traced_compute_us": traced_compute,
        "comm_us": comm_us,
        "exposed_us": exposed,
        "exposed_share": exposed / T if T else 0.0,
        "efficiency": max(compute, comm_us) / T if T else 0.0,
        "num_comm": len(comms),
        "comm_bytes": sum(int(e.get("args", {}).get("bytes", 0)) for e in comms),
    }


def run_metrics(traces, comm_model=None):
    """Mean of :func:`rank_metrics` over ranks, plus the per-rank list under ``ranks``."""
    per = [rank_metrics(t, comm_model) for t in traces]
    if not per:
        return None
    keys = ("iteration_us", "compute_us", "comm_us", "exposed_us", "exposed_share", "efficiency")
    out = {k: sum(p[k] for p in per) / len(per) for k in keys}
    out["ranks"] = per
    out["num_ranks"] = len(per)
    return out


def trace_files(pattern):
    """Trace files of a run: a ``{rank}`` pattern, a glob, a directory, or one file."""
    if os.path.isdir(pattern):
        files = glob.glob(os.path.join(pattern, "*.json"))
    elif "{rank}" in pattern:
        files = glob.glob(pattern.replace("{rank}", "*"))
    elif any(c in pattern for c in "*?["):
        files = glob.glob(pattern)
    elif os.path.exists(pattern):
        files = [pattern]
    else:
        root, ext = os.path.splitext(pattern)
        files = glob.glob(f"{root}.rank*{ext or '.json'}")
    return sorted(files)


def load_traces(paths):
    """Load trace files (paths, or one pattern accepted by :func:`trace_files`), sorted by rank."""
    if isinstance(paths, str):
        paths = trace_files(paths)
    traces = []
    for p in paths:
        with open(p) as f:
            t = json.load(f)
        if isinstance(t, dict) and "traceEvents" in t:
            traces.append(t)
    return sorted(traces, key=lambda t: t.get("metadata", {}).get("rank", 0))
