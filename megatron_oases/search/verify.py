"""``oases plan --gpus N --verify-top K``: run the search's K fastest candidates under the emulator
and set the measured iteration beside the predicted one.

Each candidate runs as ``oases train`` over N ranks on this host (``oases compare``'s runner:
torchrun, mock data, the model's shape flags, the candidate's launch line) with
``--emulate-link CLUSTER``: compute stretched by the dilation D (the roofline D of the candidate's
own layer shape, TP degree and micro-batch: one per candidate), every collective its modelled
time on the cluster's links. The measured figure is the median timed iteration ÷ D, the
emulation's stand-in for the target GPUs, compared with the candidate's predicted *device* time
(the host term is the target host's, which the emulator does not reproduce). An emulation, not
a measurement on GPUs.
"""

import os

from ..errors import OasesConfigError
from ..planner.sharding import STRATEGIES
from ..validation import samples_per_group

#: What the emulated grid (``benchmarks/planner/verify_search.py``) is held to: each candidate
#: within 15 % of its prediction, Spearman over the search's top 5 ≥ 0.9, the chosen candidate
#: within 3 % of the best measured.
TARGETS = {"within": 0.15, "spearman_top5": 0.9, "chosen_over_best": 0.03}


def spearman(xs, ys):
    """Spearman's rank correlation of two equal-length sequences (average ranks for ties)."""

    def ranks(v):
        order = sorted(range(len(v)), key=lambda i: v[i])
        out = [0.0] * len(v)
        i = 0
        while i < len(order):
            j = i
            while j + 1 < len(order) and v[order[j + 1]] == v[order[i]]:
                j += 1
            for k in range(i, j + 1):
                out[order[k]] = (i + j) / 2
            i = j + 1
        return out

    if len(xs) < 2:
        return None
    rx, ry = ranks(xs), ranks(ys)
    mx, my = sum(rx) / len(rx), sum(ry) / len(ry)
    cov = sum((a - mx) * (b - my) for a, b in zip(rx, ry))
    var = (sum((a - mx) ** 2 for a in rx) * sum((b - my) ** 2 for b in ry)) ** 0.5
    return cov / var if var else None


def _slug(name):
    return name.replace(" ", "-").lower()


def run_name(cand):
    """The name of candidate ``cand``'s run (a search row or a verify row): its layout, schedule,
    recompute setting and sharding, so that two candidates of one layout run apart."""
    parts = [cand["name"], cand.get("schedule") or "off", cand.get("recompute") or "none"]
    if cand.get("data_parallel_sharding"):
        parts.append(STRATEGIES[cand["data_parallel_sharding"]].short)
    return _slug(" ".join(parts).replace("+", "-"))


def run_dir(out_dir, cand):
    """The directory :func:`verify` runs candidate ``cand`` in (``--reanalyze`` reads it)."""
    return os.path.join(out_dir, run_name(cand))


def run_queue_share(trace):
    """How much of a run's traced (last) iteration its ranks waited for a CPU: ``(share, [each
    rank's])``, ``(None, None)`` where the trace has no run-queue record (untraced, not Linux).

    ``trace`` is the run's :func:`~megatron_oases.viz.analysis.run_metrics`; the share is its
    ``runq_us`` (the compute thread's run-queue wait, mean over ranks: ``oases compare``'s
    run-queue ms) ÷ its ``iteration_us``. The emulation host runs more ranks than it has CPUs, so
    a rank's compute waits for a core, which the target GPUs (a host CPU each) do not; the traces
    do not record every dependency between ranks (pipeline sends, FSDP2's gathers), so the wait
    on the critical path cannot be walked: the ranks' mean stands for it, as for ranks that
    compute in lockstep."""
    if not trace or trace.get("runq_us") is None or not trace.get("iteration_us"):
        return None, None
    ranks = [p["runq_us"] / p["iteration_us"] for p in trace.get("ranks", [])]
    return trace["runq_us"] / trace["iteration_us"], ranks


def less_run_queue(measured_s, share):
    """``measured_s`` less the share of it the ranks waited for a CPU (:func:`run_queue_share`,
    taken from the run's traced iteration and applied to its measured one); None without it."""
    return None if measured_s is None or share is None else measured_s * (1 - share)


