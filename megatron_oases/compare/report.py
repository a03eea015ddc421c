"""``oases compare`` outputs: results table (paper Table 3 style), results.json/.md, charts."""

import json
import os


def _pct(x):
    return "n/a" if x is None else f"{100 * x:.1f} %"


def _num(x, fmt="{:.2f}"):
    return "n/a" if x is None else fmt.format(x)


def add_derived(results, reference="megatron"):
    """Speedup over the reference variant (stock Megatron) and loss agreement, in place."""
    ok = [r for r in results if r["status"] == "ok"]
    ref = next((r for r in ok if r["name"] == reference), ok[0] if ok else None)
    for r in results:
        r["speedup"] = None
        if r["status"] == "ok" and ref is not None:
            r["speedup"] = r["tokens_per_sec"] / ref["tokens_per_sec"]
    return ref


def check_losses(results, ref, rtol):
    """Max relative loss difference of every variant against ``ref``; returns the failures."""
    bad = []
    if ref is None:
        return bad
    for r in results:
        if r["status"] != "ok":
            continue
        a, b = r["losses"], ref["losses"]
        if len(a) != len(b):
            r["loss_max_rel_diff"] = None
            bad.append(f"{r['name']}: {len(a)} losses vs {len(b)} for {ref['name']}")
            continue
        diff = max((abs(x - y) / max(abs(y), 1e-12) for x, y in zip(a, b)), default=0.0)
        r["loss_max_rel_diff"] = diff
        r["loss_agrees"] = diff <= rtol
        if diff > rtol:
            bad.append(
                f"{r['name']}: lm loss differs from {ref['name']} by {diff:.2e} "
                f"(relative, tolerance {rtol:g}): {a} vs {b}"
            )
    return bad


def table_rows(results):
    rows = []
    for r in results:
        t = r.get("trace") or {}
        if r["status"] != "ok":
            status = r["status"] + (f" ({r.get('reason')})" if r.get("reason") else "")
            rows.append([r["name"], r["paper"], status] + [""] * (len(HEADER) - 3))
            continue
        rows.append(
            [
                r["name"],
                r["paper"],
                f"{r['tokens_per_sec']:.1f}",
                _num(r.get("speedup"), "{:.2f}x"),
                _num(r.get("speedup_less_contention"), "{:.2f}x"),
                f"{1e3 * r['mean_iteration_s']:.1f} ± {1e3 * r['stdev_iteration_s']:.1f}",
                _pct(t.get("exposed_share")),
                _pct(t.get("schedule_exposed_share")),
                _num(t.get("efficiency")),
                _num(t.get("compute_us") and t["compute_us"] / 1e3, "{:.1f}"),
                _num(t.get("compute_cpu_us") and t["compute_cpu_us"] / 1e3, "{:.1f}"),
                _num(t.get("runq_us") and t["runq_us"] / 1e3, "{:.1f}"),
                _num(t.get("comm_us") and t["comm_us"] / 1e3, "{:.1f}"),
                _num(r.get("loss_max_rel_diff"), "{:.1e}"),
                _num(r.get("host_cpu_share")),
                _num((r.get("host") or {}).get("aten_calls_per_layer"), "{:.0f}"),
                _num(_ms((r.get("host") or {}).get("host_floor_s")), "{:.1f}"),
                _bound((r.get("host") or {}).get("host_bound")),
            ]
        )
    return rows


def _ms(seconds):
    return None if seconds is None else 1e3 * seconds


def _bound(flag):
    return "n/a" if flag is None else ("**yes**" if flag else "no")


HEADER = [
    "variant",
    "paper (Table 3)",
    "tokens/s",
    "speedup",
    "speedup less contention",
    "iteration ms (mean ± sd)",
    "exposed comm",
    "schedule exposed",
    "efficiency",
    "compute ms",
    "compute CPU ms",
    "run-queue ms",
    "comm ms",
    "loss rel. diff",
    "host CPU share",
    "aten calls/layer",
    "host floor ms",
    "host-bound",
]


def format_table(results):
    rows = [HEADER] + table_rows(results)
    widths = [max(len(str(row[i])) for row in rows) for i in range(len(HEADER))]
    lines = []
    for k, row in enumerate(rows):
        lines.append("  ".join(str(c).ljust(w) for c, w in zip(row, widths)).rstrip())
        if k == 0:
            lines.append("  ".join("-" * w for w in widths))
    return "\n".join(lines)


