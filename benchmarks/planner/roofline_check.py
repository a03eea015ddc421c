"""Analytic profiles' compute (the roofline of :mod:`megatron_oases.device_model`) against what was
measured: the committed CPU measured profile (``benchmarks/results/validation/profile.json``,
per block and pass) and the H100 per-layer GPU time of the committed kernel trace
(``benchmarks/results/gpu/2026-11-26-NVIDIA-H100-80GB-HBM3``, as read in ``docs/compare.md``).
Beside each roofline figure the FLOP-only figure the analytic profiles charged before.

    flock /tmp/oases-bench.lock python benchmarks/planner/roofline_check.py [--out DIR]
"""

import json
import math
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

import report_cli  # noqa: E402 (beside this script)

from benchmarks import provenance  # noqa: E402

CPU_PROFILE = os.path.join(ROOT, "benchmarks", "results", "validation", "profile.json")
#: The H100 check's layer (docs/compare.md, "The device model"): H=2048, 32 heads, seq 1024,
#: TP 2, micro-batch 2, bf16, flash attention, no dropout; per layer, forward + recompute +
#: backward (4 x forward), from the committed trace: GEMM-like kernels 0.67 ms, non-GEMM ~0.56 ms
#: of which ~0.2 ms is the fp32 weight-gradient accumulation and embedding/loss work (not a layer
#: term of the profiles) -> ~0.36 ms of the layer's memory-bound work.
H100_SHAPE = dict(
    hidden_size=2048,
    num_attention_heads=32,
    num_query_groups=32,
    kv_channels=64,
    ffn_hidden_size=8192,
    seq_length=1024,
    swiglu=False,
    normalization="LayerNorm",
    disable_bias_linear=False,
    hidden_dropout=0.0,
    attention_dropout=0.0,
    core_attention="fused",
)
H100_MEASURED = {"gemm_ms": 0.67, "memory_ms": 0.36}
#: The H100 as the check measured it (bf16 GEMM 776 TF/s) and 3,350 GB/s (datasheet HBM3).
H100_RATES = (776e12, 3350e9)


def _cpu_rows():
    from megatron_oases.device_model import DeviceRates, block_work, roofline_time
    from megatron_oases.formats.profile import load_profile
    from megatron_oases.profiler import layer_math
    from megatron_oases.testbed.calibrate import host_flops, host_memory_bandwidth

    prof = load_profile(CPU_PROFILE)
    threads = int(prof.data["hardware"].get("threads_per_rank") or 1)
    host = DeviceRates(host_flops(threads)[0], host_memory_bandwidth(threads)[0], "this host")
    shape = dict(prof.shape, core_attention="unfused")  # Megatron's default on a CPU
    p = prof.dtype_bytes
    rows = []
    for block in layer_math.BLOCKS:
        for d, passes in sorted(prof.data["compute"][block].items(), key=lambda kv: int(kv[0])):
            for phase, factor in (("forward_s", 1), ("backward_s", 2)):
                for n, measured in passes[phase]:
                    work = block_work(shape, block, int(d), p, samples=n).scaled(factor)
                    t = roofline_time(work, host)
                    rows.append(
                        dict(
                            block=block,
                            degree=int(d),
                            samples=n,
                            phase=phase[:-2],
                            measured_ms=1e3 * measured,
                            roofline_ms=1e3 * t.total_s,
                            gemm_only_ms=1e3 * t.gemm_s,
                        )
                    )
    return rows, host


def _h100_row():
    from megatron_oases.device_model import DeviceRates, layer_work, roofline_time
    from megatron_oases.testbed.clusters import load_cluster

    work = layer_work(H100_SHAPE, 2, 2, samples=2).scaled(4)
    out = {}
    for label, rates in (
        ("measured rates (776 TF/s, 3,350 GB/s)", DeviceRates(*H100_RATES)),
        ("h100-nvlink profile", DeviceRates.from_profile(load_cluster("h100-nvlink"))),
    ):
        t = roofline_time(work, rates)
        out[label] = dict(gemm_ms=1e3 * t.gemm_s, memory_ms=1e3 * t.memory_s)
    return out


