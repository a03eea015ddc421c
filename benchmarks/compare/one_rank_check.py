"""Does one rank stand for the group? ``oases compare --one-rank`` against the multi-rank emulator.

Runs the same ``oases compare`` call (emulated link, every default variant) alternately with all
ranks (one process per rank, gloo) and with ``--one-rank`` (rank 0 alone, the others virtual), and
writes a table of each variant's speed-up over stock under both, with the spread of the repeats.
Both use one thread per process, so the compute of rank 0 runs at the same host rate (the same
dilation D) in both.

Usage::

    python benchmarks/compare/one_rank_check.py                      # rtx3090-pcie, H=1024, TMP=2
    python benchmarks/compare/one_rank_check.py --pairs 2 --shape h2048
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

from run_benchmarks import COMMON, SHAPES  # noqa: E402  (the report's shapes)

OUT = os.path.join(ROOT, "benchmarks", "results", "compare", "one-rank-check")


def compare_argv(args, mode, pair):
    out = os.path.join(OUT, f"{args.profile}-{args.shape}", f"{mode}-{pair}")
    argv = [
        "compare",
        "--emulate-link",
        args.profile,
        "--nproc",
        str(args.tp),
        "--threads-per-rank",
        "1",
        "--warmup",
        str(args.warmup),
        "--iters",
        str(args.iters),
        "--out",
        out,
    ]
    if mode == "one-rank":
        argv.append("--one-rank")
    tp = ["--tensor-model-parallel-size", str(args.tp)]
    return argv + ["--", *tp, *COMMON, *SHAPES[args.shape]], out


def speedups(out):
    with open(os.path.join(out, "results.json")) as f:
        rep = json.load(f)
    return {v["name"]: v["speedup"] for v in rep["variants"] if v["status"] == "ok"}, rep


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--profile", default="rtx3090-pcie")
    p.add_argument("--shape", default="h1024", choices=sorted(SHAPES))
    p.add_argument("--tp", type=int, default=2)
    p.add_argument("--pairs", type=int, default=2, help="alternated (all ranks, one rank) pairs")
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--iters", type=int, default=3)
    p.add_argument("--report-only", action="store_true")
    args = p.parse_args(argv)
    runs = {"all-ranks": [], "one-rank": []}
    for pair in range(1, args.pairs + 1):
        for mode in runs:
            cmd, out = compare_argv(args, mode, pair)
            if not args.report_only:
                print(f"=== pair {pair}, {mode}: oases {' '.join(cmd)}", flush=True)
                subprocess.call([sys.executable, "-m", "megatron_oases", *cmd], cwd=ROOT)
            if os.path.exists(os.path.join(out, "results.json")):
                runs[mode].append(speedups(out))
    names = [n for n in runs["all-ranks"][0][0]] if runs["all-ranks"] else []
    lines = [
        f"# One rank against all ranks: {args.profile}, {args.shape}, TMP={args.tp}",
        "",
        "**Emulated interconnect** (`--emulate-link`), not GPU measurements. Each pair runs the "
        "same `oases compare` call with all ranks (one process each, gloo) and with `--one-rank` "
        "(rank 0 alone on the fake process group), one thread per process, alternated. Speed-ups "
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
    path = os.path.join(OUT, f"{args.profile}-{args.shape}", "README.md")
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        f.write("\n".join(lines))
    print("\n".join(lines))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
