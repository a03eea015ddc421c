"""How good is ``oases plan --gpus N``'s choice? A grid small enough to run every candidate: a
small GPT on 4 emulated GPUs (rtx3090-pcie links), every layout the search ranks run under the
emulator (``--verify-top`` over all of them), plus the rule of thumb's pick.

    flock /tmp/oases-bench.lock python benchmarks/planner/verify_search.py \
        [--out benchmarks/results/planner] [--top K] [--repeats R]

Each candidate runs ``--repeats`` times at most, the order reversed on every other repeat (so a
drift of the shared host's load falls on the candidates evenly), until the measured order of the
top 5 is the same after two repeats in a row; a candidate's measured time is the median of its
repeats. ``--top K`` runs the K the search ranks first (default: all) plus the rule of thumb's
pick. The distributed optimizer is left out of this grid (``oases train`` on gloo/CPU; the
question here is the ranking of the layouts and schedules). Sharded data parallelism is in it as
torch FSDP2 (the model's embedding and output weights untied, as FSDP2 needs; Megatron-FSDP does
not run on CPU ranks): the search tries it at every layout with DP > 1, and the fastest FSDP2
candidate stock and the fastest under a split schedule are run too where the ranking holds none
(``fsdp`` rows), each where its predicted time ranks it.

Reports the predicted against the measured iteration of each, Spearman's rank correlation over the
top 5 and over all, how far the chosen layout's measured time is from the best measured one, and
the rule of thumb's measured time. The search runs without the host term (``host_us_per_call 0``):
the emulator stretches the CPU's compute and the links, not the target host's issue cost. An
emulation on a 2-CPU host, not GPUs.
"""

import argparse
import json
import logging
import os
import sys
import time
import warnings

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

MODEL = "tiny-cpu"
SHAPE = dict(num_layers=8, hidden_size=512, num_attention_heads=8, seq_length=512,
             max_position_embeddings=512, vocab_size=1024,
             untie_embeddings_and_output_weights=True)  # fmt: skip
#: The sharding strategies the grid runs (on CPU ranks: torch FSDP2 only).
SHARDING = ("torch_fsdp2",)
GPUS, CLUSTER, GBS = 4, "rtx3090-pcie", 8
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


def write_report(out, out_dir):
    """``verify_search.md`` from the JSON result (``--report-only`` rebuilds it)."""
    rho_top, rho_all = out["spearman_top5"], out["spearman_all"]
    thumb_row = out["rule_of_thumb"]
    ranked = [r for r in out["rows"] if not r.get("rule_of_thumb") and "measured_s" in r]
    chosen = ranked[0]
    best = min(ranked, key=lambda r: r["measured_s"])
    lines = [
        "# `oases plan --gpus 4`: predicted against emulated, every candidate run",
        "",
        "`python benchmarks/planner/verify_search.py` (do not edit by hand). **An emulation on a "
        "2-CPU host, not GPUs**: 4 ranks of `oases train` under `--emulate-link rtx3090-pcie` "
        f"(D per candidate's layer shape: {_dilations(out)}); measured = median timed iteration ÷ D. Model: GPT "
        "H=512, 8 layers, 8 heads, seq 512, vocabulary 1024 (untied), global batch 8; searched "
        "without the host term (the emulator does not reproduce the target host), with torch "
        "FSDP2 (`--use-torch-fsdp2`) as the sharded data parallelism (Megatron-FSDP does not run "
        "on CPU ranks) and without the distributed optimizer.",
        "",
        "| candidate | setting | predicted ms | measured ms |",
        "|---|---|---|---|",
    ]
    for r in out["rows"]:
        tag = " (rule of thumb)" if r.get("rule_of_thumb") else ""
        got = f"{1e3 * r['measured_s']:.2f}" if "measured_s" in r else r["status"]
        lines.append(f"| {r['name']}{tag} | {r['schedule']}, {RECOMPUTE_WORDS[r['recompute']]} recompute"
                     f"{', sequence chunks' if r['split'] == 'sequence' else ''}"
                     f"{_degrees_word(r)}{', FSDP2' if r.get('data_parallel_sharding') else ''} | "
                     f"{1e3 * r['predicted_s']:.2f} | {got} |")  # fmt: skip
    fmt = lambda x: "n/a" if x is None else f"{x:.2f}"  # noqa: E731
    lines += [
        "",
        f"- Spearman, predicted against measured: top 5 {fmt(rho_top)} (target ≥ 0.9), all "
        f"{len(ranked)} {fmt(rho_all)}.",
        f"- Chosen {chosen['name']}: measured {100 * out['chosen_over_best']:.1f} % above the best "
        f"measured ({best['name']}) (target ≤ 3 %).",
    ]
    if thumb_row and "measured_s" in thumb_row:
        lines.append(
            f"- Rule of thumb {thumb_row['name']} (stock, {RECOMPUTE_WORDS[thumb_row['recompute']]} recompute): "
            f"measured {1e3 * thumb_row['measured_s']:.2f} ms, "
            f"{thumb_row['measured_s'] / chosen['measured_s']:.2f}x the chosen one's."
        )
    with open(os.path.join(out_dir, "verify_search.md"), "w") as f:
        f.write("\n".join(lines) + "\n")