def main(argv=None):
    args = report_cli.start(__doc__, argv)
    prov = provenance.record(("device_model",), provenance.command_line(__file__, argv))
    rows, host = _cpu_rows()
    h100 = _h100_row()

    def err(key, fitted=False):
        """Geometric mean |error|; ``fitted``: after one host-speed factor per model (the
        calibration runs at another time and load than the profile did)."""
        logs = [math.log(r[key] / r["measured_ms"]) for r in rows]
        shift = sum(logs) / len(logs) if fitted else 0.0
        return math.exp(sum(abs(x - shift) for x in logs) / len(logs)) - 1, math.exp(-shift)

    summary = {
        "host_gemm_gflops": host.gemm_flops_per_s / 1e9,
        "host_memory_gbs": host.memory_bytes_per_s / 1e9,
        "cpu_mean_abs_error_roofline": err("roofline_ms")[0],
        "cpu_mean_abs_error_gemm_only": err("gemm_only_ms")[0],
        "cpu_fitted_error_roofline": err("roofline_ms", True)[0],
        "cpu_fitted_factor_roofline": err("roofline_ms", True)[1],
        "cpu_fitted_error_gemm_only": err("gemm_only_ms", True)[0],
        "cpu_fitted_factor_gemm_only": err("gemm_only_ms", True)[1],
    }
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "roofline_check.json"), "w") as f:
        doc = {"cpu": rows, "h100": h100, "h100_measured": H100_MEASURED, **summary}
        json.dump(provenance.with_provenance(doc, prov), f, indent=1)
    lines = [
        "# Roofline compute of analytic profiles against measurements",
        "",
        "`flock /tmp/oases-bench.lock python benchmarks/planner/roofline_check.py` (do not edit by "
        "hand). Roofline: GEMM FLOPs ÷ GEMM rate + memory-bound bytes ÷ memory bandwidth "
        "(`megatron_oases/device_model.py`, what `oases profile --analytic` now charges); "
        "GEMM-only: the FLOP term alone (what it charged before).",
        "",
        f"## CPU: the committed measured profile (`{os.path.relpath(CPU_PROFILE, ROOT)}`)",
        "",
        f"H=512, 8 heads, seq 256, fp32, unfused attention, one thread per rank; host rates "
        f"calibrated now: {summary['host_gemm_gflops']:.1f} GFLOP/s matmul, "
        f"{summary['host_memory_gbs']:.2f} GB/s memory (the profile was measured on "
        f"{json.load(open(CPU_PROFILE)).get('created', '?')[:10]}; the host is shared and noisy).",
        "",
        "| block | degree | samples | pass | measured ms | roofline ms | ratio | GEMM-only ms | "
        "ratio |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['block']} | {r['degree']} | {r['samples']} | {r['phase']} | "
            f"{r['measured_ms']:.2f} | {r['roofline_ms']:.2f} | "
            f"{r['roofline_ms'] / r['measured_ms']:.2f} | {r['gemm_only_ms']:.2f} | "
            f"{r['gemm_only_ms'] / r['measured_ms']:.2f} |"
        )
    lines += [
        "",
        f"Geometric mean error: roofline {100 * summary['cpu_mean_abs_error_roofline']:.0f} %, "
        f"GEMM-only {100 * summary['cpu_mean_abs_error_gemm_only']:.0f} %: the profile's blocks "
        f"took {summary['cpu_fitted_factor_roofline']:.2f}x the roofline's time at the rates "
        "calibrated now (geometric mean; the calibration and the profile ran at other times and "
        "loads of this shared host). With one host-speed factor fitted per model (the shape "
        f"of the times, not their scale): roofline "
        f"{100 * summary['cpu_fitted_error_roofline']:.0f} % (factor "
        f"{summary['cpu_fitted_factor_roofline']:.2f}), GEMM-only "
        f"{100 * summary['cpu_fitted_error_gemm_only']:.0f} % (factor "
        f"{summary['cpu_fitted_factor_gemm_only']:.2f}).",
        "",
        "## H100: one layer (H=2048, seq 1024, TP 2, micro-batch 2, bf16, flash attention)",
        "",
        "Forward + recompute + backward (4 x forward) per layer. Measured: the committed kernel "
        "trace as read in docs/compare.md (GEMM-like kernels incl. flash attention 0.67 ms; "
        "memory-bound ~0.56 ms less ~0.2 ms of fp32 gradient accumulation and embedding/loss "
        "work = ~0.36 ms).",
        "",
        "| rates | GEMM ms | memory-bound ms | layer ms | GEMM-only layer ms |",
        "|---|---|---|---|---|",
        f"| measured (trace) | {H100_MEASURED['gemm_ms']:.2f} | ~{H100_MEASURED['memory_ms']:.2f} | "
        f"~{H100_MEASURED['gemm_ms'] + H100_MEASURED['memory_ms']:.2f} | - |",
    ]
    for label, t in h100.items():
        lines.append(
            f"| roofline, {label} | {t['gemm_ms']:.2f} | {t['memory_ms']:.2f} | "
            f"{t['gemm_ms'] + t['memory_ms']:.2f} | {t['gemm_ms']:.2f} |"
        )
    with open(os.path.join(args.out, "roofline_check.md"), "w") as f:
        f.write(provenance.markdown("\n".join(lines) + "\n", prov))
    provenance.print_summary(prov)
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
