"""What a kernel trace says about overlap: a torch.profiler Chrome trace of one emulated step on
CUDA, reduced to the figures that decide whether the collectives ran beside compute.

* spin kernels (``_spin_kernel`` of :mod:`megatron_oases.testbed.spin`, or ``torch.cuda._sleep``'s
  ``spin_kernel``) stand for collectives; every other kernel is compute; copies and memsets are
  neither but keep the GPU busy;
* ``spin_overlapped_us``: the time a spin ran while a compute kernel ran (the overlap itself);
* ``busy_share``: the union of all GPU ops over the profiled window; idle gaps inside it;
* stream waits: each ``cudaStreamWaitEvent`` and what it waits on. :class:`~megatron_oases.
  testbed.link_model.CudaLink` labels its launches ``oases.spin#N`` and the compute stream's waits
  on them ``oases.wait#N`` (``torch.profiler.record_function``, only while tracing), so a wait
  inside ``oases.wait#N`` waits on spin N, one inside ``oases.spin#N`` is the link stream waiting
  for the collective's input; ``stalled_us``: how long the waiting stream sat behind the spin
  (its previous kernel ended before the spin did, and its next one started after it).

:func:`synthetic_trace` builds a small trace of known answers (tests, and the GPU check's dry run
on a CPU, whose traces hold no kernels).
"""

import bisect
import gzip
import json
import re

#: kernel names of the collective stand-ins
SPIN_NAMES = ("_spin_kernel", "spin_kernel")
WAIT_CALLS = ("cudaStreamWaitEvent", "cuStreamWaitEvent")
LAUNCH_CALLS = ("cudaLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernel", "cuLaunchKernelEx")
GAP_US = 100.0  # idle gaps longer than this are counted
_LABEL = re.compile(r"^oases\.(spin|wait)#(\d+)$")


def load(path):
    opener = gzip.open if str(path).endswith(".gz") else open
    with opener(path, "rt") as f:
        return json.load(f)


def _union(intervals):
    out = []
    for a, b in sorted(intervals):
        if out and a <= out[-1][1]:
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b])
    return out


def _length(union):
    return sum(b - a for a, b in union)


def _intersection(u, v):
    i = j = 0
    total = 0.0
    while i < len(u) and j < len(v):
        a, b = max(u[i][0], v[j][0]), min(u[i][1], v[j][1])
        if b > a:
            total += b - a
        if u[i][1] < v[j][1]:
            i += 1
        else:
            j += 1
    return total


def is_spin(name):
    return any(n in name for n in SPIN_NAMES)


def analyse(trace):
    """The overlap figures of a Chrome trace (a dict, or a path to ``.json``/``.json.gz``)."""
    if not isinstance(trace, dict):
        trace = load(trace)
    events = [e for e in trace.get("traceEvents", []) if e.get("ph") == "X"]
    gpu_ops = [e for e in events if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]
    kernels = [e for e in gpu_ops if e.get("cat") == "kernel"]
    spins = [e for e in kernels if is_spin(e["name"])]
    compute = [e for e in kernels if not is_spin(e["name"])]
    iv = lambda es: [(float(e["ts"]), float(e["ts"]) + float(e.get("dur", 0))) for e in es]  # noqa
    host = [e for e in events if e.get("cat") in ("cpu_op", "user_annotation", "cuda_runtime")]
    spans = iv(host + gpu_ops)
    out = {"kernels": len(kernels), "spin_kernels": len(spins), "compute_kernels": len(compute)}
    if not spans:
        return dict(out, window_us=0.0, note="no events")
    window = (min(a for a, _ in spans), max(b for _, b in spans))
    busy = _union(iv(gpu_ops))
    spin_u, comp_u = _union(iv(spins)), _union(iv(compute))
    spin_us = _length(spin_u)
    overlapped = _intersection(spin_u, comp_u)
    gaps = []
    if busy:
        gaps = [busy[k + 1][0] - busy[k][1] for k in range(len(busy) - 1)]
    long_gaps = [g for g in gaps if g > GAP_US]
    win = window[1] - window[0]
    out.update(
        window_us=win,
        gpu_busy_us=_length(busy),
        busy_share=_length(busy) / win if win > 0 else None,
        compute_us=_length(comp_u),
        spin_us=spin_us,
        spin_overlapped_us=overlapped,
        spin_overlapped_share=overlapped / spin_us if spin_us > 0 else None,
        concurrent_streams_us=_concurrency(kernels),
        idle_in_gpu_span_us=(busy[-1][1] - busy[0][0] - _length(busy)) if busy else 0.0,
        idle_gaps_over_100us=len(long_gaps),
        idle_gaps_over_100us_total_us=sum(long_gaps),
        largest_gap_us=max(gaps, default=0.0),
        streams=sorted({e.get("args", {}).get("stream") for e in kernels}, key=str),
        spin_streams=sorted({e.get("args", {}).get("stream") for e in spins}, key=str),
    )
    out["stream_waits"] = _stream_waits(events, kernels)
    kinds = {}
    for w in out["stream_waits"]:
        kinds[w["waits_on"].split("#")[0]] = kinds.get(w["waits_on"].split("#")[0], 0) + 1
    stalls = [w["stalled_us"] for w in out["stream_waits"] if w.get("stalled_us")]
    out["stream_wait_summary"] = {
        "by_kind": kinds,
        "on_spins_that_stalled": len(stalls),
        "stalled_us": sum(stalls),
    }
    return out


