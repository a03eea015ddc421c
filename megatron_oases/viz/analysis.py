"""Metrics from schedule traces (:mod:`megatron_oases.instrument.trace` format), per rank and per run.

Per rank, over the traced iteration (``T`` = ``metadata.iteration_time_us``; every interval is cut
to ``[0, T]``, since a collective can complete after the iteration's end stamp):

* ``compute_us``: the rank's busy time ``T − exposed_us``. A CPU rank runs one thread: whenever it is
  not blocked in a communication it is computing (layers, embedding, loss, optimizer, host overhead).
  This is the same for every variant, whatever its tracer labels. ``traced_compute_us`` is the length
  of the union of labelled compute events (tid 0), for the timeline; it can be smaller, or for stock
  Megatron larger (its layer segments include their synchronous collectives). On a shared host
  ``compute_us`` also counts the time the thread waited for a core: see ``compute_cpu_us``.
* ``comm_us``: length of the union of communication intervals ``[issue_us, end]`` (tid 1), where
  ``end`` is the modelled completion when known — the tracer's ``model_done_us``, or a replay of the
  emulator's channels (:func:`modelled_ends`, given the run's emulation parameters) — and ``done_us``
  otherwise; never later than ``done_us``. (An async op waited on late would otherwise count as
  communicating until the wait.)
* ``exposed_us``: length of the union of *blocked* intervals ``[wait_us, done_us]`` (the rank waits in
  a synchronous collective or in ``Work.wait()``); ``exposed_share`` = it ÷ T.
* Run level only: ``schedule_exposed_us``, per collective the least time any rank was blocked on
  it (ranks' collectives matched by their labels and order), summed, and averaged per rank. A
  rank's blocked time beyond that waited for a peer that arrived at the collective later (the
  ranks' compute drifting apart on a shared host), not for the link: so this is the exposure the
  schedule itself leaves, and it stays put where ``exposed_us`` swings with host noise.
  ``schedule_exposed_share`` = it ÷ T.
* ``efficiency`` = overlap bound ÷ measured time = ``max(compute_us, comm_us) ÷ T`` (1.0: everything
  that could hide did hide; the paper's Table 2 reports SM efficiency, which this approximates).

CPU time, from the tracer's ``time.thread_time`` stamps of the compute thread (absent in traces
written before the tracer recorded them, then None):

* ``compute_cpu_us``: the compute thread's CPU time while not blocked (``iteration_cpu_us`` minus
  the CPU it spent inside the blocked intervals, ``blocked_cpu_us``). Unlike ``compute_us`` it does
  not grow when the thread is descheduled, so it tells extra *work* (the same op costing more CPU)
  from *contention* (``compute_us − compute_cpu_us``: other threads or processes held the core).
  ``compute_cpu_share`` = ``compute_cpu_us ÷ compute_us``.
* ``blocked_cpu_us``: CPU the compute thread burnt while blocked on communication; near 0 when
  waiting sleeps (the link emulator's waits do), large if a wait spins.
* ``runq_us``: time the compute thread was runnable but waited for a CPU (Linux schedstat): the
  contention itself, measured rather than inferred.
* ``process_cpu_us``: CPU time of all the rank's threads over the iteration;
  ``other_threads_cpu_us`` = it minus the compute thread's (gloo's transfer and reduction threads,
  ``threads_cpu_us`` per thread name): work that competes with compute for the host's cores.
* Run level only (the ranks share one host): ``host_busy_cpu_us``, the host's busy CPU time over the
  iteration (mean over ranks), and ``external_cpu_us`` = it minus the ranks' ``process_cpu_us``:
  what other processes ran meanwhile; ``external_cpu_share`` = that ÷ (host CPUs × iteration).

Per op (:func:`compute_ops`, :func:`op_breakdown`, :func:`format_ops`): each labelled compute event
net of the blocked intervals inside it (stock Megatron's layer segments contain their synchronous
all-reduces), wall and CPU, summed per (pass, layer) so that stock (one batch, sub-batch −1) and the
Oases schedules (two half sub-batches, attention and MLP blocks) compare op for op.
``layer_compute_us`` / ``layer_compute_cpu_us`` are those sums over all labelled layers.

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


def clip(intervals, lo, hi):
    """``intervals`` cut to the window ``[lo, hi]``: a collective that completes after the
    iteration's end stamp (the tracer keeps recording until it writes) counts only inside it, so no
    share or efficiency exceeds 1."""
    return [(max(s, lo), min(e, hi)) for s, e in intervals if min(e, hi) > max(s, lo)]


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


def _get(a, key):
    v = a.get(key)
    return None if v is None else float(v)


def blocked_spans(comms):
    """Merged blocked intervals ``(start_us, end_us, cpu_us)`` of a rank's comm events; ``cpu_us``
    is the compute thread's CPU time inside the interval, None when the trace has no CPU stamps."""
    spans = []
    for ev in comms:
        a = ev.get("args", {})
        s, e = blocked_interval(ev)
        if e <= s:
            continue
        c0 = _get(a, "wait_cpu_us" if a.get("wait_us") is not None else "issue_cpu_us")
        c1 = _get(a, "done_cpu_us")
        spans.append([s, e, c0, c1])
    spans.sort(key=lambda x: (x[0], x[1]))
    merged = []
    for s, e, c0, c1 in spans:
        if merged and s <= merged[-1][1]:
            m = merged[-1]
            if e > m[1]:
                m[1], m[3] = e, c1
            elif e == m[1] and c1 is not None and (m[3] is None or c1 > m[3]):
                m[3] = c1
        else:
            merged.append([s, e, c0, c1])
    out = []
    for s, e, c0, c1 in merged:
        cpu = None if c0 is None or c1 is None else max(0.0, c1 - c0)
        out.append((s, e, cpu))
    return out


