"""``faithful`` (run on its own: ``--steps env,faithful``): device-bound one-rank rows
``profile:TP:micro-batch`` in priority order (:data:`FAITHFUL_ROWS`, ``--rows``), each with stock
full recompute, stock without recompute, ``oases``, ``overlap-norecompute`` and ``oases``+graphs,
two passes in alternating order, each job's GPU busy share (a row counts at >= 0.85; below, the
micro-batch is doubled once), speed-ups against the fair baseline and the best stock variant
beside the roofline prediction (:mod:`.faithful_model`), and the first row's kernel traces
analysed here (:mod:`megatron_oases.instrument.kernel_trace`). The emulator's host rates are this
device's (``OASES_HOST_FLOPS``, ``OASES_HOST_MEM_GBS`` from ``env``), so its per-shape D applies.
Rows that no longer fit the step's budget are skipped with a line."""

import contextlib
import io
import os
import re
import statistics
import subprocess
import sys
import time

from .common import (
    emulated_argv,
    fake_group,
    forced_dilation,
    graphs_flag,
    on_cuda,
    one_rank_job,
    shapes,
    use_host_rates,
)
from .faithful_model import FAIR_BASELINE, FAITHFUL_VARIANTS, PREDICTION_MODEL, STOCK, predict_row
from .faithful_report import report  # noqa: F401  (the step's report section)

LIMIT_S = 460
OPTIONS = ("gemm_rate", "save", "mem_gbs", "trace_dir", "rows", "iters", "deadline_s")

#: ``profile:TP:micro-batch[:D]`` in priority order (a cut budget keeps the first ones). The
#: communication/compute ratio of a TMP layer does not depend on the tokens per micro-batch, so a
#: micro-batch large enough to keep the H100 busy stands for the target's own. The last row is an
#: H100 group spanning two nodes (TP 16 over the profile's inter-node link): the GPU is the
#: target, so no dilation (D = 1).
FAITHFUL_ROWS = (
    "rtx4090-pcie:4:64",
    "rtx3090-pcie:2:32",
    "rtx4090-pcie:2:32",
    "l40s-pcie:2:32",
    "rtx3090-pcie:4:64",
    "h100-nvlink:2:32",
    "h100-nvlink:16:256:1",
)
#: the dry run forces D: a loaded CPU's measured rate puts D in the thousands (seconds of waiting
#: per collective); the host rates still reach the emulator and the prediction
FAITHFUL_DRY_ROWS = ("rtx4090-pcie:4:2:1",)
BUSY_MIN = 0.85  # a row counts only where every job kept the GPU at least this busy
WARMUP = 2


def parse_rows(text):
    """``profile:TP:mb[:D]`` items, comma-separated; one ``ValueError`` line for a bad one."""
    rows = []
    for item in [t.strip() for t in text.split(",") if t.strip()]:
        parts = item.split(":")
        try:
            if len(parts) not in (3, 4):
                raise ValueError
            tp, mb = int(parts[1]), int(parts[2])
            d = float(parts[3]) if len(parts) == 4 else None
            if tp < 1 or mb < 1 or (d is not None and d <= 0):
                raise ValueError
        except ValueError:
            raise ValueError(
                f"--rows item {item!r}: write profile:TP:micro-batch[:D], e.g. rtx4090-pcie:4:64"
            ) from None
        rows.append((parts[0], tp, mb, d))
    return rows


def row_key(profile, tp, mb):
    return f"{profile}-tp{tp}-mb{mb}"


def _job(argv, iters, dry):
    """One faithful job: ``WARMUP`` + ``iters`` timed iterations + one profiled (busy share); the
    D its emulator printed."""

    class Tee(io.StringIO):  # the log still gets every line as it comes (a hang shows where)
        def write(self, text):
            sys.__stdout__.write(text)
            return super().write(text)

    buf = Tee()
    total = WARMUP + iters + 1
    with contextlib.redirect_stdout(buf):
        r = one_rank_job(argv, total, profile_at=total)
    ds = re.findall(r"\bD = ([0-9.]+(?:e[+-]?[0-9]+)?)", buf.getvalue())
    busy = r["gpu_busy_s"] / r["wall_s"] if "gpu_busy_s" in r and r.get("wall_s") else None
    return {
        "timed_s": r["iteration_s"][WARMUP : WARMUP + iters],
        "busy_share": busy,
        "dilation": float(ds[-1]) if ds else None,
    }


def faithful_row(s, profile, tp, mb, d, iters, dry, graphs):
    """Every variant of one row, two passes in alternating order."""
    from megatron_oases.errors import last_line

    fake_group(tp)
    jobs = {
        label: emulated_argv(s, "timing", tp, mb, profile, name, graphs.split() if g else ())
        for label, name, g in FAITHFUL_VARIANTS
    }
    per = {label: {"timed_s": [], "busy_share": [], "dilation": None} for label in jobs}
    order = list(jobs)
    with forced_dilation(d):
        for pass_order in (order, order[::-1]):
            for label in pass_order:
                if "error" in per[label]:
                    continue
                try:
                    r = _job(jobs[label], iters, dry)
                except Exception as exc:  # noqa: BLE001 - one job's failure is a result
                    per[label]["error"] = last_line(exc)[:300]
                    continue
                per[label]["timed_s"] += r["timed_s"]
                per[label]["busy_share"].append(r["busy_share"])
                per[label]["dilation"] = r["dilation"]
    row = {"profile": profile, "tp": tp, "micro_batch": mb, "dilation_forced": d, "variants": {}}
    for label, v in per.items():
        t = v["timed_s"]
        busy = [b for b in v["busy_share"] if b is not None]
        out = {
            "iteration_s": t,
            "dilation": v["dilation"],
            "busy_share": min(busy) if busy else None,
        }
        if t:
            med = statistics.median(t)
            out.update(median_s=med, cv=statistics.pstdev(t) / statistics.fmean(t))
        if "error" in v:
            out["error"] = v["error"]
        row["variants"][label] = out
    med = {k: v.get("median_s") for k, v in row["variants"].items()}
    stock = [med[k] for k in STOCK if med.get(k)]
    best = min(stock) if stock else None
    row["speedup"] = {
        label: {
            "fair": (
                med[FAIR_BASELINE[label]] / med[label] if med.get(FAIR_BASELINE[label]) else None
            ),
            "best_stock": best / med[label] if best else None,
        }
        for label in row["variants"]
        if med.get(label)
    }
    known = [v["busy_share"] for v in row["variants"].values() if v["busy_share"] is not None]
    row["min_busy_share"] = min(known) if known else None
    row["counts"] = bool(known) and min(known) >= BUSY_MIN
    return row


