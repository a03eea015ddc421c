"""Does one rank stand for the group? ``oases compare --one-rank`` against the multi-rank emulator.

Runs the same ``oases compare`` call (emulated link, every default variant) alternately with all
ranks (one process per rank, gloo) and with ``--one-rank`` (rank 0 alone, the others virtual), and
writes a table of each variant's speed-up over stock under both, with the spread of the repeats.
With ``--threads-per-rank 1`` both use one thread per process; without it (``--threads-per-rank
0``) each mode takes ``oases compare``'s default, as a new user would: rank 0 of ``--one-rank`` gets
a rank's share of the CPUs (``CPUs ÷ --nproc``), the same as in the all-ranks job (issue 42: it
used to get every CPU, and a D calibrated for that many threads). The report gives each mode's D
and its parts (the roofline of :mod:`megatron_oases.device_model`).

Usage::

    python benchmarks/compare/one_rank_check.py                      # rtx3090-pcie, H=1024, TMP=2
    python benchmarks/compare/one_rank_check.py --pairs 2 --shape h2048
    python benchmarks/compare/one_rank_check.py --shape issue42 --threads-per-rank 0 \
        --variants megatron,oases --pairs 1           # issue 42's shape, the tool's defaults
"""

import argparse
import json
import os
import statistics
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, HERE)
sys.path.insert(0, ROOT)

from run_benchmarks import COMMON, SHAPES, shape  # noqa: E402  (the report's shapes)

from benchmarks import provenance  # noqa: E402

# small shapes for the agreement check (a few minutes per compare call on a 2-CPU host)
CHECK_SHAPES = {
    # issue 42's: H=1024, 16 heads, seq 512, micro-batch 4, 2 layers
    "issue42": shape(2, 1024, 16, 512, 4),
    "h768s256": shape(2, 768, 12, 256, 8),
    "h1536s256": shape(2, 1536, 24, 256, 4),
}
SHAPES = {**SHAPES, **CHECK_SHAPES}

OUT = os.path.join(ROOT, "benchmarks", "results", "compare", "one-rank-check")


def compare_argv(args, mode, pair):
    out = os.path.join(OUT, _tag(args), f"{mode}-{pair}")
    argv = [
        "compare",
        "--emulate-link",
        args.profile,
        "--nproc",
        str(args.tp),
        "--warmup",
        str(args.warmup),
        "--iters",
        str(args.iters),
        "--out",
        out,
        "--force",  # a new check replaces the committed runs
    ]
    if args.threads_per_rank:
        argv += ["--threads-per-rank", str(args.threads_per_rank)]
    if args.variants:
        argv += ["--variants", args.variants, "--no-host-pass"]
    if mode == "one-rank":
        argv.append("--one-rank")
    tp = ["--tensor-model-parallel-size", str(args.tp)]
    return argv + ["--", *tp, *COMMON, *SHAPES[args.shape]], out


def _tag(args):
    tag = f"{args.profile}-{args.shape}"
    return (
        tag if args.threads_per_rank == 1 else f"{tag}-threads{args.threads_per_rank or 'default'}"
    )


def speedups(out):
    with open(os.path.join(out, "results.json")) as f:
        rep = json.load(f)
    return {v["name"]: v["speedup"] for v in rep["variants"] if v["status"] == "ok"}, rep