def compute_ops(trace):
    """Labelled compute events of one rank, each net of the blocked intervals inside it: a list of
    ``{"pass", "layer", "block", "sub_batch", "wall_us", "cpu_us"}`` (``cpu_us`` None without CPU
    stamps). Stock Megatron's layer segments contain synchronous collectives; those are taken out
    here, so wall and CPU are the layer's compute alone."""
    spans = blocked_spans(comm_events(trace))
    out = []
    for ev in compute_events(trace):
        a = ev.get("args", {})
        s, e = float(ev["ts"]), float(ev["ts"]) + float(ev["dur"])
        wall, cpu, runq = e - s, _get(a, "cpu_us"), _get(a, "runq_us")
        for bs, be, bcpu in spans:
            if be <= s or bs >= e:
                continue
            wall -= min(e, be) - max(s, bs)
            if cpu is not None:
                # A blocked interval straddling the op's edge counts in proportion to its overlap.
                frac = (min(e, be) - max(s, bs)) / (be - bs)
                cpu = None if bcpu is None else cpu - frac * bcpu
        out.append(
            {
                "pass": a.get("pass"),
                "layer": a.get("layer"),
                "block": a.get("block"),
                "sub_batch": a.get("sub_batch", -1),
                "wall_us": max(0.0, wall),
                "cpu_us": None if cpu is None else max(0.0, cpu),
                "runq_us": runq,
            }
        )
    return out


def op_breakdown(traces, keys=("pass", "layer")):
    """Per label (``keys`` of each compute op) the net wall, CPU and run-queue µs summed over a
    rank's ops and averaged over ranks: ``{(pass, layer): {"wall_us", "cpu_us", "runq_us", "ops"}}``
    (``cpu_us``/``runq_us`` None when a trace lacks them). Summing over sub-batches and blocks makes
    stock (sub-batch −1, block ``layer``) and the Oases schedules comparable per (pass, layer)."""
    if isinstance(traces, dict):
        traces = [traces]
    fields = ("wall_us", "cpu_us", "runq_us")
    per_rank = []
    for t in traces:
        acc = {}
        for op in compute_ops(t):
            if op["layer"] is None or op["layer"] < 0:
                continue
            d = acc.setdefault(tuple(op[key] for key in keys), dict.fromkeys(fields, 0.0))
            d["ops"] = d.get("ops", 0) + 1
            for f in fields:
                d[f] = None if d[f] is None or op[f] is None else d[f] + op[f]
        per_rank.append(acc)
    out = {}
    n = max(1, len(per_rank))
    for k in sorted({k for acc in per_rank for k in acc}, key=lambda k: tuple(map(str, k))):
        rows = [acc.get(k) or dict.fromkeys(fields, 0.0) for acc in per_rank]
        out[k] = {"ops": sum(r.get("ops", 0) for r in rows) / n}
        for f in fields:
            vals = [r[f] for r in rows]
            out[k][f] = None if any(v is None for v in vals) else sum(vals) / n
    return out


