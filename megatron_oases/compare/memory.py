"""``oases compare --memory-budget GB[,GB...]``: every variant's peak memory per rank, and per budget
the fastest stock setting that fits against the fastest Oases setting that fits.

A CPU has no allocator peak to read, so memory is metered: after the timed runs, one untimed pass
runs every variant that ran once more in-process (Megatron's ``pretrain()``, 2 iterations, the
same flags but no link emulator, which changes no memory) and meters the forward+backward of the
second iteration with :class:`~megatron_oases.instrument.memory.LiveTensorMeter` (Python per op:
far too slow for a timed run). Peak per rank = model states (exact from the rank's parameter count,
:func:`~megatron_oases.training.measure.state_bytes`) + that activation peak (activations,
temporaries, in-flight gradients); a variant's figure is its worst rank's, since a budget is per
GPU. Budgets are in GB = 1e9 bytes.
"""

import os

from ..errors import OasesConfigError, last_line
from .variants import VARIANTS

GB = 1e9
LIVE_GROUPS = 12  # groups of live storages kept per variant and rank (largest first)
STOCK_COLOR, OASES_COLOR = "#7b5ea7", "#1f77b4"


def parse_budgets(spec):
    """``"0.05,0.1"`` -> ``[0.05, 0.1]`` (GB, sorted); one line naming the flag otherwise."""
    try:
        budgets = sorted({float(x) for x in spec.split(",") if x.strip()})
    except ValueError:
        budgets = []
    if not budgets or budgets[0] <= 0:
        raise OasesConfigError(
            f"--memory-budget {spec}: give one or more positive GB values, comma-separated"
        )
    return budgets


def is_stock(result):
    """Stock Megatron (``--oases-schedule off``) or an Oases schedule."""
    v = VARIANTS.get(result["name"])
    return v.stock if v is not None else result["name"].startswith("megatron")


def _worker(configs, log_pattern):
    """A :func:`~megatron_oases.launch.run_distributed` rank: Megatron's own output goes to the
    rank's log file (it would bury compare's progress); rank 0 reports each variant done."""
    import torch.distributed as dist

    from ..launch import output_to
    from ..training.measure import memory_per_rank

    rank = dist.get_rank()
    console = output_to(log_pattern.format(rank=rank))
    out = {}
    for name, argv in configs:
        m = memory_per_rank([(name, argv)], breakdown=True)[name]
        if "live_at_peak" in m:  # the largest groups explain a peak; the rest is small change
            m["live_at_peak"] = m["live_at_peak"][:LIVE_GROUPS]
        out[name] = m
        if rank == 0:
            console.write(f"  [memory] {name}: metered\n")
    return out


def measure(variants, train_argv, parsed, nproc, out_dir, timeout, progress=print, one_rank=False):
    """``{name: memory}`` for the (resolved) ``variants``: ``peak_bytes_per_rank``,
    ``activation_bytes``, ``state_bytes`` and ``params`` of the worst rank, every rank's under
    ``ranks``; ``{'error': line}`` where the pass failed. ``parsed``: each variant's Megatron
    args (for the state bytes). ``one_rank``: rank 0 alone on the fake process group (its peak
    stands for every TMP rank's: they hold the same shapes)."""
    from ..launch import run_distributed
    from ..training.measure import state_bytes

    log_dir = os.path.join(out_dir, "memory")
    os.makedirs(log_dir, exist_ok=True)
    progress(
        f"memory pass (untimed, no link emulation): {len(variants)} variant(s), one metered "
        f"forward+backward per rank; Megatron's output in {os.path.relpath(log_dir, out_dir)}/"
    )
    fake = ["--fake-process-group"] if one_rank else []
    configs = [(v.name, list(train_argv) + list(v.flags) + fake) for v in variants]
    log_pattern = os.path.join(log_dir, "log.rank{rank}.txt")
    try:
        per_rank = run_distributed(
            _worker,
            nproc,
            configs,
            log_pattern,
            timeout=timeout * max(len(configs), 1),
            one_rank=one_rank,
        )
    except RuntimeError as exc:
        why = f"memory pass failed: {last_line(exc)}"
        progress(why)
        return {v.name: {"error": why} for v in variants}
    memory = {}
    for v in variants:
        ranks = [r[v.name] for r in per_rank]
        errors = [r["error"] for r in ranks if "error" in r]
        if errors:
            memory[v.name] = {"error": errors[0]}
            progress(f"memory {v.name}: FAILED: {errors[0]}")
            continue
        rows = []
        for r in ranks:
            states = state_bytes(r["params"], parsed[v.name])
            rows.append(dict(r, state_bytes=states, peak_bytes=states + r["activation_bytes"]))
        worst = max(range(len(rows)), key=lambda i: rows[i]["peak_bytes"])
        w = rows[worst]
        memory[v.name] = {
            "peak_bytes_per_rank": w["peak_bytes"],
            "activation_bytes": w["activation_bytes"],
            "state_bytes": w["state_bytes"],
            "params": w["params"],
            "rank": worst,
            "live_at_peak": w.get("live_at_peak"),
            "peak_site": w.get("peak_site"),
            "ranks": [{k: x for k, x in r.items() if k != "live_at_peak"} for r in rows],
        }
        progress(
            f"memory {v.name}: peak {_gb(w['peak_bytes'])} GB per rank (states "
            f"{_gb(w['state_bytes'])} + activations {_gb(w['activation_bytes'])}, rank {worst})"
        )
    return memory


