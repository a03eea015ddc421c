"""Planner solve-time benchmark: DP (default) and ILP (PuLP/CBC) at 24, 96 and 192 layers.

Instances: the paper's H=2048 layer (Table 4) repeated L times on the analytic ``rtx3090-nvlink``
cluster, T=4, candidate degrees {1, 2, 4}, global batch 128, schedule ``oases``. Memory budgets are
placed between the smallest memory any plan needs (``m_min``) and the memory of the all-degree-2 plan
(the unconstrained optimum here) at fractions 0.25/0.5/0.75 (memory-bound: the DP's memory dimension
and the ILP's knapsack row both matter) and 1.5 (the unconstrained optimum fits). Targets (issue 5,
this 2-core machine): 24 layers < 0.3 s, 96 < 2 s, 192 < 5 s for the default solver, i.e. the time
``oases plan`` spends building the instance and solving it.

The cluster search end to end (issue 62.4): ``oases plan --gpus 8`` and ``--gpus 64`` for
llama-7b on rtx4090-pcie (global batch 64 and 512), each a fresh process as a user runs it (imports,
the model's validation by Megatron's parser, profiles, search, the plan written), timed wall and CPU
(user + system of the child) with the host's load average at its start. Targets: 8 GPUs < 10 s wall,
64 GPUs < 60 s. ``--baseline-tree DIR`` times the same commands on another checkout too (e.g. a
``git worktree`` of the commit before), labelled with its commit.

    python benchmarks/planner/solve_time.py [--ilp-time-limit 60] [--out benchmarks/results/planner]
        [--baseline-tree DIR] [--cli-repeats 3]
"""

import argparse
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

from benchmarks import provenance  # noqa: E402
from megatron_oases.formats.profile import Profile  # noqa: E402
from megatron_oases.planner.api import solve  # noqa: E402
from megatron_oases.planner.build import build_problem  # noqa: E402
from megatron_oases.planner.dp import min_memory, solve_dp  # noqa: E402
from megatron_oases.planner.ilp import solve_ilp  # noqa: E402
from megatron_oases.planner.settings import PlanSettings  # noqa: E402
from megatron_oases.planner.time_model import decompose  # noqa: E402
from megatron_oases.profiler.analytic import analytic_profile  # noqa: E402
from megatron_oases.profiler.model_config import model_args, read_model_file  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
TARGETS = {24: 0.3, 96: 2.0, 192: 5.0}
FRACTIONS = (0.25, 0.5, 0.75, 1.5)
#: ``oases plan --gpus N`` end to end: (GPUs, global batch, target wall s) for CLI_MODEL on
#: CLI_CLUSTER.
CLI_CASES = ((8, 64, 10.0), (64, 512, 60.0))
CLI_MODEL, CLI_CLUSTER = "llama-7b", "rtx4090-pcie"


def profile_for(layers):
    flat = read_model_file(os.path.join(HERE, "models.yaml") + ":h2048")
    flat["num_layers"] = layers
    return Profile(analytic_profile(model_args(flat), "rtx3090-nvlink"))


def instance(prof, layers, frac):
    free = build_problem(prof, PlanSettings(schedule="oases", global_batch_size=128))
    lo = min_memory(free)
    hi = free.peak_memory_bytes([free.degrees.index(2)] * layers)
    mem_gb = (lo + frac * (hi - lo)) * (1 + free.margin) / 1e9
    return mem_gb


def timed_plan(prof, mem_gb, solver, time_limit):
    """Build + solve, as `oases plan` does (without writing files)."""
    t0 = time.perf_counter()
    p = build_problem(prof, PlanSettings(schedule="oases", global_batch_size=128, memory_gb=mem_gb))
    sol, _ = solve(p, solver=solver, time_limit_s=time_limit)
    return time.perf_counter() - t0, sol, p


def _commit(tree):
    try:
        return subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=tree, text=True, capture_output=True, check=True
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None


