"""Plan the paper's Table 4 models on the analytic ``rtx3090-nvlink`` / ``rtx3090-pcie`` clusters.

For every model (hidden size, layers, heads, TMP degree T, DP degree, global batch of Table 4; sequence
1024) and cluster: an analytic profile, an ``oases plan`` with the ``oases`` schedule in the cluster's
24 GB (10 % safety margin), verified ILP == DP, and the predicted speedup over uniform TMP at T (what
Table 4's baselines use) and over the best uniform degree that fits. The paper's Table 6 plans are
predicted with the same cost model for comparison, and a memory sweep shows where mixed plans appear.

    python benchmarks/planner/table4.py [--out benchmarks/results/planner]
"""

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

from benchmarks import provenance  # noqa: E402
from megatron_oases.errors import OasesConfigError  # noqa: E402
from megatron_oases.formats.profile import Profile  # noqa: E402
from megatron_oases.planner.api import make_plan  # noqa: E402
from megatron_oases.planner.build import build_problem  # noqa: E402
from megatron_oases.planner.dp import min_memory  # noqa: E402
from megatron_oases.planner.explain import compress_degrees  # noqa: E402
from megatron_oases.planner.settings import PlanSettings  # noqa: E402
from megatron_oases.planner.time_model import evaluate  # noqa: E402
from megatron_oases.profiler.analytic import analytic_profile  # noqa: E402
from megatron_oases.profiler.model_config import model_args, read_model_file  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
MODELS = ("h1024", "h2048", "h3072", "h4096", "h6144", "h8192", "h12288")
CLUSTERS = ("rtx3090-nvlink", "rtx3090-pcie")
# Table 6 (paper): planner strategies and throughput (k tokens/s) without / with the planner.
PAPER_TABLE6 = {
    ("rtx3090-nvlink", "h2048"): ([2] * 8 + [4] * 16, 43.9, 50.9, 451.6),
    ("rtx3090-nvlink", "h4096"): ([2] * 10 + [4] * 6, 23.8, 25.2, 380.4),
    ("rtx3090-nvlink", "h8192"): ([4] * 2 + [8] * 6, 8.9, 9.1, 157.7),
    ("rtx3090-pcie", "h2048"): ([2] * 8 + [4] * 16, 42.5, 44.7, 495.4),
    ("rtx3090-pcie", "h4096"): ([2] * 10 + [4] * 6, 23.8, 24.3, 410.0),
    ("rtx3090-pcie", "h8192"): ([4] * 2 + [8] * 6, 8.9, 9.0, 162.7),
}
SWEEP_GB = (24, 22, 20, 19, 18, 17)


def load_profile_for(model, cluster):
    margs = model_args(read_model_file(os.path.join(HERE, "models.yaml") + f":{model}"))
    return Profile(analytic_profile(margs, cluster)), margs


def plan_row(
    prof,
    margs,
    cluster,
    model,
    memory_gb,
    grad_sync=False,
    allow_unsplit=True,
    distributed_optimizer=False,
):
    try:
        plan, problem, sol = make_plan(
            prof,
            PlanSettings(
                global_batch_size=margs.global_batch_size,
                memory_gb=memory_gb,
                schedule="oases",
                grad_sync=grad_sync,
                allow_unsplit=allow_unsplit,
                distributed_optimizer=distributed_optimizer,
            ),
            verify=True,
        )
    except OasesConfigError as exc:
        msg = str(exc)
        if "smallest memory that fits is" in msg:
            msg = "infeasible; needs ≥ " + msg.rsplit("is ", 1)[1]
        return {"model": model, "cluster": cluster, "memory_gb": memory_gb, "error": msg}
    T = margs.tensor_model_parallel_size
    uni = plan["uniform"]
    return {
        "model": model,
        "cluster": cluster,
        "memory_gb": memory_gb,
        "grad_sync": grad_sync,
        "T": T,
        "dp": margs.data_parallel_size,
        "global_batch": margs.global_batch_size,
        "degrees": plan["degrees"],
        "plan": compress_degrees(plan["degrees"]),
        "candidates": plan["constraints"]["degrees"],
        "unsplit_degrees": plan["unsplit_degrees"],
        "iteration_s": plan["predicted"]["iteration_time_s"],
        "k_tokens_s": plan["predicted"]["tokens_per_s"] / 1e3,
        "peak_gb": plan["predicted"]["peak_memory_bytes_per_rank"] / 1e9,
        "uniform_T_s": uni[str(T)]["iteration_time_s"] if str(T) in uni else None,
        "uniform_T_fits": uni[str(T)]["fits"] if str(T) in uni else None,
        "speedup_vs_uniform_T": plan["speedup"].get(f"uniform_{T}"),
        "speedup_vs_best_uniform": plan["speedup"].get("best_fitting_uniform"),
        "uniform": uni,
        "solve_ms": plan["solve_time_s"] * 1e3,
        "ilp_ms": plan["verify"]["ilp"]["solve_time_s"] * 1e3,
        "verify": plan["verify"]["agree"],
    }