def _with_fsdp(cands, margs, result):
    """``cands`` with the fastest FSDP2 candidate stock and the fastest under a split schedule
    (planned in full, at every layout FSDP2 runs) where none of ``cands`` is one, each placed by
    its predicted time; their plans join ``result['plans']``."""
    from megatron_oases.planner.cluster.search import (
        OASES_CHOICES,
        STOCK_CHOICES,
        Layout,
        _profile,
        _refine,
        layouts,
    )
    from megatron_oases.planner.settings import AUTO, PlanSettings
    from megatron_oases.planner.sharding import strategies_for
    from megatron_oases.testbed.clusters import load_cluster

    spec = load_cluster(CLUSTER)
    common = PlanSettings(global_batch_size=GBS, memory_gb=spec.memory_gb, host_us_per_call=0,
                          schedule=AUTO)  # fmt: skip
    have = {c["schedule"] == "off" for c in cands if c.get("data_parallel_sharding")}
    best = {}
    for layout in layouts(margs, GPUS, GBS, spec.gpus_per_node):
        if "torch_fsdp2" not in strategies_for(layout.dp, layout.pp, True):
            continue
        profile = _profile(margs, layout, CLUSTER)
        for stock, choices in ((True, STOCK_CHOICES), (False, OASES_CHOICES)):
            if stock in have or (not stock and layout.tp == 1):
                continue
            row = {"data_parallel_sharding": "torch_fsdp2"}
            found = _refine(profile, layout, row, common, margs.num_layers, choices, uniform=True)
            if found and (stock not in best or found[0]["iteration_time_s"] <
                          best[stock][0]["iteration_time_s"]):  # fmt: skip
                best[stock] = found
    out = list(cands)
    for row, plan in best.values():
        row = dict(row, fsdp_extra=True)
        result.setdefault("plans", {})[row["name"]] = plan
        at = next((i for i, c in enumerate(out) if c["iteration_time_s"] > row["iteration_time_s"]
                   and not c.get("rule_of_thumb")), len(out))  # fmt: skip
        out.insert(at, row)
    return out


