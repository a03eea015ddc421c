"""How good is ``oases plan --gpus N``'s choice? A grid small enough to run every candidate: a
small GPT on 4 emulated GPUs (rtx3090-pcie links), every layout the search ranks run under the
emulator (``--verify-top`` over all of them), plus the rule of thumb's pick.

    flock /tmp/oases-bench.lock python benchmarks/planner/verify_search.py \
        [--out benchmarks/results/planner] [--top K] [--repeats R] [--gpus 2]

``--gpus 2`` runs the same model's grid on 2 emulated GPUs (``verify_search_gpus2.*``): on a
2-CPU host a CPU per rank, so its figures are free of the ranks' contention for the CPUs that the
4-rank grid's are not (below); it has no layout with both TP and DP, so no split schedule under
sharding.

Each candidate runs ``--repeats`` times at most, the order reversed on every other repeat (so a
drift of the shared host's load falls on the candidates evenly), until the measured order of the
top 5 is the same after two repeats in a row; a candidate's measured time is the median of its
repeats. ``--top K`` runs the K the search ranks first (default: all) plus the rule of thumb's
pick. The distributed optimizer is left out of this grid (``oases train`` on gloo/CPU; the
question here is the ranking of the layouts and schedules). Sharded data parallelism is in it as
torch FSDP2 (the model's embedding and output weights untied, as FSDP2 needs) and Megatron-FSDP's
three strategies (with pipeline stages too): the search tries them at every layout with DP > 1,
and per family the fastest candidate stock and the fastest under a split schedule are run too
where the ranking holds none (``fsdp`` rows), each where its predicted time ranks it.

Reports the predicted against the measured iteration of each, Spearman's rank correlation over the
top 5 and over all, how far the chosen layout's measured time is from the best measured one, and
the rule of thumb's measured time. The search runs without the host term (``host_us_per_call 0``):
the emulator stretches the CPU's compute and the links, not the target host's issue cost. An
emulation on a 2-CPU host, not GPUs.

Beside the measured time, the measured time less the ranks' wait for a CPU: a correction for the
emulation host, which runs 4 ranks on 2 CPUs, where the target GPUs have a host CPU each. Per run,
the share of its traced (last) iteration the ranks' compute threads spent runnable but waiting for
a CPU (Linux run-queue time; the ranks' mean, as ``oases compare`` reports it as run-queue ms;
``cluster/verify.py:run_queue_share``) is taken off that run's measured iteration, and the
candidate's corrected figure is the median over its repeats, like the measured one. The traces do
not record every dependency between ranks (pipeline sends, FSDP2's gathers), so the wait on the
critical path itself cannot be walked; the report also gives the targets with the least- and the
most-waiting rank's share in place of the mean. The three targets (each within 15 % of its
prediction, Spearman over the top 5 ≥ 0.9, chosen within 3 % of the best) are reported on both
figures; the raw ones are the measurement.

    python benchmarks/planner/verify_search.py --reanalyze [--runs DIR] [--out DIR]

rebuilds ``verify_search.json`` and ``.md`` from the runs on disk (``DIR/r0``, ``r1``, ...: one
folder per candidate, its ``golden.json`` and traces) without running them again; the candidates,
predictions and D come from the existing ``verify_search.json``, and a run whose measured time is
not the one that file reports is refused.
"""

import argparse
import json
import logging
import math
import os
import statistics
import sys
import time
import warnings

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

from benchmarks import provenance  # noqa: E402

#: the models its figures depend on (the search's cost model, the emulated runs)
MODELS = ("cost_model", "device_model", "emulator", "dp_emulation")

MODEL = "tiny-cpu"
SHAPE = dict(num_layers=8, hidden_size=512, num_attention_heads=8, seq_length=512,
             max_position_embeddings=512, vocab_size=1024,
             untie_embeddings_and_output_weights=True)  # fmt: skip