def contention_free(rep):
    """Speed-ups over stock of the traced iteration less the time its compute waited for a CPU
    (``runq_us``: wall − CPU time of the compute ops, what other processes took). For stock,
    whose compute is on the critical path, that is the iteration on a free core; for an
    overlapping schedule an upper bound of its speed-up (a shorter compute may hide less)."""
    t = {
        v["name"]: v["trace"]["iteration_us"] - v["trace"]["runq_us"]
        for v in rep["variants"]
        if v["status"] == "ok" and v.get("trace")
    }
    base = t.get("megatron")
    return {n: base / x for n, x in t.items()} if base else {}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--profile", default="rtx3090-pcie")
    p.add_argument("--shape", default="h1024", choices=sorted(SHAPES))
    p.add_argument("--tp", type=int, default=2)
    p.add_argument("--pairs", type=int, default=2, help="alternated (all ranks, one rank) pairs")
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--iters", type=int, default=3)
    p.add_argument(
        "--threads-per-rank",
        type=int,
        default=1,
        help="passed to oases compare; 0 = its default (a rank's share of the CPUs)",
    )
    p.add_argument("--variants", default=None, help="oases compare --variants (and no host pass)")
    p.add_argument("--report-only", action="store_true")
    args = p.parse_args(argv)
    runs = {"all-ranks": [], "one-rank": []}
    command = provenance.command_line(
        __file__, [a for a in (sys.argv[1:] if argv is None else argv) if a != "--report-only"]
    )
    prov, read = provenance.record(provenance.EMULATED, command), []
    for pair in range(1, args.pairs + 1):
        for mode in runs:
            cmd, out = compare_argv(args, mode, pair)
            md, js = os.path.join(out, "results.md"), os.path.join(out, "results.json")
            if not args.report_only:
                print(f"=== pair {pair}, {mode}: oases {' '.join(cmd)}", flush=True)
                if subprocess.call([sys.executable, "-m", "megatron_oases", *cmd], cwd=ROOT) == 0:
                    provenance.stamp(prov, md, js)
            if os.path.exists(js):
                runs[mode].append(speedups(out))
                read.append(provenance.read(js))
    names = [n for n in runs["all-ranks"][0][0]] if runs["all-ranks"] else []
    lines = [
        f"# One rank against all ranks: {args.profile}, {args.shape}, TMP={args.tp}",
        "",
        "**Emulated interconnect** (`--emulate-link`), not GPU measurements. Each pair runs the "
        "same `oases compare` call with all ranks (one process each, gloo) and with `--one-rank` "
        "(rank 0 alone on the fake process group), alternated, "
        + (
            f"{args.threads_per_rank} thread(s) per process"
            if args.threads_per_rank
            else "each with oases compare's default threads per process"
        )
        + ". Speed-ups "
        "are over stock (`megatron`, full recompute) within the same call.",
        "",
        "Command: `python benchmarks/compare/one_rank_check.py "
        + " ".join(a for a in (argv or sys.argv[1:]) if a != "--report-only")
        + "`",
        "",
        "| variant | all ranks: speed-up per pair | one rank: speed-up per pair | mean all | "
        "mean one | one ÷ all |",
        "|---|---|---|---|---|---|",
    ]
    for n in names:
        a = [r[0].get(n) for r in runs["all-ranks"] if r[0].get(n)]
        o = [r[0].get(n) for r in runs["one-rank"] if r[0].get(n)]
        if not a or not o:
            continue
        ma, mo = statistics.fmean(a), statistics.fmean(o)
        lines.append(
            f"| {n} | {', '.join(f'{x:.3f}' for x in a)} | {', '.join(f'{x:.3f}' for x in o)} "
            f"| {ma:.3f} | {mo:.3f} | {mo / ma:.3f} |"
        )
    lines += [
        "",
        "Less the run-queue time (each traced iteration minus the time its compute waited for a "
        "CPU, `runq_us`: the share other processes took; exact for stock, an upper bound for an "
        "overlapping schedule):",
        "",
        "| variant | all ranks | one rank | one ÷ all | compute CPU share (all; one) |",
        "|---|---|---|---|---|",
    ]
    for n in names:
        a = [contention_free(r[1]).get(n) for r in runs["all-ranks"]]
        o = [contention_free(r[1]).get(n) for r in runs["one-rank"]]
        a, o = [x for x in a if x], [x for x in o if x]
        if not a or not o:
            continue
        share = {
            mode: ", ".join(
                f"{v['trace']['compute_cpu_share']:.2f}"
                for r in rs
                for v in r[1]["variants"]
                if v["name"] == n and v.get("trace")
            )
            for mode, rs in runs.items()
        }
        ma, mo = statistics.fmean(a), statistics.fmean(o)
        lines.append(
            f"| {n} | {ma:.3f} | {mo:.3f} | {mo / ma:.3f} | {share['all-ranks']}; "
            f"{share['one-rank']} |"
        )
    iters = {
        mode: [
            f"{1e3 * v['mean_iteration_s']:.0f}"
            for r in rs
            for v in r[1]["variants"]
            if v["name"] == "megatron" and v["status"] == "ok"
        ]
        for mode, rs in runs.items()
    }
    lines += [
        "",
        f"Stock iteration (host ms, per pair): all ranks {', '.join(iters['all-ranks'])}; one "
        f"rank {', '.join(iters['one-rank'])}.",
        "",
    ]
    for mode, rs in runs.items():
        for r in rs:
            e = r[1].get("emulation") or {}
            lines.append(
                f"- {mode}: {r[1]['config']['threads_per_rank']} thread(s) per process, D = "
                f"{e.get('dilation', float('nan')):.1f}"
                + (
                    f" (target GEMM {e['target_gemm_ms']:.3g} ms + memory "
                    f"{e['target_memory_ms']:.3g} ms; host GEMM {e['host_gemm_ms']:.4g} ms + "
                    f"memory {e['host_memory_ms']:.4g} ms)"
                    if "target_gemm_ms" in e
                    else ""
                )
            )
    lines.append("")
    path = os.path.join(OUT, _tag(args), "README.md")
    os.makedirs(os.path.dirname(path), exist_ok=True)
    # as current as the runs it reads
    prov = provenance.record(provenance.EMULATED, command, inputs=read or [None])
    with open(path, "w") as f:
        f.write(provenance.markdown("\n".join(lines), prov))
    print("\n".join(lines))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