def _concurrency(kernels):
    """Time during which kernels of two or more streams ran at once (µs)."""
    by_stream = {}
    for e in kernels:
        s = e.get("args", {}).get("stream")
        by_stream.setdefault(s, []).append((float(e["ts"]), float(e["ts"]) + float(e["dur"])))
    unions = [_union(v) for v in by_stream.values()]
    total = 0.0
    for i in range(len(unions)):
        others = _union([iv for j, u in enumerate(unions) if j != i for iv in u])
        total = max(total, _intersection(unions[i], others))
    return total


def _stream_waits(events, kernels):
    """Each stream wait in issue order: what it waits on (``spin#N``: the emulated collective N;
    ``input#N``: spin N's stream waiting for its input; ``other``) and, for a wait on a spin,
    whether the waiting stream sat behind it."""
    labels = {}  # tid -> sorted [(start, end, kind, n)]
    for e in events:
        if e.get("cat") == "user_annotation":
            m = _LABEL.match(e.get("name", ""))
            if m:
                ts = float(e["ts"])
                labels.setdefault(e.get("tid"), []).append(
                    (ts, ts + float(e["dur"]), m.group(1), int(m.group(2)))
                )
    for v in labels.values():
        v.sort()

    def label_of(e):
        ts, best = float(e["ts"]), None
        for a, b, kind, n in labels.get(e.get("tid"), ()):
            if a <= ts <= b:
                best = (kind, n)  # innermost: the last opened that contains it
            elif a > ts:
                break
        return best

    by_corr = {e.get("args", {}).get("correlation"): e for e in kernels}
    spin_of = {}  # N -> the spin kernel launched inside oases.spin#N
    launches = []  # (launch ts, kernel) for every kernel launch, to find a wait's next kernel
    for e in events:
        if e.get("cat") in ("cuda_runtime", "cuda_driver") and e["name"] in LAUNCH_CALLS:
            k = by_corr.get(e.get("args", {}).get("correlation"))
            if k is None:
                continue
            launches.append((float(e["ts"]), k))
            lab = label_of(e)
            if lab and lab[0] == "spin" and is_spin(k["name"]):
                spin_of[lab[1]] = k
    launches.sort(key=lambda x: x[0])
    launch_ts = [t for t, _ in launches]
    by_stream = {}
    for k in kernels:
        by_stream.setdefault(k.get("args", {}).get("stream"), []).append(k)
    for v in by_stream.values():
        v.sort(key=lambda k: float(k["ts"]))
    out = []
    waits = [
        e
        for e in events
        if e.get("cat") in ("cuda_runtime", "cuda_driver") and e["name"] in WAIT_CALLS
    ]
    for e in sorted(waits, key=lambda e: float(e["ts"])):
        lab = label_of(e)
        rec = {"ts": float(e["ts"]), "tid": e.get("tid")}
        if lab is None:
            rec["waits_on"] = "other"
        elif lab[0] == "spin":
            rec["waits_on"] = f"input#{lab[1]}"
        else:
            rec["waits_on"] = f"spin#{lab[1]}"
            spin = spin_of.get(lab[1])
            # the waiting stream: that of the next kernel this thread launches after the wait
            i = bisect.bisect_right(launch_ts, rec["ts"])
            nxt = next(
                (k for t, k in launches[i:] if not is_spin(k["name"])),
                None,
            )
            if spin is not None and nxt is not None:
                s_end = float(spin["ts"]) + float(spin["dur"])
                stream = nxt.get("args", {}).get("stream")
                ks = by_stream.get(stream, [])
                j = ks.index(nxt)
                prev_end = float(ks[j - 1]["ts"]) + float(ks[j - 1]["dur"]) if j else None
                start = float(nxt["ts"])
                rec.update(
                    stream=stream,
                    spin_stream=spin.get("args", {}).get("stream"),
                    spin_end_before_next_kernel_us=start - s_end,
                    spin_running_when_reached=prev_end is not None and prev_end < s_end,
                    stalled_us=(
                        max(0.0, min(start, s_end) - prev_end)
                        if prev_end is not None and prev_end < s_end and start >= s_end - 1.0
                        else 0.0
                    ),
                )
        out.append(rec)
    return out


