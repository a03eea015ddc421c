"""The faithful step's report section: each row's variants beside the prediction, the skipped
rows and the first row's kernel-trace figures."""

from .common import fmt, times
from .faithful_model import FAITHFUL_VARIANTS


def report(f, env=None):
    labels = [label for label, _, _ in FAITHFUL_VARIANTS]
    lines = [
        "",
        "## Faithful one-rank rows (device-bound; issue 42)",
        "",
        f"Model: `{f['model']}`; {f['iterations']}. Host rates given to the emulator (this "
        f"device's): GEMM {fmt(f['host_rates'].get('gemm_tflops'), '{:.3g}')} TFLOP/s, memory "
        f"{fmt(f['host_rates'].get('memory_gbs'), '{:.3g}')} GB/s. A row counts only where "
        f"every job kept the GPU at least {f['busy_min']:.0%} busy (the profiled iteration's "
        "kernel time ÷ its wall time; the profiler slows the host, so a lower bound).",
        "",
        "Speed-ups: **fair** = against stock with the same recompute setting (oases and "
        "oases+graphs against stock full recompute, overlap-norecompute against stock without "
        "recompute); **best** = against the faster stock variant. Predicted: ideal overlap / no "
        "overlap, from the roofline model below.",
        "",
    ]
    for key, row in f["rows"].items():
        lines += _row(key, row, labels, f["busy_min"])
    for line in f.get("skipped", []):
        lines.append(f"- skipped: {line}")
    if f.get("traces"):
        lines += _traces(f["traces"])
    lines += ["", f"Prediction model: {f['prediction_model']}"]
    ck = f.get("collective_kernel") or {}
    lines += ["", f"Collectives stood in for by: {ck.get('kernel') or 'host-clock waits (CPU)'}"]
    return lines


def _row(key, row, labels, busy_min):
    pred = row.get("prediction") or {}
    head = f"### {key}"
    if row.get("dilation_forced"):
        head += f" (D forced to {row['dilation_forced']:g}: the GPU is the target)"
    lines = [head, ""]
    if row.get("doubled_from"):
        df = row["doubled_from"]
        lines.append(
            f"Micro-batch doubled from {df['micro_batch']}: its busy share was "
            f"{fmt(df['min_busy_share'], '{:.2f}')} < {busy_min}."
        )
    if row.get("not_doubled"):
        lines.append(f"Not doubled: {row['not_doubled']}.")
    counts = row.get("counts")
    lines.append(
        f"Lowest busy share {fmt(row.get('min_busy_share'), '{:.2f}')}: "
        + ("**counts** (device-bound)." if counts else "**does not count** (host-bound or "
           "not measured: no CUDA).")  # fmt: skip
    )
    if "roofline_d" in pred:
        used = " (not used: the row forces D)" if row.get("dilation_forced") else ""
        lines.append(f"Roofline D on this device{used}: {pred['roofline_d_parts']}.")
    if "error" in pred:
        lines.append(f"Prediction: {pred['error']}.")
    lines += [
        "",
        "| variant | median s | CV | busy | D (emulator) | vs fair | vs best stock | "
        "predicted vs fair | predicted vs best |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for label in labels:
        v = row["variants"].get(label, {})
        sp = row["speedup"].get(label, {})
        ps = (pred.get("speedup") or {}).get(label, {})
        if "fair_ideal" in ps:
            pf = f"{times(ps['fair_ideal'])} / {times(ps['fair_serial'])}"
            pb = f"{times(ps['best_stock_ideal'])} / {times(ps['best_stock_serial'])}"
        else:
            pf, pb = times(ps.get("fair")), times(ps.get("best_stock"))
        med = fmt(v.get("median_s"), "{:.4f}") if "median_s" in v else f"failed: {v.get('error')}"
        lines.append(
            f"| {label} | {med} | {fmt(v.get('cv'), '{:.1%}')} | "
            f"{fmt(v.get('busy_share'), '{:.2f}')} | {fmt(v.get('dilation'), '{:.4g}')} | "
            f"{times(sp.get('fair'))} | {times(sp.get('best_stock'))} | {pf} | {pb} |"
        )
    lines.append("")
    return lines


def _traces(tr):
    lines = [
        "",
        "### Kernel traces of the first row (analysed on the device)",
        "",
        "| variant | busy share | compute ms | spin ms | spin beside compute | two streams at "
        "once ms | idle gaps > 100 µs (n, ms) | largest gap ms | stream waits (on spins, "
        "spin inputs, other) | waits that stalled on a spin (n, ms) |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for label, r in tr.items():
        for kind in ("analysis", "synthetic_analysis"):
            a = r.get(kind)
            if not a:
                continue
            if "spin_us" not in a:
                lines.append(f"| {label} ({kind}) | {a.get('note', 'no kernels')} |||||||||")
                continue
            w = a["stream_wait_summary"]
            k = w["by_kind"]
            name = label + (" (synthetic trace: the CPU's has no kernels)"
                            if kind == "synthetic_analysis" else "")  # fmt: skip
            lines.append(
                f"| {name} | {fmt(a['busy_share'], '{:.2f}')} | "
                f"{a['compute_us'] / 1e3:.2f} | {a['spin_us'] / 1e3:.2f} | "
                f"{a['spin_overlapped_us'] / 1e3:.2f} ms "
                f"({fmt(a['spin_overlapped_share'], '{:.0%}')}) | "
                f"{a['concurrent_streams_us'] / 1e3:.2f} | {a['idle_gaps_over_100us']}, "
                f"{a['idle_gaps_over_100us_total_us'] / 1e3:.2f} | "
                f"{a['largest_gap_us'] / 1e3:.2f} | {k.get('spin', 0)}, {k.get('input', 0)}, "
                f"{k.get('other', 0)} | {w['on_spins_that_stalled']}, "
                f"{w['stalled_us'] / 1e3:.2f} |"
            )
        if r.get("error"):
            lines.append(f"| {label} | failed: {r['error']} |||||||||")
    files = [r["file"] for r in tr.values() if r.get("file")]
    if files:
        lines += ["", "Traces next to this report: " + ", ".join(f"`{x}`" for x in files)]
    return lines