def candidate_flags(cand, plan, out_dir):
    """A candidate's launch flags as run: its launch line, plus ``--oases-plan`` (the plan written
    into ``out_dir``) where a layer runs below the layout's TP: the line alone would run stock."""
    from ..formats.plan import needs_plan_file, save_plan

    flags = cand["launch_flags"].split()
    if plan is not None and needs_plan_file(plan):
        path = os.path.join(out_dir, f"{run_name(cand)}.plan.json")
        save_plan(plan, path)
        flags += ["--oases-plan", path]
    return flags


def layer_shape(layout, plan=None):
    """``(degree, samples)`` of the layer a rank of this candidate computes, which fixes its D: a
    layer at degree d < TP runs its share of the micro-batch (mb × d / TP samples) at d. Where
    the plan's degrees differ, the degree of the most layers (the smaller on a tie)."""
    tp, mb = layout["tp"], layout["micro_batch"]
    degrees = plan["degrees"] if plan is not None else [tp]
    d = min(set(degrees), key=lambda x: (-degrees.count(x), x))
    return d, samples_per_group(mb, d, tp)


def verify(result, model_flat, out_dir, k, warmup=1, iters=2, timeout=1800, progress=print):
    """Run ``result``'s first ``k`` candidates (:func:`.search.search`); returns
    ``{'rows': [...], 'spearman', 'dilation', 'best_measured', 'chosen_gap'}`` and adds
    ``measured_s`` to each run candidate."""
    from ..compare.runner import run_variant
    from ..compare.variants import Variant
    from ..config import EmulatedLink
    from ..profiler.model_config import model_argv
    from ..testbed.clusters import load_cluster
    from ..testbed.emulator import dilation_env, emulation_info

    if k < 1:
        raise OasesConfigError("--verify-top must be ≥ 1")
    import copy

    from .search import model_for_search

    gpus, cluster = result["gpus"], result["cluster"]
    profile = load_cluster(cluster)
    margs = model_for_search(model_flat, result["global_batch_size"])
    emulation = None
    base = model_argv(model_flat, shape_only=True) + ["--mock-data"]
    os.makedirs(out_dir, exist_ok=True)
    rows = []
    for i, cand in enumerate(result["candidates"][:k], 1):
        # (a sharded candidate runs every layer at TP: no plan file; its layout's plan in
        # ``plans`` may be another setting's)
        plan = (
            None
            if cand.get("data_parallel_sharding")
            else result.get("plans", {}).get(cand["name"])
        )
        flags = candidate_flags(cand, plan, out_dir)
        variant = Variant(name=run_name(cand), flags=tuple(flags), label=cand["name"], paper="")
        # D of this candidate's layer shape (TP degree, micro-batch): one per candidate
        cargs = copy.copy(margs)
        lay = cand["layout"]
        cargs.tensor_model_parallel_size, cargs.micro_batch_size = layer_shape(lay, plan)
        emulation = emulation_info(profile, EmulatedLink.from_args(cluster, cargs), gpus, 1)
        env = dilation_env(emulation["dilation"])
        progress(f"verify {i}/{k}: {cand['name']} {cand['schedule']} on {gpus} emulated ranks")
        run = run_variant(
            variant,
            base,
            out_dir,
            gpus,
            warmup,
            iters,
            emulate_link=cluster,
            env=env,
            timeout=timeout,
            progress=lambda line: None,
        )
        row = {
            "name": cand["name"],
            "schedule": cand["schedule"],
            "recompute": cand["recompute"],
            "split": cand["split"],
            "degrees": cand.get("degrees"),
            "tp": lay["tp"],
            "data_parallel_sharding": cand.get("data_parallel_sharding"),
            "predicted_s": cand["device_time_s"],
            "status": run["status"],
            "dilation": emulation["dilation"],
        }
        if run["status"] == "ok":
            row["measured_s"] = run["median_iteration_s"] / emulation["dilation"]
            cand["measured_s"] = row["measured_s"]
            row["run_queue_share"], row["run_queue_rank_shares"] = run_queue_share(run["trace"])
            row["measured_less_runq_s"] = less_run_queue(row["measured_s"], row["run_queue_share"])
        else:
            row["error"] = run.get("error")
        rows.append(row)
    out = {"rows": rows, "dilation": rows[0]["dilation"] if rows else None, "emulation": emulation}
    out.update(summarize(rows))
    return out