def _trace_first_row(s, profile, tp, mb, d, trace_dir, dry):
    """Kernel traces of stock and ``oases`` at the first row, analysed here (on the device)."""
    from megatron_oases.errors import last_line
    from megatron_oases.instrument import kernel_trace
    from megatron_oases.testbed.link_model import CudaLink

    fake_group(tp)
    out = {}
    CudaLink.annotate = True
    try:
        for label in ("megatron", "oases"):
            argv = emulated_argv(s, "timing", tp, mb, profile, label)
            path = os.path.join(
                trace_dir, f"trace-faithful-{row_key(profile, tp, mb)}-{label}.json"
            )
            try:
                with forced_dilation(d):
                    one_rank_job(argv, 3, profile_at=3, trace_path=path)
                res = {"analysis": kernel_trace.analyse(path)}
                subprocess.run(["gzip", "-f", path], check=False)
                res["file"] = os.path.basename(path) + ".gz"
            except Exception as exc:  # noqa: BLE001
                res = {"error": last_line(exc)[:300]}
            if not on_cuda():  # a CPU trace has no kernels: the analysis runs on a recorded one
                res["synthetic_analysis"] = kernel_trace.analyse(kernel_trace.synthetic_trace())
            out[label] = res
    finally:
        CudaLink.annotate = False
    return out


def run(
    dry, save=None, gemm_rate=None, mem_gbs=None, trace_dir=None, rows=None, iters=None,
    deadline_s=None,
):  # fmt: skip
    """Device-bound one-rank rows (see :data:`FAITHFUL_ROWS`): each variant's iteration time, its
    GPU busy share, speed-ups against the fair baseline and the best stock variant beside the
    roofline prediction, and the first row's kernel traces analysed here."""
    import torch

    from megatron_oases.errors import last_line
    from megatron_oases.testbed.clusters import load_cluster

    t_end = time.time() + (deadline_s or 450)
    save = save or (lambda result: None)
    use_host_rates(gemm_rate, mem_gbs)  # the emulator's "host" is this device
    s = shapes(dry)
    rows = parse_rows(rows or ",".join(FAITHFUL_DRY_ROWS if dry else FAITHFUL_ROWS))
    iters = iters or (2 if dry else 6)
    graphs = graphs_flag()
    out = {
        "model": s["timing"]
        + " --num-layers 2"
        + (" --bf16 --num-workers 2 --manual-gc" if on_cuda() else ""),
        "iterations": f"{WARMUP} warm-up + {iters} timed per pass, 2 passes in alternating order "
        "(+1 profiled for the busy share)",
        "host_rates": {"gemm_tflops": gemm_rate, "memory_gbs": mem_gbs},
        "busy_min": BUSY_MIN,
        "prediction_model": PREDICTION_MODEL,
        "rows": {},
        "skipped": [],
    }
    with_d = bool(gemm_rate and mem_gbs)  # the roofline D of each row on this device
    row_s = None  # how long the last row took
    for i, (profile, tp, mb, d) in enumerate(rows):
        try:
            load_cluster(profile)
        except Exception as exc:  # noqa: BLE001
            out["skipped"].append(f"{profile}:{tp}:{mb}: not run: {last_line(exc)[:200]}")
            continue
        left = t_end - time.time()
        if row_s is not None and left < row_s:
            out["skipped"].append(
                f"{profile}:{tp}:{mb}: not run: {left:.0f} s of the step's budget left, a row "
                f"took {row_s:.0f} s"
            )
            continue
        t0 = time.time()
        row = faithful_row(s, profile, tp, mb, d, iters, dry, graphs)
        row_s = time.time() - t0
        if row["min_busy_share"] is not None and not row["counts"]:
            if t_end - time.time() > 2 * row_s:  # double the micro-batch once, and say so
                first = row
                row = faithful_row(s, profile, tp, 2 * mb, d, iters, dry, graphs)
                row["doubled_from"] = {"micro_batch": mb, "min_busy_share": first["min_busy_share"]}
                mb = 2 * mb
            else:
                row["not_doubled"] = "busy share below the minimum; no time left to double"
        try:
            row["prediction"] = predict_row(s, profile, tp, mb, with_d)
        except Exception as exc:  # noqa: BLE001
            row["prediction"] = {"error": last_line(exc)[:300]}
        out["rows"][row_key(profile, tp, mb)] = row
        save(out)
        if i == 0 and trace_dir:
            out["traces"] = _trace_first_row(s, profile, tp, mb, d, trace_dir, dry)
            save(out)
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    from megatron_oases.testbed.link_model import CudaLink

    out["collective_kernel"] = {
        "kernel": CudaLink.last_kernel,
        "fallback_reason": CudaLink.fallback_reason,
    }
    return out