#: The sharding strategies the grid runs: torch FSDP2 and Megatron-FSDP's three (all run on CPU
#: ranks, Megatron-FSDP through the megatron-fsdp-cpu platform patch).
SHARDING = (
    "torch_fsdp2",
    "megatron_fsdp/optim",
    "megatron_fsdp/optim_grads",
    "megatron_fsdp/optim_grads_params",
)
#: The families whose fastest stock and split-schedule candidates the grid runs where the ranking
#: holds none (:func:`_with_fsdp`).
FAMILIES = {
    "torch_fsdp2": ("torch_fsdp2",),
    "megatron_fsdp": SHARDING[1:],
}
GPUS, CLUSTER, GBS = 4, "rtx3090-pcie", 8


def report_name(gpus):
    """The grid's report stem: ``verify_search`` at the default 4 GPUs, ``verify_search_gpus2``
    at 2 (:data:`GPUS`)."""
    return "verify_search" if gpus == GPUS else f"verify_search_gpus{gpus}"


WARMUP, ITERS = 1, 3  # per run: timed iterations after the warm-up
RECOMPUTE_WORDS = {
    "none": "no",
    "selective": "selective",
    "selective+ln": "selective+ln",
    "full": "full",
}


def _degrees_word(row):
    """``, every layer at degree 1`` / ``, degrees [1, 2]`` where the plan's layers run below TP."""
    degrees, tp = row.get("degrees"), row.get("tp")
    if not degrees or tp is None or degrees == [tp]:
        return ""
    return f", every layer at degree {degrees[0]}" if len(degrees) == 1 else f", degrees {degrees}"


def _dilations(out):
    """``755-934``: the range of the candidates' D (one per layer shape)."""
    ds = [r["dilation"] for r in out["rows"] if r.get("dilation")] or [out["dilation"]]
    lo, hi = min(ds), max(ds)
    return f"{lo:.0f}" if round(lo) == round(hi) else f"{lo:.0f}-{hi:.0f}"


#: The report's two figures per candidate: the measurement, and it less the ranks' CPU wait.
BASES = (
    ("measured_s", "measured"),
    ("measured_less_runq_s", "measured less the CPU wait"),
)


def _combine(row):
    """``row``'s figures over its repeats, in place: ``measured_s`` the median of
    ``measured_repeats_s``; ``measured_less_runq_s`` the median of each repeat's measured time
    less its ranks' CPU wait (``run_queue_share_repeats``), and ``measured_less_runq_range_s``
    the same with the least- and the most-waiting rank's share (``run_queue_rank_shares_repeats``),
    only where every measured repeat has its share."""
    from megatron_oases.search.verify import less_run_queue

    for key in ("measured_s", "measured_less_runq_s", "measured_less_runq_range_s"):
        row.pop(key, None)
    runs = [
        (m, s, ranks)
        for m, s, ranks in zip(
            row["measured_repeats_s"],
            row["run_queue_share_repeats"],
            row["run_queue_rank_shares_repeats"],
        )
        if m is not None
    ]
    if not runs:
        return row
    row["measured_s"], row["status"] = statistics.median([m for m, _, _ in runs]), "ok"
    if any(s is None or not ranks for _, s, ranks in runs):
        return row
    row["measured_less_runq_s"] = statistics.median([less_run_queue(m, s) for m, s, _ in runs])
    row["measured_less_runq_range_s"] = [
        statistics.median([less_run_queue(m, pick(ranks)) for m, _, ranks in runs])
        for pick in (min, max)
    ]
    return row