def markdown_table(results):
    out = ["| " + " | ".join(HEADER) + " |", "|" + "---|" * len(HEADER)]
    for row in table_rows(results):
        out.append("| " + " | ".join(str(c) for c in row) + " |")
    return "\n".join(out)


def interrupted_line(cut):
    """What results.json's ``interrupted`` says, in one line (results.md and stderr)."""
    missing = cut.get("not_finished") or []
    return (
        f"the comparison was interrupted by {cut.get('by')} during {cut.get('during')}"
        + (f"; not finished: {', '.join(missing)}" if missing else "")
        + "; run its command again for a complete one"
    )


def write_json(report, path):
    with open(path, "w") as f:
        json.dump(report, f, indent=1, default=str)


def write_markdown(report, path):
    cfg = report["config"]
    emu = report.get("emulation")
    lines = [
        f"# oases compare: {cfg['model']}",
        "",
        f"- date: {report['date']}",
        f"- host: {report['host']['cpu']} ({report['host']['logical_cpus']} logical CPUs), "
        f"torch {report['host']['torch']}, "
        + (
            f"rank 0 of {cfg['nproc']} run alone (one-rank) x {cfg['threads_per_rank']} thread(s)"
            if cfg.get("one_rank")
            else f"{cfg['nproc']} ranks x {cfg['threads_per_rank']} thread(s)"
        ),
        f"- command: `{report['command']}`"
        + (f" ({report['rebudgeted']})" if report.get("rebudgeted") else "")
        + (f" ({report['host_recounted']})" if report.get("host_recounted") else ""),
        f"- iterations: {cfg['warmup']} warm-up + {cfg['iters']} timed per variant"
        + (f", best of {cfg['repeats']} runs (rotated order)" if cfg.get("repeats", 1) > 1 else "")
        + "; tokens/s = global batch x seq / mean timed iteration time",
    ]
    if emu:
        lines.append(
            f"- **emulated** interconnect `{emu['profile']}` ({emu['gpu']}): host "
            f"{emu['host_gflops']:.1f} GFLOP/s per rank"
            + (
                f" ({emu['oversubscription_share']:.2f} of {emu['host_gflops_alone']:.1f} GFLOP/s "
                "alone: more ranks than CPUs time-share them)"
                if emu.get("oversubscription_share", 1.0) < 1.0
                else ""
            )
            + (
                f", {emu['host_memory_gbs']:.2f} GB/s"
                if emu.get("host_memory_gbs") is not None
                else ""
            )
            + f", target {emu['target_tflops']:g} TFLOP/s "
            + (
                f"and {emu['target_memory_gbs']:g} GB/s "
                if emu.get("target_memory_gbs") is not None
                else ""
            )
            + f"{emu['dtype']} => dilation D = {emu['dilation']:.1f}"
            + (
                f" (roofline, one layer: target GEMM {emu['target_gemm_ms']:.3g} ms + memory "
                f"{emu['target_memory_ms']:.3g} ms; host GEMM {emu['host_gemm_ms']:.4g} ms + "
                f"memory {emu['host_memory_ms']:.4g} ms)"
                if emu.get("target_gemm_ms") is not None
                else ""
            )
            + "; every collective runs on gloo and "
            "completes no earlier than D x its ring alpha-beta time on the target link. Times are "
            "host times (divide by D for target-GPU time)."
        )
    else:
        lines.append(
            "- no link emulation: plain gloo on this host (not representative of a GPU " "cluster)"
        )
    if cfg.get("one_rank"):
        lines.append(
            f"- **one-rank, timing-only**: only rank 0 of the {cfg['nproc']} ranks ran; the others "
            "are virtual (Megatron's --fake-process-group), so collectives take their emulated "
            "time but reduce nothing: losses and gradients are not those of training and are not "
            "checked. Rank 0's timeline stands for the group's (its ranks do the same work)."
        )
    if report.get("interrupted"):
        lines.append(f"- **interrupted**: {interrupted_line(report['interrupted'])}")
    best = report.get("best_against_best")
    if best:
        lines.append(f"- best against best: {best['line']}")
    contended = report.get("contention") or {}
    if contended.get("contended"):
        lines.append(f"- **{contended['line']}**")
    lines += [
        f"- losses: {report['loss_check']['summary']}",
        "",
        markdown_table(report["variants"]),
        "",
        "exposed comm = time blocked on communication ÷ iteration time; efficiency = "
        "max(compute, communication) ÷ iteration time (overlap bound ÷ measured), both from the "
        "last iteration's trace, mean over ranks. schedule exposed = per collective the least "
        "time any rank was blocked on it (the rest is a rank waiting for a later peer: the "
        "ranks' compute drifting apart on a shared host), summed, ÷ iteration time. compute ms = iteration time not blocked on "
        "communication; compute CPU ms = the compute thread's CPU time in it (no contention); "
        "run-queue ms = time the compute thread waited for a CPU (host contention, counted in "
        "compute ms and in the iteration time); speedup less contention = the same ratio of the "
        "traced iterations replayed without their waits for a CPU (the compute thread's "
        "run-queue wait where it cost time, collectives completing at their modelled time: "
        "see docs/compare.md). aten calls/layer = aten calls per layer per "
        "micro-batch, counted (not timed) in an untimed pass; host floor ms = those calls per "
        "iteration x the target profile's host_us_per_call, in this table's dilated units (x D); "
        "host-bound = that floor exceeds the emulated iteration, i.e. on the target GPU the host, "
        "not the GPU, would set the pace and the emulated time is not reachable.",
        "",
    ]
    if report.get("memory_budget") is not None:
        from .memory import markdown_lines

        lines += markdown_lines(report)
    for r in report["variants"]:
        if r.get("timeline"):
            lines.append(f"![{r['name']} timeline]({os.path.basename(r['timeline'])})")
        if r["status"] == "failed":
            lines += [f"**{r['name']} failed**: {r.get('error')}", "", "```"]
            lines += r.get("log_tail", []) + ["```", ""]
    if report.get("chart"):
        lines += ["", f"![throughput]({os.path.basename(report['chart'])})"]
    lines += [
        "",
        "Timings on a shared 2-core host are noisy (other processes compete for the "
        "cores); repeat runs differ by several per cent.",
        "",
    ]
    with open(path, "w") as f:
        f.write("\n".join(lines))