def paper_plan_row(prof, margs, cluster, model):
    degrees, base_k, planner_k, optim_ms = PAPER_TABLE6[(cluster, model)]
    T = margs.tensor_model_parallel_size
    kw = dict(
        schedule="oases",
        global_batch_size=margs.global_batch_size,
        memory_gb=24,
        degrees=sorted(set(degrees) | {T}),
        allow_unsplit=True,
    )
    problem = build_problem(prof, PlanSettings(**kw))
    res = evaluate(problem, problem.index(degrees))
    uni = evaluate(problem, problem.index([T] * margs.num_layers))
    dist = build_problem(prof, PlanSettings(distributed_optimizer=True, **kw))
    return {
        "model": model,
        "cluster": cluster,
        "paper_plan": compress_degrees(degrees),
        "paper_speedup": planner_k / base_k,
        "paper_optim_ms": optim_ms,
        "predicted_speedup_of_paper_plan": uni["iteration_time_s"] / res["iteration_time_s"],
        "paper_plan_peak_gb": res["peak_memory_bytes"] / 1e9,
        "paper_plan_fits_24gb": bool(problem.feasible(problem.index(degrees))),
        "paper_plan_peak_gb_distributed_optimizer": dist.peak_memory_bytes(dist.index(degrees))
        / 1e9,
        "paper_plan_fits_24gb_distributed_optimizer": bool(dist.feasible(dist.index(degrees))),
    }


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.path.join(HERE, "..", "results", "planner"))
    args = ap.parse_args(argv)
    prov = provenance.record(provenance.PLANNER, provenance.command_line(__file__, argv))
    rows, paper, sweep, sync, dopt = [], [], [], [], []
    for cluster in CLUSTERS:
        for model in MODELS:
            prof, margs = load_profile_for(model, cluster)
            r = plan_row(prof, margs, cluster, model, 24)
            rows.append(r)
            print(_fmt(r), flush=True)
            sync.append(plan_row(prof, margs, cluster, model, 24, grad_sync=True))
            dopt.append(plan_row(prof, margs, cluster, model, 24, distributed_optimizer=True))
            if (cluster, model) in PAPER_TABLE6:
                paper.append(paper_plan_row(prof, margs, cluster, model))
                free = build_problem(
                    prof,
                    PlanSettings(
                        schedule="oases",
                        global_batch_size=margs.global_batch_size,
                        allow_unsplit=True,
                    ),
                )
                need = min_memory(free) * 1.1 / 1e9
                for gb in SWEEP_GB:
                    w = plan_row(prof, margs, cluster, model, gb)
                    w["min_memory_gb"] = need
                    sweep.append(w)
    result = {
        "table4": rows,
        "paper_table6": paper,
        "memory_sweep": sweep,
        "grad_sync": sync,
        "distributed_optimizer": dopt,
    }
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "table4.json"), "w") as f:
        json.dump(provenance.with_provenance(result, prov), f, indent=1)
    with open(os.path.join(args.out, "table4.md"), "w") as f:
        f.write(provenance.markdown(markdown(result), prov))
    print(markdown(result))
    provenance.print_summary(prov)
    return 0


def _fmt(r):
    if "error" in r:
        return f"{r['cluster']:15s} {r['model']:7s} {r['memory_gb']} GB: {r['error']}"
    return (
        f"{r['cluster']:15s} {r['model']:7s} T={r['T']} {r['plan']:28s} "
        f"{r['k_tokens_s']:7.1f} k tok/s  ×{r['speedup_vs_uniform_T']:.3f} vs [{r['T']}]*L  "
        f"peak {r['peak_gb']:.1f} GB  dp {r['solve_ms']:.1f} ms ilp {r['ilp_ms']:.0f} ms"
    )


def _row_md(r, extra=()):
    if "error" in r:
        return f"| {r['model']} | {r['cluster']} | {r['memory_gb']} | — | {r['error']} |" + " |" * (
            len(extra) + 5
        )
    vs_t = r["speedup_vs_uniform_T"]
    vs_best = r["speedup_vs_best_uniform"]
    return (
        f"| {r['model']} | {r['cluster']} | {r['memory_gb']} | {r['T']} | `{r['plan']}` | "
        f"{r['k_tokens_s']:.1f} | {vs_t:.3f}× | "
        + (f"{vs_best:.3f}×" if vs_best else "—")
        + f" | {r['peak_gb']:.1f} | {r['solve_ms']:.1f} / {r['ilp_ms']:.0f} |"
        + "".join(f" {x} |" for x in extra)
    )


def markdown(result):
    head = (
        "| model | cluster | memory GB | T | plan | pred. k tok/s | vs uniform T | vs best uniform "
        "| peak GB | DP / ILP ms |\n|---|---|---:|---:|---|---:|---:|---:|---:|---:|"
    )
    out = ["## Table 4 models, 24 GB, schedule `oases` (eq. 5 objective)", "", head]
    out += [_row_md(r) for r in result["table4"]]
    out += [
        "",
        "## Paper's Table 6 plans under our cost model",
        "",
        "| model | cluster | paper plan | paper speedup (measured) | our predicted speedup of "
        "that plan | its peak GB (replicated Adam / distributed optimizer) | fits 24 GB |",
        "|---|---|---|---:|---:|---:|---|",
    ]
    for p in result["paper_table6"]:
        out.append(
            f"| {p['model']} | {p['cluster']} | `{p['paper_plan']}` | {p['paper_speedup']:.3f}× | "
            f"{p['predicted_speedup_of_paper_plan']:.3f}× | {p['paper_plan_peak_gb']:.1f} / "
            f"{p['paper_plan_peak_gb_distributed_optimizer']:.1f} | "
            f"{p['paper_plan_fits_24gb']} / {p['paper_plan_fits_24gb_distributed_optimizer']} |"
        )
    out += ["", "## Memory sweep (Table 6 models)", "", head]
    out += [_row_md(r) for r in result["memory_sweep"]]
    out += [
        "",
        "## Optimizer state sharded over data-parallel replicas (`--distributed-optimizer`)",
        "",
        head,
    ]
    out += [_row_md(r) for r in result["distributed_optimizer"]]
    out += [
        "",
        "## With the data-parallel gradient all-reduce in the objective (`--grad-sync`)",
        "",
        head,
    ]
    out += [_row_md(r) for r in result["grad_sync"]]
    return "\n".join(out) + "\n"


if __name__ == "__main__":
    sys.exit(main())