_PASS_ORDER = {"forward": 0, "recompute": 1, "backward": 2}


def format_ops(runs):
    """Text table of :func:`op_breakdown` per (pass, layer) for ``runs`` = ``{name: traces}``: per
    run the wall, CPU and run-queue ms (wall ≈ CPU + run-queue wait: an op that costs more CPU did
    more work, one that waited longer for a CPU was contended), then each run's CPU ÷ the first's.
    """
    names = list(runs)
    tables = {name: op_breakdown(runs[name]) for name in names}
    keys = sorted(
        {k for t in tables.values() for k in t},
        key=lambda k: (_PASS_ORDER.get(k[0], 9), k[1] if isinstance(k[1], int) else 0),
    )
    fields = ("wall_us", "cpu_us", "runq_us")
    header = ["pass", "layer"]
    for name in names:
        header += [f"{name} wall ms", f"{name} CPU ms", f"{name} runq ms"]
    header += [f"CPU {name}/{names[0]}" for name in names[1:]]

    def ms(v):
        return "-" if v is None else f"{v / 1e3:.1f}"

    def row(label, vals):
        out = list(label)
        for v in vals:
            out += [ms(v.get(f)) if v else "-" for f in fields]
        base = vals[0]
        for v in vals[1:]:
            ok = v and base and v["cpu_us"] is not None and base["cpu_us"]
            out.append(f"{v['cpu_us'] / base['cpu_us']:.3f}" if ok else "-")
        return out

    rows = [header]
    for k in keys:
        rows.append(row((str(k[0]), str(k[1])), [tables[name].get(k) for name in names]))
    totals = []
    for name in names:
        t = list(tables[name].values())
        tot = {}
        for f in fields:
            vals = [v[f] for v in t]
            tot[f] = None if any(x is None for x in vals) else sum(vals)
        totals.append(tot)
    rows.append(row(("all", "layers"), totals))
    widths = [max(len(r[i]) for r in rows) for i in range(len(header))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows)


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
    comp = clip([(e["ts"], e["ts"] + e["dur"]) for e in compute_events(trace)], 0.0, T)
    comms = comm_events(trace)
    ends = modelled_ends(comms, comm_model) if comm_model else [None] * len(comms)
    comm = clip([comm_interval(e, end) for e, end in zip(comms, ends)], 0.0, T)
    blocked = clip([blocked_interval(e) for e in comms], 0.0, T)
    exposed = length(blocked)
    traced_compute = length(comp)
    compute = max(0.0, T - exposed)
    comm_us = length(comm)
    md = trace.get("metadata", {})
    cpu = _cpu_metrics(trace, comms, compute)
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
        **cpu,
    }