def time_cli(tree, gpus, gbs):
    """One ``oases plan --gpus`` process on checkout ``tree``: ``{wall_s, cpu_s, user_s, sys_s,
    load_average, search_s}`` (``search_s``: what the command says its search took)."""
    with tempfile.TemporaryDirectory(prefix="solve-time-") as tmp:
        cmd = [
            sys.executable,
            "-m",
            "megatron_oases",
            "plan",
            "--gpus",
            str(gpus),
            "--cluster",
            CLI_CLUSTER,
            "--model",
            CLI_MODEL,
            "--global-batch-size",
            str(gbs),
            "--out",
            os.path.join(tmp, "plan.json"),
        ]
        env = dict(os.environ, PYTHONPATH=tree)
        load = os.getloadavg()[0]
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        t0 = time.perf_counter()
        done = subprocess.run(cmd, cwd=tmp, env=env, text=True, capture_output=True)
        wall = time.perf_counter() - t0
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if done.returncode:
        raise SystemExit(f"{' '.join(cmd)} failed ({done.returncode}):\n{done.stderr[-2000:]}")
    user, sys_ = after.ru_utime - before.ru_utime, after.ru_stime - before.ru_stime
    searched = [w for w in done.stdout.split("\n") if " searched in " in w]
    search_s = float(searched[0].split(" searched in ")[1].split(" s")[0]) if searched else None
    return {
        "wall_s": wall,
        "cpu_s": user + sys_,
        "user_s": user,
        "sys_s": sys_,
        "load_average": load,
        "search_s": search_s,
    }


def cli_rows(trees, repeats):
    """``oases plan --gpus N`` timed ``repeats`` times per case on each ``(label, tree)``, the
    trees taking turns (so that a change in the host's load falls on both)."""
    runs = {(label, gpus): [] for label, _ in trees for gpus, _, _ in CLI_CASES}
    for _ in range(repeats):
        for gpus, gbs, _ in CLI_CASES:
            for label, tree in trees:
                one = time_cli(tree, gpus, gbs)
                runs[(label, gpus)].append(one)
                print(
                    f"oases plan --gpus {gpus} ({label}): {one['wall_s']:.2f} s wall, "
                    f"{one['cpu_s']:.2f} s CPU, load {one['load_average']:.1f}",
                    flush=True,
                )
    rows = []
    for label, tree in trees:
        for gpus, gbs, target in CLI_CASES:
            got = runs[(label, gpus)]
            med = {k: statistics.median(r[k] for r in got) for k in ("wall_s", "cpu_s", "user_s")}
            rows.append(
                {
                    "code": label,
                    "commit": _commit(tree),
                    "command": f"oases plan --gpus {gpus} --cluster {CLI_CLUSTER} "
                    f"--model {CLI_MODEL} --global-batch-size {gbs}",
                    "gpus": gpus,
                    "wall_s_median": med["wall_s"],
                    "wall_s_max": max(r["wall_s"] for r in got),
                    "cpu_s_median": med["cpu_s"],
                    "user_s_median": med["user_s"],
                    "search_s_median": statistics.median(r["search_s"] or 0.0 for r in got),
                    "load_average_median": statistics.median(r["load_average"] for r in got),
                    "target_wall_s": target,
                    "meets_target": med["wall_s"] < target,
                    "runs": got,
                }
            )
    return rows


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ilp-time-limit", type=float, default=60.0)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--layers", default="24,96,192", help="'' for none (the CLI part only)")
    ap.add_argument("--cli-repeats", type=int, default=3)
    ap.add_argument(
        "--baseline-tree",
        default=None,
        metavar="DIR",
        help="also time `oases plan --gpus` on this checkout (the code before)",
    )
    ap.add_argument("--out", default=os.path.join(HERE, "..", "results", "planner"))
    args = ap.parse_args(argv)
    prov = provenance.record(provenance.PLANNER, provenance.command_line(__file__, argv))
    rows = []
    load0 = os.getloadavg()
    for L in [int(x) for x in args.layers.split(",") if x.strip()]:
        prof = profile_for(L)
        for frac in FRACTIONS:
            mem = instance(prof, L, frac)
            dp_times = []
            for _ in range(args.repeats):
                t, sol, p = timed_plan(prof, mem, "dp", args.ilp_time_limit)
                dp_times.append(t)
            dec = decompose(p)
            dp_only = statistics.median(solve_dp(p, dec).solve_time_s for _ in range(args.repeats))
            ilp = solve_ilp(p, dec, time_limit_s=args.ilp_time_limit)
            agree = (
                ilp.status == "optimal"
                and abs(ilp.objective - sol.objective) <= 1e-6 * sol.objective
            )
            row = {
                "layers": L,
                "memory_fraction": frac,
                "memory_gb": round(mem, 3),
                "plan": [p.degrees[k] for k in sol.ks],
                "objective_s": sol.objective,
                "dp_path": sol.info.get("path"),
                "plan_time_s_median": statistics.median(dp_times),
                "plan_time_s_max": max(dp_times),
                "dp_solve_s_median": dp_only,
                "target_s": TARGETS.get(L),
                "meets_target": max(dp_times) < TARGETS.get(L, float("inf")),
                "ilp_status": ilp.status,
                "ilp_solve_s": ilp.solve_time_s,
                "ilp_objective_s": ilp.objective,
                "ilp_equals_dp": agree,
                "ilp_gap_vs_dp": (
                    None
                    if ilp.objective is None
                    else (ilp.objective - sol.objective) / sol.objective
                ),
            }
            rows.append(row)
            cmp = "= DP" if agree else f"gap {row['ilp_gap_vs_dp']}"
            print(
                f"L={L:3d} mem={mem:7.2f} GB ({frac:4.2f})  plan+solve dp "
                f"{row['plan_time_s_median']:.3f} s (max {row['plan_time_s_max']:.3f}, "
                f"{row['dp_path']})  ilp {ilp.solve_time_s:6.2f} s {ilp.status:9s} {cmp}",
                flush=True,
            )
    trees = [("before", os.path.abspath(args.baseline_tree))] if args.baseline_tree else []
    cli = cli_rows(trees + [("today", ROOT)], args.cli_repeats)
    result = {
        "benchmark": "planner solve time",
        "machine": {
            "cpu": platform.processor() or platform.machine(),
            "logical_cpus": os.cpu_count(),
            "python": platform.python_version(),
            "load_average_start": load0,
            "load_average_end": os.getloadavg(),
        },
        "ilp_time_limit_s": args.ilp_time_limit,
        "targets_s": TARGETS,
        "rows": rows,
        "cli_rows": cli,
        "all_targets_met": all(
            r["meets_target"] for r in rows + [c for c in cli if c["code"] == "today"]
        ),
    }
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "solve_time.json"), "w") as f:
        json.dump(provenance.with_provenance(result, prov), f, indent=1)
    with open(os.path.join(args.out, "solve_time.md"), "w") as f:
        f.write(provenance.markdown(markdown(result), prov))
    provenance.print_summary(prov)
    print("all targets met" if result["all_targets_met"] else "TARGET MISSED")
    return 0 if result["all_targets_met"] else 1


