"""``graphs``: ``--oases-cuda-graphs``: parity of ``oases`` and ``overlap`` (no recompute) with
graphs against stock (fp32, ``--bf16``), calls and kernels per layer, GPU idle share, memory and
the one-rank emulated timing with and without graphs (on the CPU its ``eager`` bookkeeping)."""

import os
import statistics
import subprocess

from . import parity
from .common import (
    FULL_RECOMPUTE,
    dilation_note,
    emulated_argv,
    fake_group,
    fmt,
    graphs_flag,
    layers_argv,
    one_rank_job,
    shapes,
    timed_row,
    use_host_rates,
)

LIMIT_S = 300
OPTIONS = ("gemm_rate", "save", "trace_dir")


def run(dry, save=None, gemm_rate=None, trace_dir=None):
    """``--oases-cuda-graphs`` on this device (on the CPU its ``eager`` bookkeeping): parity of the
    graphed schedules against stock (2 ranks, fp32 and bf16, dropout 0), then one-rank calls per
    layer, GPU idle share and iteration time with and without, and the emulated-link timing."""
    import torch

    from megatron_oases.errors import last_line

    use_host_rates(gemm_rate)  # the emulator's "host" rate, as the timing step's
    save = save or (lambda result: None)
    graphs = graphs_flag()
    s = shapes(dry)
    out = {"flag": graphs, "parity": {}, "host": {}, "timing": {}}
    base = next(b for name, b, _, _ in parity.parity_configs(dry) if name == "gpt-fp32")
    variants = [
        ("off", f"--oases-schedule off {FULL_RECOMPUTE}"),
        ("oases+graphs", f"--oases-schedule oases {graphs} {FULL_RECOMPUTE}"),
        ("off-keep", "--oases-schedule off"),
        ("overlap-keep+graphs", f"--oases-schedule overlap {graphs}"),
    ]
    pairs = [("oases+graphs", "off"), ("overlap-keep+graphs", "off-keep")]
    configs = [("gpt-fp32", "", variants, 1e-4), ("gpt-bf16", " --bf16", variants[:2], 3e-2)]
    for name, flags, vs, tol in configs[:1] if dry else configs:  # the dry run: CI's time
        out["parity"][name] = parity.parity_run(base + flags, vs, pairs, tol, timeout=240)
        save(out)
    # host floor: calls per layer (8 − 4 layers) and the GPU's idle share, one rank
    fake_group(2)
    host_variants = [
        ("megatron", []),
        ("oases", []),
        ("oases", graphs.split()),
        ("megatron-norecompute", []),
        ("overlap-norecompute", []),
        ("overlap-norecompute", graphs.split()),
    ]
    if dry:  # stock and oases with and without graphs: CI's time
        host_variants = host_variants[:3]
    for name, extra in host_variants:
        label = name + ("+graphs" if extra else "")
        per = {}
        try:
            for layers in (4, 8):
                argv = layers_argv(s, "host", layers, name, extra)
                per[layers] = one_rank_job(argv, 5, profile_at=4)
        except Exception as exc:  # noqa: BLE001
            out["host"][label] = {"error": last_line(exc)[:400]}
            continue
        row = {
            "aten_calls_per_layer": (per[8]["aten_calls"] - per[4]["aten_calls"]) / 4,
            "iteration_s_8_layers": statistics.median(per[8]["iteration_s"][1:3]),
            "iteration_s_4_layers": statistics.median(per[4]["iteration_s"][1:3]),
        }
        if "gpu_busy_s" in per[8]:
            row.update(
                gpu_idle_share=max(0.0, 1 - per[8]["gpu_busy_s"] / per[8]["wall_s"]),
                gpu_us_per_layer=1e6 * (per[8]["gpu_busy_s"] - per[4]["gpu_busy_s"]) / 4,
                kernels_per_layer=(per[8]["kernels"] - per[4]["kernels"]) / 4,
            )
        if torch.cuda.is_available():
            row["max_allocated_gb_8_layers"] = torch.cuda.max_memory_allocated() / 1e9
            torch.cuda.reset_peak_memory_stats()
        out["host"][label] = row
        save(out)
    # the emulated links (rank 0 alone, collectives as spin kernels): does it pay now?
    grid = [("rtx3090-pcie", "timing", 2), ("h100-nvlink", "busy", 8)]
    if dry:
        grid = [("rtx3090-pcie", "timing", 2)]
    for profile, shape, mb in grid:
        jobs = {
            name
            + ("+graphs" if extra else ""): emulated_argv(s, shape, 2, mb, profile, name, extra)
            for name, extra in host_variants[:3] + host_variants[4:6]
        }
        row = timed_row(jobs, 2 if dry else 5)
        out["timing"][f"{profile}-tp2-{shape}-mb{mb}"] = row
        save(out)
    if trace_dir:  # the first row's kernel timeline, stock against oases with graphs
        profile, shape, mb = grid[0]
        for name, extra in (host_variants[0], host_variants[2]):
            label = name + ("+graphs" if extra else "")
            argv = emulated_argv(s, shape, 2, mb, profile, name, extra)
            path = os.path.join(trace_dir, f"trace-{profile}-{label.replace('+', '-')}.json")
            try:
                one_rank_job(argv, 3, profile_at=3, trace_path=path)
                subprocess.run(["gzip", "-f", path], check=False)
                out.setdefault("traces", []).append(os.path.basename(path) + ".gz")
            except Exception as exc:  # noqa: BLE001
                out.setdefault("traces", []).append(f"{label} failed: {last_line(exc)[:200]}")
        save(out)
    return out


def report(g, env=None):
    lines = [
        "",
        f"## CUDA graphs (`{g['flag']}`)",
        "",
        "Parity against stock (2 ranks on gloo):",
        "",
    ]
    lines += parity.table(g["parity"])
    lines += [
        "",
        "One rank, TMP 2, the report's shape (H=2048, seq 1024, micro-batch 2), bf16:",
        "",
    ]
    lines += ["| variant | calls/layer | kernels/layer | GPU µs/layer | GPU idle | iteration s "
              "(8 layers) | max allocated GB |", "|---|---|---|---|---|---|---|"]  # fmt: skip
    for n, r in g["host"].items():
        if "error" in r:
            lines.append(f"| {n} | failed: {r['error']} | | | | | |")
            continue
        lines.append(
            f"| {n} | {fmt(r['aten_calls_per_layer'], '{:.0f}')} | "
            f"{fmt(r.get('kernels_per_layer'), '{:.0f}')} | "
            f"{fmt(r.get('gpu_us_per_layer'), '{:.0f}')} | "
            f"{fmt(r.get('gpu_idle_share'), '{:.2f}')} | "
            f"{fmt(r['iteration_s_8_layers'], '{:.4f}')} | "
            f"{fmt(r.get('max_allocated_gb_8_layers'), '{:.2f}')} |"
        )
    lines += ["", "One-rank emulated timing (median iteration s; speed-up over stock):", ""]
    for n, r in g["timing"].items():
        sp = r.get("speedup", {})
        cells = ", ".join(
            f"{k} {fmt(v, '{:.4f}')}" + (f" ({sp[k]:.2f}x)" if k in sp else "")
            for k, v in r.items()
            if k != "speedup"
        )
        lines.append(f"- {n}{dilation_note(n, env)}: {cells}")
    if g.get("traces"):
        lines += ["", "Kernel timelines of the first row (Chrome traces, next to this report): "
                  + ", ".join(f"`{t}`" for t in g["traces"])]  # fmt: skip
    return lines