def _summarize(out):
    """The targets on both figures (``targets``), the sensitivity of the corrected ones to which
    rank's wait is taken (``targets_rank_range``), and the raw figures' summary (the keys the
    report always had), into ``out``."""
    from megatron_oases.search.verify import grid_targets

    rows = out["rows"]
    out["targets"] = {key: grid_targets(rows, key) for key, _ in BASES}
    out["targets_rank_range"] = {}
    for i, which in enumerate(("least", "most")):
        picked = [
            dict(r, picked_s=(r.get("measured_less_runq_range_s") or [None, None])[i]) for r in rows
        ]
        out["targets_rank_range"][which] = grid_targets(picked, "picked_s")
    raw = out["targets"]["measured_s"]
    out.update(
        spearman_top5=raw["spearman_top5"],
        spearman_all=raw["spearman_all"],
        chosen=raw["chosen"],
        best_measured=raw["best"],
        chosen_over_best=raw["chosen_over_best"],
        rule_of_thumb=next((r for r in rows if r.get("rule_of_thumb")), out.get("rule_of_thumb")),
    )
    if out["rule_of_thumb"] and not out["rule_of_thumb"].get("rule_of_thumb"):
        thumb = out["rule_of_thumb"]  # the rule of thumb's pick ranked by the search: its row
        out["rule_of_thumb"] = next(
            (r for r in rows if (r["name"], r["schedule"]) == (thumb["name"], thumb["schedule"])),
            thumb,
        )
    return out


def _sharding_word(r):
    """``, FSDP2`` / ``, Megatron-FSDP optim_grads``: the candidate's sharding, if any."""
    from megatron_oases.planner.sharding import STRATEGIES

    sharding = r.get("data_parallel_sharding")
    return f", {STRATEGIES[sharding].label}" if sharding else ""


def _label(r):
    from megatron_oases.planner.sharding import STRATEGIES

    sharding = r.get("data_parallel_sharding")
    return r["name"] + (f" {STRATEGIES[sharding].short}" if sharding else "")


def _pct(x):
    return "n/a" if x is None else f"{100 * x:+.1f} %"


def _ms(x):
    return "n/a" if x is None else f"{1e3 * x:.2f}"


def _verdict(met):
    return "n/a" if met is None else ("**met**" if met else "**missed**")


def _target_lines(t, rows):
    """The three targets' cells of one basis (:func:`grid_targets`)."""

    def name(i):
        return "n/a" if i is None else _label(rows[i])

    worst = "n/a" if t["worst_row"] is None else f"{name(t['worst_row'])} {_pct(t['worst_error'])}"
    rho = "n/a" if t["spearman_top5"] is None else f"{t['spearman_top5']:.2f}"
    gap = "n/a" if t["chosen_over_best"] is None else f"{100 * t['chosen_over_best']:.1f} %"
    return [
        f"{_verdict(t['within_met'])} (worst: {worst})",
        f"{_verdict(t['spearman_top5_met'])} ({rho})",
        f"{_verdict(t['chosen_over_best_met'])} ({gap}; best {name(t['best_row'])})",
    ]