def markdown(result):
    lines = [
        "## `oases plan --gpus N`, end to end",
        "",
        "A fresh process each run (imports, the model's validation by Megatron's parser, profiles, "
        "search, the plan written); medians of the runs. CPU: user + system seconds of the "
        "process, what the wall time approaches on an idle core.",
        "",
        "| code | commit | command | wall s median / max | CPU s (user) | search s | "
        "target wall s | load average |",
        "|---|---|---|---:|---:|---:|---:|---:|",
    ]
    for r in result.get("cli_rows", ()):
        lines.append(
            f"| {r['code']} | {(r['commit'] or '?')[:12]} | `{r['command']}` | "
            f"{r['wall_s_median']:.2f} / {r['wall_s_max']:.2f} | {r['cpu_s_median']:.2f} "
            f"({r['user_s_median']:.2f}) | {r['search_s_median']:.2f} | {r['target_wall_s']:g} | "
            f"{r['load_average_median']:.1f} |"
        )
    lines += [
        "",
        "## The solver: one chain instance",
        "",
        "| layers | memory (GB) | plan (`oases plan`, DP) median / max s | target s | DP path | "
        "ILP (CBC) s | ILP status | ILP vs DP |",
        "|---:|---:|---:|---:|---|---:|---|---|",
    ]
    for r in result["rows"]:
        if r["ilp_equals_dp"]:
            cmp = "equal"
        elif r["ilp_gap_vs_dp"] is None:
            cmp = "no solution"
        else:
            cmp = f"+{r['ilp_gap_vs_dp'] * 100:.3f} % (incumbent)"
        lines.append(
            f"| {r['layers']} | {r['memory_gb']:.2f} ({r['memory_fraction']}) | "
            f"{r['plan_time_s_median']:.3f} / {r['plan_time_s_max']:.3f} | {r['target_s']} | "
            f"{r['dp_path']} | {r['ilp_solve_s']:.2f} | {r['ilp_status']} | {cmp} |"
        )
    m = result["machine"]
    lines.append("")
    lines.append(
        f"Machine: {m['cpu']}, {m['logical_cpus']} logical CPUs, Python {m['python']}; load average "
        f"{m['load_average_start'][0]:.1f} at start, {m['load_average_end'][0]:.1f} at end. ILP time "
        f"limit {result['ilp_time_limit_s']:g} s."
    )
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
