"""A/B two revisions of megatron-oases with the same ``oases compare`` call, side by side.

A code change's effect on a schedule is a few percent, below this host's run-to-run spread
between calls made minutes apart; alternating the two revisions (old, new, old, new, ...) on
one host in one sitting pairs each new run with an old run made under the same conditions.
Each revision runs from its own git worktree (``PYTHONPATH``; every ``oases train`` rank
inherits it), so the installed package is never swapped. Reports, per pair and variant, the
mean timed iteration, the exposed communication share, the schedule's own exposed share (each
collective's least blocked time over the ranks: robust to the ranks drifting apart on a noisy
host, see :mod:`megatron_oases.viz.analysis`) and the efficiency from the run's own trace, and
the old/new iteration ratio; writes them to ``OUT/ab.md``. ``--report-only`` rebuilds ``ab.md``
from the runs already in ``OUT`` with the current analysis.

    python benchmarks/compare/ab_revisions.py 2d740c4 581e34a --pairs 2 --out /tmp/ab -- \\
        --emulate-link rtx3090-pcie --nproc 2 --warmup 1 --iters 2 \\
        --variants overlap-norecompute -- --tensor-model-parallel-size 2 --vocab-size 8192 ...
    python benchmarks/compare/ab_revisions.py 2d740c4 581e34a --pairs 2 --out /tmp/ab \
        --report-only -- <the same oases compare arguments, for the heading>

Everything after the first ``--`` is passed to ``oases compare`` (its own ``--`` then separates
the model flags). Emulated-link figures: an emulation, not a measurement of the target GPUs.
"""

import argparse
import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _git(*args):
    return subprocess.run(
        ["git", "-C", ROOT, *args], check=True, capture_output=True, text=True
    ).stdout.strip()


def _run(tree, out, compare_args):
    """One ``oases compare`` call on ``tree``'s code; run from ``out`` so that neither the
    working directory nor the installed checkout shadows ``PYTHONPATH``."""
    os.makedirs(out, exist_ok=True)
    env = dict(os.environ, PYTHONPATH=tree)
    argv = [sys.executable, "-m", "megatron_oases", "compare", "--out", out, *compare_args]
    with open(os.path.join(out, "compare.log"), "w") as log:
        subprocess.run(argv, cwd=out, env=env, stdout=log, stderr=subprocess.STDOUT, check=True)
    with open(os.path.join(out, "results.json")) as f:
        return json.load(f)


def _rows(results, run_dir):
    """(name, mean iteration s, exposed share, schedule exposed share, efficiency) per variant;
    the schedule's exposure from the variant's traces with the current analysis."""
    import glob

    from megatron_oases.viz.analysis import load_traces, schedule_exposed_us

    for v in results["variants"]:
        trace = v.get("trace") or {}
        paths = sorted(glob.glob(os.path.join(run_dir, v["name"], "trace.rank*.json")))
        least = schedule_exposed_us(load_traces(paths)) if paths else None
        T = trace.get("iteration_us")
        yield (
            v["name"],
            v.get("mean_iteration_s"),
            trace.get("exposed_share"),
            least / T if least is not None and T else None,
            trace.get("efficiency"),
        )


def _fmt(x, spec):
    return "-" if x is None else format(x, spec)


def _pair_lines(k, got):
    lines = []
    for name, (_, t_old, x_old, s_old, e_old) in got["old"].items():
        _, t_new, x_new, s_new, e_new = got["new"].get(name, (name,) + (None,) * 4)
        ratio = t_old / t_new if t_old and t_new else None
        lines.append(
            f"| {k} | {name} | {_fmt(t_old, '.3f')} | {_fmt(t_new, '.3f')} | "
            f"{_fmt(ratio, '.3f')}x | {_fmt(x_old, '.1%')} | {_fmt(x_new, '.1%')} | "
            f"{_fmt(s_old, '.1%')} | {_fmt(s_new, '.1%')} | "
            f"{_fmt(e_old, '.2f')} | {_fmt(e_new, '.2f')} |"
        )
    return lines


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("old", help="the baseline revision (any git rev)")
    p.add_argument("new", help="the revision under test")
    p.add_argument("--pairs", type=int, default=2, help="old/new pairs, alternated")
    p.add_argument("--out", required=True)
    p.add_argument(
        "--report-only", action="store_true", help="rebuild OUT/ab.md from the runs in OUT"
    )
    args, rest = p.parse_known_args()
    compare_args = rest[1:] if rest[:1] == ["--"] else rest
    if not compare_args:
        p.error("give the oases compare arguments after --")
    out = os.path.abspath(args.out)
    done = [
        f"{side}{k}"
        for k in range(1, args.pairs + 1)
        for side in ("old", "new")
        if os.path.exists(os.path.join(out, f"{side}{k}", "results.json"))
    ]
    if done and not args.report_only:  # an old revision's compare would write over them
        p.error(f"--out {args.out} holds runs ({', '.join(done)}); choose another --out")
    lines = [
        f"# A/B: {args.old} (old) against {args.new} (new), {args.pairs} alternated pairs",
        "",
        f"`oases compare {' '.join(compare_args)}` per run (emulated link: an emulation).",
        "",
        "| pair | variant | old iter. s | new iter. s | old/new | old exposed | new exposed "
        "| old sched. exposed | new sched. exposed | old eff. | new eff. |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    trees = {}
    try:
        if not args.report_only:
            for side, rev in (("old", args.old), ("new", args.new)):
                trees[side] = os.path.join(out, "trees", side)
                _git("worktree", "add", "--detach", "-f", trees[side], rev)
        for k in range(1, args.pairs + 1):
            got = {}
            for side in ("old", "new"):
                run_dir = f"{out}/{side}{k}"
                if args.report_only:
                    with open(os.path.join(run_dir, "results.json")) as f:
                        results = json.load(f)
                else:
                    print(f"[pair {k}] {side} ({getattr(args, side)}) ...", flush=True)
                    results = _run(trees[side], run_dir, compare_args)
                got[side] = {r[0]: r for r in _rows(results, run_dir)}
            for line in _pair_lines(k, got):
                lines.append(line)
                print(line, flush=True)
        lines += [
            "",
            "exposed = time blocked on communication ÷ iteration, mean over ranks; sched. exposed "
            "= per collective the least any rank was blocked on it, summed, ÷ iteration (the rest "
            "is a rank waiting for a peer that arrived later); eff. = max(compute, comm) ÷ "
            "iteration. From each run's last-iteration trace.",
        ]
        with open(os.path.join(out, "ab.md"), "w") as f:
            f.write("\n".join(lines) + "\n")
        print(f"wrote {out}/ab.md")
    finally:
        for tree in trees.values():
            subprocess.run(["git", "-C", ROOT, "worktree", "remove", "--force", tree], check=False)


if __name__ == "__main__":
    main()