def main(argv=None):
    warnings.filterwarnings("ignore")
    logging.disable(logging.WARNING)
    from megatron_oases.planner.cluster.search import model_for_search, search
    from megatron_oases.planner.cluster.verify import spearman, verify, verify_table
    from megatron_oases.profiler.model_config import read_model_file

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results", "planner"))
    p.add_argument("--runs", default="/tmp/oases-verify-search", help="the runs' directory")
    p.add_argument("--report-only", action="store_true", help="rebuild the .md from the .json")
    p.add_argument("--top", type=int, default=None, help="run the K first candidates only")
    p.add_argument("--repeats", type=int, default=3, help="at most this many repeats (>= 2)")
    args = p.parse_args(argv)
    if args.report_only:
        with open(os.path.join(args.out, "verify_search.json")) as f:
            write_report(json.load(f), args.out)
        print(f"wrote {args.out}/verify_search.md")
        return 0
    from megatron_oases.planner.cluster import search as search_mod

    search_mod._optimizers = lambda layout: (False,)  # no distributed optimizer (docstring)
    flat = {**read_model_file(MODEL), **SHAPE}
    margs = model_for_search(flat, GBS)
    result = search(margs, CLUSTER, GPUS, GBS, host_us_per_call=0, top=5, sharding=SHARDING)
    cands = result["candidates"][: args.top] if args.top else result["candidates"]
    cands = _with_fsdp(cands, margs, result)
    result["candidates"] = cands
    thumb = result["rule_of_thumb"]
    if thumb and not any(
        c["name"] == thumb["name"]
        and c["schedule"] == "off"
        and c["recompute"] == thumb["recompute"]
        for c in cands
    ):
        from megatron_oases.planner.cluster.search import Layout, _flags
        from megatron_oases.planner.settings import PlanSettings

        extra = dict(thumb, level=0, rule_of_thumb=True)
        layout = Layout(**thumb["layout"])
        extra["launch_flags"] = _flags(layout, thumb, PlanSettings(global_batch_size=GBS))
        cands.append(extra)
    t0 = time.time()
    checked, rows, order_prev, repeats = None, None, None, []
    for rep_i in range(max(2, args.repeats)):
        order = cands if rep_i % 2 == 0 else cands[::-1]
        run = verify(dict(result, candidates=order), flat, os.path.join(args.runs, f"r{rep_i}"),
                     len(order), warmup=1, iters=3, progress=print)  # fmt: skip
        got = {id(c): r for c, r in zip(order, run["rows"])}
        repeats.append([got[id(c)].get("measured_s") for c in cands])
        checked = run
        rows = [dict(got[id(c)]) for c in cands]
        for i, r in enumerate(rows):
            vals = sorted(v[i] for v in repeats if v[i] is not None)
            r["measured_repeats_s"] = [v[i] for v in repeats]
            if vals:
                mid = len(vals) // 2
                r["measured_s"] = vals[mid] if len(vals) % 2 else (vals[mid - 1] + vals[mid]) / 2
                r["status"] = "ok"
        ranked_now = [r for r, c in zip(rows, cands) if not c.get("rule_of_thumb")]
        top_order = [r["name"] + r["schedule"] for r in sorted(
            (r for r in ranked_now[:5] if "measured_s" in r), key=lambda r: r["measured_s"])]  # fmt: skip
        print(f"repeat {rep_i + 1}: measured order of the top 5: {top_order}", flush=True)
        os.makedirs(args.out, exist_ok=True)  # what is measured so far, should the run be cut
        with open(os.path.join(args.out, "verify_search.partial.json"), "w") as f:
            json.dump({"repeats_done": rep_i + 1, "top5_measured_order": top_order,
                       "rows": rows, "elapsed_s": round(time.time() - t0)}, f, indent=1)  # fmt: skip
        if rep_i >= 1 and top_order == order_prev:
            break
        order_prev = top_order
    checked["rows"] = rows
    print("\n".join(verify_table(checked)))
    ranked = [r for r, c in zip(rows, cands) if not c.get("rule_of_thumb") and "measured_s" in r]
    top = ranked[:5]
    rho_top = spearman([r["predicted_s"] for r in top], [r["measured_s"] for r in top])
    rho_all = spearman([r["predicted_s"] for r in ranked], [r["measured_s"] for r in ranked])
    best = min(ranked, key=lambda r: r["measured_s"])
    chosen = ranked[0]
    thumb_row = next((r for r, c in zip(rows, cands) if c.get("rule_of_thumb")), None)
    if thumb_row is None and thumb:
        thumb_row = next(r for r in rows if r["name"] == thumb["name"])
    for r, c in zip(rows, cands):
        r["rule_of_thumb"] = bool(c.get("rule_of_thumb"))
    out = {
        "model": {**SHAPE, "name": MODEL + " (shape overridden)"},
        "gpus": GPUS,
        "cluster": CLUSTER,
        "global_batch_size": GBS,
        "dilation": checked["dilation"],
        "rows": rows,
        "spearman_top5": rho_top,
        "spearman_all": rho_all,
        "chosen": chosen["name"],
        "best_measured": best["name"],
        "chosen_over_best": chosen["measured_s"] / best["measured_s"] - 1,
        "rule_of_thumb": thumb_row,
        "runs_s": round(time.time() - t0),
        "repeats": len(repeats),
        "candidates_run": len(cands),
    }
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "verify_search.json"), "w") as f:
        json.dump(out, f, indent=1)
    write_report(out, args.out)
    print(f"wrote {args.out}/verify_search.md ({out['runs_s']} s of runs)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