def _peak(r):
    return (r.get("memory") or {}).get("peak_bytes_per_rank") if r["status"] == "ok" else None


def is_measured(result):
    """A variant that ran and whose memory was metered."""
    return _peak(result) is not None


def select(results, budgets_gb):
    """Per budget (GB): the fastest stock and the fastest Oases variant whose peak per rank fits,
    by tokens/s (the same tokens per iteration for every variant), and the speedup of the Oases
    one; a side where nothing fits is None."""
    rows = []
    for budget in budgets_gb:
        fits = [r for r in results if is_measured(r) and _peak(r) <= budget * GB]
        best = {}
        for side, stock in (("stock", True), ("oases", False)):
            cands = [r for r in fits if is_stock(r) == stock]
            best[side] = max(cands, key=lambda r: r["tokens_per_sec"]) if cands else None
        s, o = best["stock"], best["oases"]
        rows.append(
            {
                "budget_gb": budget,
                "stock": s and s["name"],
                "oases": o and o["name"],
                "speedup": o["tokens_per_sec"] / s["tokens_per_sec"] if s and o else None,
            }
        )
    return rows


def _gb(b):
    return "n/a" if b is None else f"{b / GB:.4g}"


def _tables(report):
    """(header, rows) of the per-variant memory table and of the per-budget table."""
    results = report["variants"]
    by_name = {r["name"]: r for r in results}
    mem_head = ["variant", "recompute", "states GB", "activations GB", "peak GB/rank", "iter. ms"]
    mem_rows = []
    for r in results:
        m = r.get("memory") or {}
        v = VARIANTS.get(r["name"])
        row = [r["name"], v.recompute if v else "?"]
        if r["status"] != "ok" or "error" in m or not m:
            why = m.get("error") or (r["status"] if r["status"] != "ok" else "not measured")
            mem_rows.append(row + [why, "", "", ""])
            continue
        row += [_gb(m["state_bytes"]), _gb(m["activation_bytes"]), _gb(m["peak_bytes_per_rank"])]
        mem_rows.append(row + [f"{1e3 * r['mean_iteration_s']:.1f}"])
    bud_head = [
        "budget GB/rank",
        "fastest stock that fits",
        "peak GB",
        "iter. ms",
        "fastest Oases that fits",
        "peak GB",
        "iter. ms",
        "Oases speedup",
    ]
    bud_rows = []
    for b in report.get("memory_budget") or []:
        row = [f"{b['budget_gb']:g}"]
        for side in ("stock", "oases"):
            r = by_name.get(b[side])
            if r is None:
                row += ["none fits", "", ""]
            else:
                peak = _gb(r["memory"]["peak_bytes_per_rank"])
                row += [r["name"], peak, f"{1e3 * r['mean_iteration_s']:.1f}"]
        bud_rows.append(row + ["n/a" if b["speedup"] is None else f"{b['speedup']:.2f}x"])
    return (mem_head, mem_rows), (bud_head, bud_rows)


def format_tables(report):
    """The two tables as console text."""
    out = []
    for head, rows in _tables(report):
        rows = [head] + rows
        widths = [max(len(str(row[i])) for row in rows) for i in range(len(head))]
        for k, row in enumerate(rows):
            out.append("  ".join(str(c).ljust(w) for c, w in zip(row, widths)).rstrip())
            if k == 0:
                out.append("  ".join("-" * w for w in widths))
        out.append("")
    return "\n".join(out).rstrip()