def _cpu_metrics(trace, comms, compute_us):
    """The CPU-time metrics of :func:`rank_metrics` (module docstring); None where not traced."""
    md = trace.get("metadata", {})
    it_cpu = _get(md, "iteration_cpu_us")
    spans = blocked_spans(comms)
    blocked_cpu = None if any(c is None for _, _, c in spans) else sum(c for _, _, c in spans)
    compute_cpu = None if it_cpu is None or blocked_cpu is None else max(0.0, it_cpu - blocked_cpu)
    proc = _get(md, "process_cpu_us")
    ops = compute_ops(trace)
    layer_ops = [o for o in ops if o["layer"] is not None and o["layer"] >= 0]
    layer_cpu = [o["cpu_us"] for o in layer_ops]
    return {
        "runq_us": _get(md, "iteration_runq_us"),
        "compute_cpu_us": compute_cpu,
        "compute_cpu_share": compute_cpu / compute_us if compute_cpu and compute_us else None,
        "blocked_cpu_us": blocked_cpu if it_cpu is not None else None,
        "iteration_cpu_us": it_cpu,
        "process_cpu_us": proc,
        "other_threads_cpu_us": None if proc is None or it_cpu is None else max(0.0, proc - it_cpu),
        "threads_cpu_us": md.get("threads_cpu_us"),
        "layer_compute_us": sum(o["wall_us"] for o in layer_ops),
        "layer_compute_cpu_us": (
            None if not layer_ops or any(c is None for c in layer_cpu) else sum(layer_cpu)
        ),
    }


#: CPU-time metrics averaged over ranks by :func:`run_metrics` (None unless every rank has them).
CPU_KEYS = (
    "runq_us",
    "compute_cpu_us",
    "compute_cpu_share",
    "blocked_cpu_us",
    "iteration_cpu_us",
    "process_cpu_us",
    "other_threads_cpu_us",
    "layer_compute_us",
    "layer_compute_cpu_us",
)


def run_metrics(traces, comm_model=None):
    """Mean of :func:`rank_metrics` over ranks, plus the per-rank list under ``ranks``."""
    per = [rank_metrics(t, comm_model) for t in traces]
    if not per:
        return None
    keys = ("iteration_us", "compute_us", "comm_us", "exposed_us", "exposed_share", "efficiency")
    out = {k: sum(p[k] for p in per) / len(per) for k in keys}
    for k in CPU_KEYS:  # only when every rank has it
        vals = [p.get(k) for p in per]
        out[k] = None if any(v is None for v in vals) else sum(vals) / len(vals)
    out.update(_host_metrics(traces, per))
    least = schedule_exposed_us(traces)
    out["schedule_exposed_us"] = least
    T = out["iteration_us"]
    out["schedule_exposed_share"] = least / T if least is not None and T else None
    out["ranks"] = per
    out["num_ranks"] = len(per)
    return out


def _comm_key(ev):
    a = ev.get("args", {})
    keys = ("iteration", "microbatch", "pass", "block", "layer", "sub_batch", "op", "bytes")
    return (ev.get("name"),) + tuple(a.get(k) for k in keys)


def schedule_exposed_us(traces):
    """Blocked time no rank avoided, per rank (module docstring): each collective's least
    blocked time over the ranks that issued it (a collective only one rank's trace has keeps its
    own), summed over the ranks' collectives and averaged over ranks. One rank (a one-rank run,
    whose peers are virtual) has no peer to wait for: all its blocked time is the link's."""
    if not traces:
        return None
    seen = {}  # (labels, occurrence) -> blocked us of each rank that issued it
    for trace in traces:
        count, T = {}, iteration_us(trace)
        for ev in sorted(comm_events(trace), key=lambda e: e["ts"]):
            k = _comm_key(ev)
            n = count[k] = count.get(k, 0) + 1
            seen.setdefault((k, n), []).append(length(clip([blocked_interval(ev)], 0.0, T)))
    return sum(min(v) * len(v) for v in seen.values()) / len(traces)


def _host_metrics(traces, per):
    """Host-wide CPU over the iteration and the part other processes used (module docstring)."""
    hosts = [t.get("metadata", {}).get("host_cpu") for t in traces]
    procs = [p.get("process_cpu_us") for p in per]
    if not hosts or any(h is None for h in hosts) or any(p is None for p in procs):
        return {"host_busy_cpu_us": None, "external_cpu_us": None, "external_cpu_share": None}
    busy = sum(h["busy_us"] for h in hosts) / len(hosts)
    external = max(0.0, busy - sum(procs))
    cap = hosts[0].get("cpus", 0) * sum(p["iteration_us"] for p in per) / len(per)
    return {
        "host_busy_cpu_us": busy,
        "external_cpu_us": external,
        "external_cpu_share": external / cap if cap else None,
    }


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
