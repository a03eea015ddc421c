"""Timeline PNG of one traced iteration, like the paper's Figure 3.

Per rank two lanes: *compute* (tid 0 events) and *communication* (tid 1: each op from issue to its
completion). Colour = sub-batch (stock/unsplit: purple, sub-batch 0: blue, sub-batch 1: orange), shade
= pass (forward light, recompute medium, backward dark; anything else grey). Time the rank spends
blocked on a communication (``[wait_us, done_us]``) is drawn as red hatching on its compute lane:
that is the exposed communication.
"""

import os

from .analysis import (
    blocked_interval,
    comm_events,
    comm_interval,
    compute_events,
    iteration_us,
    modelled_ends,
    rank_metrics,
    union,
)
from .plotting import pyplot

BASE = {-1: (0.46, 0.33, 0.67), 0: (0.12, 0.47, 0.71), 1: (1.0, 0.50, 0.05)}
SHADE = {"forward": 0.55, "recompute": 0.3, "backward": 0.0}
OTHER = (0.6, 0.6, 0.6)
PASS_LETTER = {"forward": "F", "recompute": "R", "backward": "B"}


def _mix(rgb, amount):
    """Blend ``rgb`` towards white by ``amount`` (0 = unchanged)."""
    return tuple(c + (1.0 - c) * amount for c in rgb)


def color_for(args):
    sb = args.get("sub_batch", -1)
    p = args.get("pass")
    if sb not in BASE or p not in SHADE:
        return OTHER
    return _mix(BASE[sb], SHADE[p])


def plot_timeline(traces, path, title=None, comm_model=None):
    """Write a PNG timeline of ``traces`` (one per rank, as loaded by ``load_traces``).

    ``comm_model`` (see :func:`.analysis.modelled_ends`) draws each transfer to its modelled end.
    """
    plt = pyplot()
    from matplotlib.patches import Patch as LegendPatch

    n = max(1, len(traces))
    fig, ax = plt.subplots(figsize=(14, 1.1 + 1.15 * n))
    yticks, ylabels = [], []
    span = max((iteration_us(t) for t in traces), default=1.0) / 1e3 or 1.0
    used = set()
    for i, trace in enumerate(traces):
        rank = trace.get("metadata", {}).get("rank", i)
        y_comp = (n - 1 - i) * 2.6 + 1.3
        y_comm = (n - 1 - i) * 2.6
        comps = compute_events(trace)
        for e in comps:
            a = e.get("args", {})
            x, w = e["ts"] / 1e3, e["dur"] / 1e3
            ax.broken_barh(
                [(x, w)], (y_comp, 1.0), facecolors=[color_for(a)], edgecolor="white", linewidth=0.3
            )
            used.add((a.get("sub_batch", -1), a.get("pass")))
            if w > span * 0.035:
                sb = a.get("sub_batch", -1)
                label = f"{PASS_LETTER.get(a.get('pass'), '')}{a.get('layer', '')}"
                label += f"/{sb}" if sb >= 0 else ""
                ax.text(x + w / 2, y_comp + 0.5, label, ha="center", va="center", fontsize=6)
        comms = comm_events(trace)
        ends = modelled_ends(comms, comm_model) if comm_model else [None] * len(comms)
        for e, model_end in zip(comms, ends):
            a = e.get("args", {})
            s, end = comm_interval(e, model_end)
            ax.broken_barh(
                [(s / 1e3, max(end - s, 0.0) / 1e3)],
                (y_comm, 1.0),
                facecolors=[color_for(a)],
                edgecolor="black",
                linewidth=0.3,
            )
            used.add((a.get("sub_batch", -1), a.get("pass")))
        exposed = union([blocked_interval(e) for e in comms])
        if exposed:
            ax.broken_barh(
                [(s / 1e3, (e - s) / 1e3) for s, e in exposed],
                (y_comp, 1.0),
                facecolors="none",
                edgecolor="red",
                hatch="////",
                linewidth=0.6,
            )
        m = rank_metrics(trace, comm_model)
        yticks += [y_comp + 0.5, y_comm + 0.5]
        ylabels += [f"rank {rank} compute", f"rank {rank} comm"]
        ax.text(
            span * 1.005,
            y_comp + 1.05,
            f"exposed comm {100 * m['exposed_share']:.0f}%, eff. {m['efficiency']:.2f}",
            fontsize=7,
            ha="right",
            va="bottom",
        )
    ax.set_yticks(yticks)
    ax.set_yticklabels(ylabels, fontsize=8)
    ax.set_xlim(0, span * 1.01)
    ax.set_ylim(-0.3, n * 2.6)
    ax.set_xlabel("time in the iteration (ms, host clock)")
    md = traces[0].get("metadata", {}) if traces else {}
    ax.set_title(
        title or f"schedule {md.get('schedule', '?')}, iteration {md.get('iteration', '?')}",
        fontsize=10,
    )
    handles = []
    for sb, name in ((-1, "stock"), (0, "sub-batch 0"), (1, "sub-batch 1")):
        for p in ("forward", "recompute", "backward"):
            if (sb, p) in used:
                handles.append(LegendPatch(facecolor=_mix(BASE[sb], SHADE[p]), label=f"{name} {p}"))
    if any(k[1] not in SHADE or k[0] not in BASE for k in used):
        handles.append(LegendPatch(facecolor=OTHER, label="other"))
    handles.append(
        LegendPatch(
            facecolor="none", edgecolor="red", hatch="////", label="exposed (blocked on comm)"
        )
    )
    ax.legend(
        handles=handles,
        fontsize=7,
        ncol=min(len(handles), 4),
        loc="upper center",
        bbox_to_anchor=(0.5, -0.18 - 0.02 * (3 - min(n, 3))),
        frameon=False,
    )
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)) or ".", exist_ok=True)
    fig.savefig(path, dpi=130)
    plt.close(fig)
    return path
