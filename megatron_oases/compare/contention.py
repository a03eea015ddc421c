"""What host contention added to a variant's traced iteration, and the iteration without it.

On a shared CPU host other processes take cores from the ranks at random: the compute thread
waits in the run queue (the trace's ``runq_us``), and gloo's threads or a peer rank, waiting
likewise, make a collective complete after the time the link emulator modelled for it. Neither
is the schedule's. Subtracting the compute thread's run-queue wait alone is wrong both ways:
under an overlapped schedule a wait while a collective is in flight costs nothing (the thread
would have waited for the link anyway), and a starved gloo thread's or peer's wait shows as
blocked time, not as run-queue.

:func:`contention_free_us` replays a rank's traced iteration on a host that had a core free
whenever a thread was ready: its running time (not blocked on communication) shrunk to the
compute thread's CPU time in it (the run-queue wait taken out, spread evenly over that time),
each collective issued at its replayed time and completing when the emulator's channel model
says (:func:`megatron_oases.viz.analysis.modelled_ends`' rule: ops on one group queue behind each
other), and each wait lasting until then. A collective with no model (no ``--emulate-link``, an
op the profile does not time) keeps its measured wait. Peers are taken to be in step (the
tensor-parallel ranks do the same work), so a wait for a late peer goes too.
"""

from ..viz.analysis import (
    blocked_interval,
    clip,
    comm_events,
    iteration_us,
    rank_metrics,
    union,
)


def _spans(trace, comms, T):
    """The rank's timeline as ``[(start, end, blocked)]`` over ``[0, T]``."""
    blocked = union(clip([blocked_interval(e) for e in comms], 0.0, T))
    spans, t = [], 0.0
    for s, e in blocked:
        if s > t:
            spans.append((t, s, False))
        spans.append((s, e, True))
        t = e
    if t < T:
        spans.append((t, T, False))
    return spans


def replay_us(trace, comm_model=None):
    """One rank's traced iteration without contention (module docstring), in µs; None where the
    trace has no CPU record (written before the tracer kept one)."""
    T = iteration_us(trace)
    comms = comm_events(trace)
    m = rank_metrics(trace, comm_model)
    if not T or m.get("compute_cpu_us") is None or not m["compute_us"]:
        return None
    keep = min(1.0, m["compute_cpu_us"] / m["compute_us"])  # running time on the CPU
    spans = _spans(trace, comms, T)

    def replayed(t):
        """Real time ``t`` on the replayed clock, for a ``t`` in a running span or at an end."""
        out = 0.0
        for s, e, blocked in spans:
            if t <= s:
                break
            if blocked:
                out = ends.get((s, e), out + (e - s)) if t >= e else out
            else:
                out += (min(t, e) - s) * keep
        return out

    ends = {}  # blocked span -> its replayed end
    busy, done = {}, {}  # group -> channel free (replayed); op -> replayed completion
    order = sorted(comms, key=lambda ev: ev.get("args", {}).get("issue_us", ev["ts"]))
    clock = 0.0
    for s, e, blocked in spans:
        if not blocked:
            clock += (e - s) * keep
            continue
        finish = clock
        for ev in order:
            a = ev.get("args", {})
            if id(ev) not in done:
                issue = a.get("issue_us", ev["ts"])
                if issue > e:
                    break
                dur = comm_model(ev) if comm_model else None
                if dur is None:
                    done[id(ev)] = None  # unmodelled: its measured wait stays
                else:
                    start = max(_at(replayed, issue, clock), busy.get(a.get("group_size"), 0.0))
                    done[id(ev)] = busy[a.get("group_size")] = start + dur
            w0, w1 = blocked_interval(ev)
            if w1 <= s or w0 >= e:
                continue  # not waited for in this span
            end = done[id(ev)]
            finish = max(finish, clock + (min(w1, e) - max(w0, s)) if end is None else end)
        clock = ends[(s, e)] = finish
    return clock


def _at(replayed, t, clock):
    """The replayed time of issue time ``t`` (never later than ``clock``, the replay's now)."""
    return min(replayed(t), clock)


def contention_free_us(traces, comm_model=None):
    """:func:`replay_us` averaged over the ranks' traces; None where a rank's is."""
    each = [replay_us(t, comm_model) for t in traces]
    if not each or any(x is None for x in each):
        return None
    return sum(each) / len(each)