def write_report(out, out_dir):
    """``verify_search.md`` from the JSON result (``--report-only`` rebuilds it)."""
    from megatron_oases.search.verify import TARGETS

    rows = out["rows"]
    thumb_row = out["rule_of_thumb"]
    raw, fixed = (out["targets"][key] for key, _ in BASES)
    chosen = rows[raw["chosen_row"]]
    gpus = out.get("gpus", GPUS)
    cpus = out.get("host_cpus", 2)
    lines = [
        f"# `oases plan --gpus {gpus}`: predicted against emulated, every candidate run",
        "",
        "`python benchmarks/planner/verify_search.py"
        + ("" if gpus == GPUS else f" --gpus {gpus}")
        + "` (do not edit by hand"
        + ("; these figures re-read from the runs on disk by `--reanalyze`" if out.get(
            "reanalyzed") else "")  # fmt: skip
        + f"). **An emulation on a {cpus}-CPU host, not GPUs**: {gpus} ranks of `oases train` under "
        "`--emulate-link rtx3090-pcie` "
        f"(D per candidate's layer shape: {_dilations(out)}); measured = median timed iteration ÷ D. Model: GPT "
        "H=512, 8 layers, 8 heads, seq 512, vocabulary 1024 (untied), global batch 8; searched "
        "without the host term (the emulator does not reproduce the target host), with torch "
        "FSDP2 (`--use-torch-fsdp2`) and Megatron-FSDP (`--use-megatron-fsdp`, its three "
        "sharding strategies, with pipeline stages too) as the sharded data parallelism and "
        "without the distributed optimizer.",
        "",
        "| candidate | setting | predicted ms | measured ms | vs predicted | waiting for a CPU "
        "(per repeat) | measured less the CPU wait ms | vs predicted |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r, e_raw, e_fixed in zip(rows, raw["errors"], fixed["errors"]):
        tag = " (rule of thumb)" if r.get("rule_of_thumb") else ""
        got = _ms(r["measured_s"]) if "measured_s" in r else r["status"]
        shares = r.get("run_queue_share_repeats") or [None] * len(r["measured_repeats_s"])
        waits = ", ".join("n/a" if s is None else f"{100 * s:.0f} %"
                          for m, s in zip(r["measured_repeats_s"], shares) if m is not None)  # fmt: skip
        lines.append(f"| {r['name']}{tag} | {r['schedule']}, {RECOMPUTE_WORDS[r['recompute']]} recompute"
                     f"{', sequence chunks' if r['split'] == 'sequence' else ''}"
                     f"{_degrees_word(r)}{_sharding_word(r)} | "
                     f"{1e3 * r['predicted_s']:.2f} | {got} | {_pct(e_raw)} | {waits or 'n/a'} | "
                     f"{_ms(r.get('measured_less_runq_s'))} | {_pct(e_fixed)} |")  # fmt: skip
    least, most = out["targets_rank_range"]["least"], out["targets_rank_range"]["most"]
    if gpus > cpus:
        host = (
            f"The {gpus} ranks share {cpus} CPUs, so a rank's compute thread is at times runnable "
            "but waiting for a CPU (Linux run-queue time); the target GPUs do not share CPUs, and "
            "the planner has no such term. D itself is set at the rate a rank gets when all "
            f"compute at once ({cpus} ÷ {gpus} of one process's rate alone): a rank computing "
            "while others wait on the links runs faster than D assumes, so neither figure is "
            "what a CPU per rank would measure (`--gpus 2` on this host is that grid). "
        )
    else:
        host = (
            f"Each of the {gpus} ranks has a CPU of its own (D at the rate of one process alone), "
            "so what a compute thread waits for a CPU is what the ranks' gloo and emulator "
            "threads and the host's other work take from it: the correction is small here. "
        )
    lines += [
        "",
        f"**The CPU-wait correction (for the {cpus}-CPU emulation host only).** "
        + host
        + "Per run, the share of its traced (last) iteration the ranks waited so (the ranks' mean, "
        "`oases compare`'s run-queue ms ÷ the iteration) is taken off that run's measured time; "
        "the corrected figure is the median over the repeats, like the measured one. The "
        "measured column is the measurement; the corrected one an estimate: the traces do not "
        "record every dependency between ranks (pipeline sends, FSDP2's gathers), so the mean "
        "stands for the wait on the critical path; the last two columns show how far the "
        "verdicts hang on that (each run's least- or most-waiting rank's share in its place).",
        "",
        "| target | on the measured time | on the measured time less the CPU wait | the same, "
        "the least-waiting rank's share | the same, the most-waiting rank's share |",
        "|---|---|---|---|---|",
    ]
    names = (
        f"each candidate within {100 * TARGETS['within']:.0f} % of its prediction "
        "(the rule of thumb's included)",
        f"Spearman over the top 5 ≥ {TARGETS['spearman_top5']}",
        f"chosen ({_label(chosen)}) within {100 * TARGETS['chosen_over_best']:.0f} % of the best",
    )
    cells = [_target_lines(t, rows) for t in (raw, fixed, least, most)]
    for i, name in enumerate(names):
        lines.append(f"| {name} | " + " | ".join(c[i] for c in cells) + " |")
    fmt = lambda x: "n/a" if x is None else f"{x:.2f}"  # noqa: E731
    lines += [
        "",
        f"- Spearman over all {sum(1 for r in rows if not r.get('rule_of_thumb') and 'measured_s' in r)}: "
        f"{fmt(raw['spearman_all'])} measured, {fmt(fixed['spearman_all'])} less the CPU wait.",
    ]
    if thumb_row and "measured_s" in thumb_row and "measured_s" in chosen:
        lines.append(
            f"- Rule of thumb {thumb_row['name']} (stock, {RECOMPUTE_WORDS[thumb_row['recompute']]} recompute): "
            f"measured {1e3 * thumb_row['measured_s']:.2f} ms, "
            f"{thumb_row['measured_s'] / chosen['measured_s']:.2f}x the chosen one's."
        )
    text = "\n".join(lines) + "\n"
    if out.get("provenance"):  # the grid's run (--report-only, --reanalyze: re-read, not re-run)
        text = provenance.markdown(text, out["provenance"])
    with open(os.path.join(out_dir, report_name(gpus) + ".md"), "w") as f:
        f.write(text)


def _with_fsdp(cands, margs, result, gpus):
    """``cands`` with, per sharding family (torch FSDP2, Megatron-FSDP: :data:`FAMILIES`), the
    fastest candidate stock and the fastest under a split schedule (planned in full, at every
    layout and strategy of the family that runs there) where none of ``cands`` is one, each
    placed by its predicted time; their plans join ``result['plans']``."""
    from megatron_oases.planner.settings import AUTO, PlanSettings
    from megatron_oases.planner.sharding import strategies_for
    from megatron_oases.search.search import (
        OASES_CHOICES,
        STOCK_CHOICES,
        Layout,
        _profile,
        _refine,
        layouts,
    )
    from megatron_oases.testbed.clusters import load_cluster

    spec = load_cluster(CLUSTER)
    common = PlanSettings(global_batch_size=GBS, memory_gb=spec.memory_gb, host_us_per_call=0,
                          schedule=AUTO)  # fmt: skip
    family_of = {name: family for family, names in FAMILIES.items() for name in names}
    have = {
        (family_of[c["data_parallel_sharding"]], c["schedule"] == "off")
        for c in cands
        if c.get("data_parallel_sharding")
    }
    best = {}
    for layout in layouts(margs, gpus, GBS, spec.gpus_per_node):
        runs_here = strategies_for(layout.dp, layout.pp, True)
        profile = None
        for family, names in FAMILIES.items():
            for name in (n for n in names if n in runs_here):
                for stock, choices in ((True, STOCK_CHOICES), (False, OASES_CHOICES)):
                    key = (family, stock)
                    if key in have or (not stock and layout.tp == 1):
                        continue
                    profile = profile or _profile(margs, layout, CLUSTER)
                    row = {"data_parallel_sharding": name}
                    found = _refine(profile, layout, row, common, margs.num_layers, choices,
                                    uniform=True)  # fmt: skip
                    if found and (key not in best or found[0]["iteration_time_s"] <
                                  best[key][0]["iteration_time_s"]):  # fmt: skip
                        best[key] = found
    out = list(cands)
    for row, plan in best.values():
        row = dict(row, fsdp_extra=True)
        result.setdefault("plans", {})[row["name"]] = plan
        at = next((i for i, c in enumerate(out) if c["iteration_time_s"] > row["iteration_time_s"]
                   and not c.get("rule_of_thumb")), len(out))  # fmt: skip
        out.insert(at, row)
    return out


def _rows(repeats):
    """One row per candidate over the repeats so far (``repeats[i][j]``: repeat i's verify row of
    candidate j): the last repeat's row with every repeat's measured time and CPU-wait shares,
    and their medians (:func:`_combine`)."""
    rows = []
    for j, last in enumerate(repeats[-1]):
        row = {
            k: v for k, v in last.items() if k not in ("run_queue_share", "run_queue_rank_shares")
        }
        row["measured_repeats_s"] = [rep[j].get("measured_s") for rep in repeats]
        row["run_queue_share_repeats"] = [rep[j].get("run_queue_share") for rep in repeats]
        row["run_queue_rank_shares_repeats"] = [
            rep[j].get("run_queue_rank_shares") for rep in repeats
        ]
        rows.append(_combine(row))
    return rows


def reanalyze(runs_dir, out_dir, gpus=GPUS):
    """``verify_search.json`` (:func:`report_name`) in ``out_dir`` with every run's figures read
    again from ``runs_dir`` (``r0``, ``r1``, ...: one folder per candidate), and its report
    rewritten. A run whose median timed iteration ÷ D is not the measured time the file has is
    refused: those are not the runs it reports."""
    from megatron_oases.compare.runner import read_run
    from megatron_oases.errors import OasesConfigError
    from megatron_oases.search.verify import run_dir, run_queue_share

    path = os.path.join(out_dir, report_name(gpus) + ".json")
    try:
        with open(path) as f:
            out = json.load(f)
    except (OSError, ValueError) as exc:
        raise OasesConfigError(f"--reanalyze needs the grid's {path}: {exc}") from None
    dirs = [run_dir("", r) for r in out["rows"]]
    if len(set(dirs)) < len(dirs):
        raise OasesConfigError(
            f"--reanalyze: two candidates of {path} ran in one folder ({dirs}): the later run "
            "replaced the earlier's records, which cannot be read back"
        )
    for row in out["rows"]:
        shares, ranks = [], []
        for i, measured in enumerate(row["measured_repeats_s"]):
            share = rank_shares = None
            if measured is not None:
                vdir = run_dir(os.path.join(runs_dir, f"r{i}"), row)
                try:
                    got = read_run(vdir, WARMUP)
                except (OSError, ValueError) as exc:
                    raise OasesConfigError(f"--reanalyze: cannot read the run in {vdir}: {exc}")
                again = got["median_iteration_s"] / row["dilation"]
                if not math.isclose(again, measured, rel_tol=1e-9):
                    raise OasesConfigError(
                        f"--reanalyze: {vdir} measured {1e3 * again:.3f} ms where {path} has "
                        f"{1e3 * measured:.3f} ms: not the runs it reports (run the grid again "
                        "without --reanalyze)"
                    )
                share, rank_shares = run_queue_share(got["trace"])
            shares.append(share)
            ranks.append(rank_shares)
        row["run_queue_share_repeats"], row["run_queue_rank_shares_repeats"] = shares, ranks
        _combine(row)
    out["reanalyzed"] = True
    return _summarize(out)


def _write(out, out_dir):
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, report_name(out.get("gpus", GPUS)) + ".json"), "w") as f:
        json.dump(out, f, indent=1)
    write_report(out, out_dir)