def plot_summary(results, path, title=""):
    """Bar chart: tokens/s with speedups (left), iteration breakdown compute vs exposed (right)."""
    from ..viz.plotting import pyplot

    plt = pyplot()
    ok = [r for r in results if r["status"] == "ok"]
    names = [r["name"] for r in ok]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.2))
    colors = ["#7b5ea7" if n.startswith("megatron") else "#1f77b4" for n in names]
    bars = ax1.bar(names, [r["tokens_per_sec"] for r in ok], color=colors)
    for b, r in zip(bars, ok):
        if r.get("speedup") is not None:
            ax1.text(
                b.get_x() + b.get_width() / 2,
                b.get_height(),
                f"{r['speedup']:.2f}x",
                ha="center",
                va="bottom",
                fontsize=9,
            )
    ax1.set_ylabel("tokens/s (host time)")
    ax1.set_title("throughput, speedup over stock")
    ax1.tick_params(axis="x", labelrotation=20, labelsize=8)
    busy, exposed = [], []
    for r in ok:
        t = r.get("trace")
        T = r["mean_iteration_s"] * 1e3
        share = t["exposed_share"] if t else 0.0
        exposed.append(T * share)
        busy.append(T * (1 - share))
    ax2.bar(names, busy, color="#4c9f70", label="computing")
    ax2.bar(names, exposed, bottom=busy, color="#d62728", label="exposed communication")
    floors = [((r.get("host") or {}).get("host_floor_s"), i) for i, r in enumerate(ok)]
    floors = [(1e3 * f, i) for f, i in floors if f is not None]
    if floors:  # the host's issue time at the target's per-call cost, in the same units
        ax2.scatter(
            [i for _, i in floors],
            [f for f, _ in floors],
            marker="_",
            s=900,
            linewidths=2.5,
            color="black",
            zorder=3,
            label="host floor (issue time)",
        )
    ax2.set_ylabel("iteration time (ms, host)")
    ax2.set_title("iteration breakdown (Figure 2 style)")
    ax2.tick_params(axis="x", labelrotation=20, labelsize=8)
    ax2.legend(fontsize=8)
    if title:
        fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=130)
    plt.close(fig)
    return path