def synthetic_trace():
    """A trace of known answers: compute on stream 7, spins 1 and 2 on stream 93. Spin 1
    (100-200 µs) runs beside compute (50-250 µs) and is waited on after it ended; spin 2
    (300-400) runs alone and the compute stream waits on it: it sits idle from its previous
    kernel's end (250) to the spin's (400), 150 µs. Busy 50-250 and 300-500 of 0-600."""
    ev = []
    corr = [0]

    def kernel(name, stream, ts, dur, launch_ts, tid=1):
        corr[0] += 1
        c = corr[0]
        ev.append(
            {
                "ph": "X",
                "cat": "cuda_runtime",
                "name": "cudaLaunchKernel",
                "pid": 1,
                "tid": tid,
                "ts": launch_ts,
                "dur": 2,
                "args": {"correlation": c},
            }
        )
        ev.append({"ph": "X", "cat": "kernel", "name": name, "pid": 0, "tid": stream, "ts": ts,
                   "dur": dur, "args": {"stream": stream, "correlation": c}})  # fmt: skip

    def runtime(name, ts, tid=1):
        ev.append({"ph": "X", "cat": "cuda_runtime", "name": name, "pid": 1, "tid": tid,
                   "ts": ts, "dur": 1, "args": {"correlation": 0}})  # fmt: skip

    def label(name, ts, dur, tid=1):
        ev.append({"ph": "X", "cat": "user_annotation", "name": name, "pid": 1, "tid": tid,
                   "ts": ts, "dur": dur, "args": {}})  # fmt: skip

    ev.append({"ph": "X", "cat": "cpu_op", "name": "step", "pid": 1, "tid": 1, "ts": 0,
               "dur": 600, "args": {}})  # fmt: skip
    label("oases.spin#1", 10, 10)
    runtime("cudaStreamWaitEvent", 11)  # the link stream waits for its input
    kernel("_spin_kernel", 93, 100, 100, 12)
    kernel("ampere_bf16_gemm", 7, 50, 200, 30)
    label("oases.wait#1", 40, 5)
    runtime("cudaStreamWaitEvent", 41)  # reached at 250 > spin end 200: no stall
    label("oases.spin#2", 45, 10)
    runtime("cudaStreamWaitEvent", 46)
    kernel("_spin_kernel", 93, 300, 100, 47)
    label("oases.wait#2", 50, 5)
    runtime("cudaStreamWaitEvent", 51)  # compute sits behind spin 2: 250-400
    kernel("elementwise_kernel", 7, 400, 100, 60)
    runtime("cudaStreamWaitEvent", 70)  # someone else's wait
    return {"traceEvents": ev}