def markdown_lines(report):
    """The memory section of results.md."""
    emu = report.get("emulation")
    lines = [
        "## At equal memory",
        "",
        "Peak memory per rank = model states (weights, gradient buffer, optimizer state: exact "
        "from the rank's parameter count) + the peak of activations, temporaries and in-flight "
        "gradients metered over one forward+backward on this host's CPU (a separate untimed pass, "
        "no link emulation); the worst rank. GB = 1e9 bytes. Iteration times are the timed runs'"
        + (f" (emulated `{emu['profile']}`: host times)" if emu else "")
        + ".",
        "",
    ]
    for head, rows in _tables(report):
        lines += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows] + [""]
    if report.get("memory_chart"):
        lines += [f"![memory]({os.path.basename(report['memory_chart'])})", ""]
    return lines + _live_lines(report)


def _leanest(results, stock):
    side = [r for r in results if is_measured(r) and is_stock(r) == stock]
    return min(side, key=_peak) if side else None


def _live_lines(report):
    """What is live at the activation peak of the leanest stock and the leanest Oases setting:
    why the one fits a budget the other does not."""
    picks = [_leanest(report["variants"], stock) for stock in (True, False)]
    picks = [r for r in picks if r is not None and r["memory"].get("live_at_peak")]
    if not picks:
        return []
    lines = [
        "### What is live at the activation peak",
        "",
        "The leanest stock and the leanest Oases setting, worst rank: the largest groups of live "
        "storages (same creating functions, shape and dtype) when the metered peak was reached.",
        "",
    ]
    for r in picks:
        m = r["memory"]
        listed = sum(g["bytes"] for g in m["live_at_peak"])
        lines += [
            f"`{r['name']}`: activations {_gb(m['activation_bytes'])} GB, peak set in "
            f"`{m.get('peak_site') or '?'}`; the groups below hold {_gb(listed)} GB.",
            "",
            "| created in | shape | dtype | tensors | MB |",
            "|---|---|---|---|---|",
        ]
        for g in m["live_at_peak"]:
            shape = "x".join(str(d) for d in g["shape"]) or "scalar"
            lines.append(
                f"| `{g['site']}` | {shape} | {g['dtype'].replace('torch.', '')} | {g['count']} "
                f"| {g['bytes'] / 1e6:.1f} |"
            )
        lines.append("")
    return lines


def plot_memory(report, path, title=""):
    """Time per iteration against peak memory per rank, one point per variant, each side's best
    time under a memory limit as a step line, and the budgets as vertical lines."""
    from ..viz.plotting import pyplot

    plt = pyplot()
    ok = [r for r in report["variants"] if is_measured(r)]
    fig, ax = plt.subplots(figsize=(8, 4.8))
    budgets = report.get("memory_budget") or []
    right = 1.05 * max([_peak(r) / GB for r in ok] + [b["budget_gb"] for b in budgets])
    for stock, color, marker, label in (
        (True, STOCK_COLOR, "s", "stock Megatron"),
        (False, OASES_COLOR, "o", "Oases schedules"),
    ):
        side = sorted((r for r in ok if is_stock(r) == stock), key=_peak)
        if not side:
            continue
        xs = [_peak(r) / GB for r in side]
        ys = [1e3 * r["mean_iteration_s"] for r in side]
        ax.scatter(xs, ys, color=color, marker=marker, label=label, zorder=3)
        for x, y, r in zip(xs, ys, side):
            ax.annotate(r["name"], (x, y), textcoords="offset points", xytext=(4, 4), fontsize=7)
        frontier, best = [], float("inf")
        for x, y in zip(xs, ys):
            best = min(best, y)
            frontier.append(best)
        ax.step(xs + [right], frontier + frontier[-1:], where="post", color=color, lw=1)
    for b in budgets:
        ax.axvline(b["budget_gb"], color="grey", ls="--", lw=0.8)
        text = f"{b['budget_gb']:g} GB" + (
            f": {b['speedup']:.2f}x" if b["speedup"] is not None else ""
        )
        ax.text(b["budget_gb"], 1, text, transform=ax.get_xaxis_transform(), rotation=90,
                ha="right", va="top", fontsize=7)  # fmt: skip
    ax.set_xlabel("peak memory per rank (GB): model states + metered activations")
    ax.set_ylabel("time per iteration (ms, host)")
    ax.set_title("fastest setting under a memory budget (lower is better)", fontsize=9)
    ax.set_xlim(0, right)
    ax.legend(fontsize=8, loc="best")
    if title:
        fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=130)
    plt.close(fig)
    return path