def main(argv=None):
    warnings.filterwarnings("ignore")
    logging.disable(logging.WARNING)
    from megatron_oases.profiler.model_config import read_model_file
    from megatron_oases.search.search import model_for_search, search
    from megatron_oases.search.verify import verify, verify_table
    from megatron_oases.testbed.calibrate import host_cpus

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results", "planner"))
    p.add_argument("--runs", default=None,
                   help="the runs' directory (default /tmp/oases-verify-search, -gpus2 at 2)")  # fmt: skip
    p.add_argument("--report-only", action="store_true", help="rebuild the .md from the .json")
    p.add_argument("--reanalyze", action="store_true",
                   help="rebuild the .json and .md from the runs in --runs, without running "
                   "them again (the candidates, predictions and D from the existing .json)")  # fmt: skip
    p.add_argument("--top", type=int, default=None, help="run the K first candidates only")
    p.add_argument("--repeats", type=int, default=3, help="at most this many repeats (>= 2)")
    p.add_argument("--gpus", type=int, default=GPUS, choices=(2, GPUS),
                   help=f"emulated GPUs (default {GPUS}; 2: a rank per CPU of a 2-CPU host, "
                   "reported as verify_search_gpus2)")  # fmt: skip
    args = p.parse_args(argv)
    name = os.path.join(args.out, report_name(args.gpus))
    args.runs = args.runs or "/tmp/oases-" + report_name(args.gpus).replace("_", "-")
    if args.report_only:
        with open(name + ".json") as f:
            write_report(_summarize(json.load(f)), args.out)
        print(f"wrote {name}.md")
        return 0
    if args.reanalyze:
        _write(reanalyze(args.runs, args.out, args.gpus), args.out)
        print(f"wrote {name}.json and .md from the runs in {args.runs}")
        return 0
    prov = provenance.record(MODELS, provenance.command_line(__file__, argv))
    from megatron_oases.search import search as search_mod

    search_mod._optimizers = lambda layout: (False,)  # no distributed optimizer (docstring)
    flat = {**read_model_file(MODEL), **SHAPE}
    margs = model_for_search(flat, GBS)
    result = search(margs, CLUSTER, args.gpus, GBS, host_us_per_call=0, top=5, sharding=SHARDING)
    cands = result["candidates"][: args.top] if args.top else result["candidates"]
    cands = _with_fsdp(cands, margs, result, args.gpus)
    result["candidates"] = cands
    thumb = result["rule_of_thumb"]
    if thumb and not any(
        c["name"] == thumb["name"]
        and c["schedule"] == "off"
        and c["recompute"] == thumb["recompute"]
        for c in cands
    ):
        from megatron_oases.planner.settings import PlanSettings
        from megatron_oases.search.search import Layout, _flags

        extra = dict(thumb, level=0, rule_of_thumb=True)
        layout = Layout(**thumb["layout"])
        extra["launch_flags"] = _flags(layout, thumb, PlanSettings(global_batch_size=GBS))
        cands.append(extra)
    t0 = time.time()
    checked, rows, order_prev, repeats = None, None, None, []
    for rep_i in range(max(2, args.repeats)):
        order = cands if rep_i % 2 == 0 else cands[::-1]
        run = verify(dict(result, candidates=order), flat, os.path.join(args.runs, f"r{rep_i}"),
                     len(order), warmup=WARMUP, iters=ITERS, progress=print)  # fmt: skip
        got = {id(c): r for c, r in zip(order, run["rows"])}
        repeats.append([got[id(c)] for c in cands])
        checked = run
        rows = _rows(repeats)
        for r, c in zip(rows, cands):
            r["rule_of_thumb"] = bool(c.get("rule_of_thumb"))
        ranked_now = [r for r in rows if not r["rule_of_thumb"]]
        top_order = [r["name"] + r["schedule"] for r in sorted(
            (r for r in ranked_now[:5] if "measured_s" in r), key=lambda r: r["measured_s"])]  # fmt: skip
        print(f"repeat {rep_i + 1}: measured order of the top 5: {top_order}", flush=True)
        os.makedirs(args.out, exist_ok=True)  # what is measured so far, should the run be cut
        with open(name + ".partial.json", "w") as f:
            json.dump({"repeats_done": rep_i + 1, "top5_measured_order": top_order,
                       "rows": rows, "elapsed_s": round(time.time() - t0)}, f, indent=1)  # fmt: skip
        if rep_i >= 1 and top_order == order_prev:
            break
        order_prev = top_order
    checked["rows"] = rows
    print("\n".join(verify_table(checked)))
    thumb_row = next((r for r in rows if r["rule_of_thumb"]), None)
    if thumb_row is None and thumb:
        thumb_row = next(r for r in rows if r["name"] == thumb["name"])
    out = {
        "model": {**SHAPE, "name": MODEL + " (shape overridden)"},
        "gpus": args.gpus,
        "host_cpus": host_cpus(),
        "cluster": CLUSTER,
        "global_batch_size": GBS,
        "dilation": checked["dilation"],
        "rows": rows,
        "rule_of_thumb": thumb_row,
        "runs_s": round(time.time() - t0),
        "repeats": len(repeats),
        "candidates_run": len(cands),
        "provenance": prov,
    }
    _write(_summarize(out), args.out)
    print(f"wrote {name}.md ({out['runs_s']} s of runs)")
    return 0


if __name__ == "__main__":
    from megatron_oases.errors import OasesConfigError

    try:
        sys.exit(main())
    except OasesConfigError as exc:
        sys.exit(f"verify_search.py: error: {exc}")