def summarize(rows):
    """Spearman over the measured rows, the best measured and how far the chosen one (the lowest
    predicted time: the search's pick, whatever order the rows ran in) is above it."""
    ok = [r for r in rows if "measured_s" in r]
    out = {"spearman": spearman([r["predicted_s"] for r in ok], [r["measured_s"] for r in ok])}
    if ok:
        best = min(ok, key=lambda r: r["measured_s"])
        out["best_measured"] = best["name"]
        chosen = min(rows, key=lambda r: r["predicted_s"])
        if "measured_s" in chosen:
            out["chosen_gap"] = chosen["measured_s"] / best["measured_s"] - 1
    return out


def grid_targets(rows, key="measured_s"):
    """:data:`TARGETS` on the figure ``key`` of each row (``measured_s``, or
    ``measured_less_runq_s``). ``rows`` in the search's order (lowest predicted first), the rule
    of thumb's flagged ``rule_of_thumb``: it counts for "each within", not for the ranking.
    Returns each row's ``errors`` (figure ÷ predicted − 1, None where it has none), the worst,
    Spearman over the first 5 with the figure and over all of them, the chosen candidate (the
    lowest predicted) and the best by the figure (``*_row``: its index in ``rows``), and per
    target whether it is met (a row without the figure misses "each within"; None where a target
    cannot be told: no row has the figure)."""
    errors = [None if r.get(key) is None else r[key] / r["predicted_s"] - 1 for r in rows]
    out = {"basis": key, "errors": errors, "worst": None, "worst_row": None, "worst_error": None}
    got = [i for i, e in enumerate(errors) if e is not None]
    if got:
        worst = max(got, key=lambda i: abs(errors[i]))
        out.update(worst=rows[worst]["name"], worst_row=worst, worst_error=errors[worst])
    out["within_met"] = (
        None
        if not got
        else len(got) == len(rows) and all(abs(errors[i]) <= TARGETS["within"] for i in got)
    )
    index = {id(r): i for i, r in enumerate(rows)}
    ranked = [r for r in rows if not r.get("rule_of_thumb") and r.get(key) is not None]
    top = ranked[:5]
    out["spearman_top5"] = spearman([r["predicted_s"] for r in top], [r[key] for r in top])
    out["spearman_all"] = spearman([r["predicted_s"] for r in ranked], [r[key] for r in ranked])
    rho = out["spearman_top5"]
    out["spearman_top5_met"] = None if rho is None else rho >= TARGETS["spearman_top5"]
    out.update(chosen=None, chosen_row=None, best=None, best_row=None)
    out.update(chosen_over_best=None, chosen_over_best_met=None)
    searched = [r for r in rows if not r.get("rule_of_thumb")]
    if searched and ranked:
        chosen = min(searched, key=lambda r: r["predicted_s"])
        best = min(ranked, key=lambda r: r[key])
        out.update(chosen=chosen["name"], chosen_row=index[id(chosen)])
        out.update(best=best["name"], best_row=index[id(best)])
        if chosen.get(key) is not None:
            gap = out["chosen_over_best"] = chosen[key] / best[key] - 1
            out["chosen_over_best_met"] = gap <= TARGETS["chosen_over_best"]
    return out


def verify_table(verified):
    lines = [f"{'candidate':<22} {'setting':<10} {'predicted ms':>13} {'measured ms':>12}"]
    for r in verified["rows"]:
        got = f"{1e3 * r['measured_s']:>12.2f}" if "measured_s" in r else f"  {r['status']}"
        setting = r["schedule"]
        if r.get("degrees") and r["degrees"] != [r.get("tp")]:  # layers below TP: the plan file
            setting += f" degrees {r['degrees']}"
        if r.get("data_parallel_sharding"):
            setting += " " + STRATEGIES[r["data_parallel_sharding"]].short
        lines.append(f"{r['name']:<22} {setting:<10} {1e3 * r['predicted_s']:>13.2f} {got}")
    rho, gap = verified.get("spearman"), verified.get("chosen_gap")
    lines.append(
        f"Spearman {'n/a' if rho is None else f'{rho:.2f}'}; the best measured: "
        f"{verified.get('best_measured')}"
        + ("" if gap is None else f"; the chosen one measured {100 * gap:.1f} % above it")
        + " (emulated, D per candidate's shape)"
    )
    return lines
