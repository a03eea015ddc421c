"""How long ``oases plan --gpus N`` takes and what it picks: a 7B-class GPT (gpt-6.7b, 32 layers)
on 8 and 64 GPUs of two clusters and a 7B Llama-style model (llama-7b) on 8 PCIe cards (RTX 4090,
L40S, L4), against the best stock Megatron layout at any TP (every layout, recompute setting, the
distributed optimizer and FSDP) and the rule of thumb (TP within a node, the fewest stages that fit, the
largest micro-batch, stock with its fastest recompute setting that fits). Predictions of the
planner's model, not measurements.

    python benchmarks/planner/search.py [--out benchmarks/results/planner]
"""

import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

import report_cli  # noqa: E402 (beside this script)

from benchmarks import provenance  # noqa: E402

#: (model file, overrides, cluster, GPUs, global batch); the 256k vocabulary is where an uneven
#: pipeline split wins (its output layer costs about five layers)
CASES = [
    ("gpt-6.7b", {}, "rtx3090-pcie", 8, 64),
    ("gpt-6.7b", {}, "rtx3090-pcie", 64, 512),
    ("gpt-6.7b", {}, "h100-nvlink", 8, 64),
    ("gpt-6.7b", {}, "h100-nvlink", 64, 512),
    ("gpt-6.7b", {"vocab_size": 256000}, "rtx3090-pcie", 16, 64),
    ("llama-7b", {}, "rtx4090-pcie", 8, 64),
    ("llama-7b", {}, "l40s-pcie", 8, 64),
    ("llama-7b", {}, "l4-pcie", 8, 64),
]


def main(argv=None):
    args = report_cli.start(__doc__, argv)
    prov = provenance.record(provenance.PLANNER, provenance.command_line(__file__, argv))
    from megatron_oases.planner.choose import setting_name
    from megatron_oases.profiler.model_config import read_model_file
    from megatron_oases.search.search import model_for_search, search

    rows = []
    for model, overrides, cluster, gpus, gbs in CASES:
        margs = model_for_search(read_model_file(model), gbs, overrides=overrides)
        model += "".join(f" {k}={v}" for k, v in overrides.items())
        r = search(margs, cluster, gpus, gbs)
        w, thumb = r["candidates"][0], r["rule_of_thumb"]
        bs, bo = r["best_stock"], r["best_oases"]
        row = {
            "model": model,
            "cluster": cluster,
            "gpus": gpus,
            "global_batch_size": gbs,
            "layouts": r["layouts_searched"],
            "search_s": round(r["search_s"], 2),
            "winner": w["name"],
            "winner_setting": report_cli.setting(w),
            "winner_s": w["iteration_time_s"],
            "winner_host_bound": w["host_bound"],
            "rule_of_thumb": (
                f"{thumb['name']} {setting_name('off', thumb['recompute'])}" if thumb else None
            ),
            "rule_of_thumb_s": thumb["iteration_time_s"] if thumb else None,
            "launch_flags": r["winner_plan"]["launch_flags"],
            "best_stock": f"{bs['name']} {report_cli.setting(bs)}" if bs else None,
            "best_stock_s": bs["iteration_time_s"] if bs else None,
            "best_stock_launch_flags": bs["stock_launch_flags"] if bs else None,
            "best_oases": f"{bo['name']} {report_cli.setting(bo)}" if bo else None,
            "best_oases_s": bo["iteration_time_s"] if bo else None,
            "stock_over_oases": r["stock_over_oases"],
        }
        rows.append(row)
        print(f"{model} {cluster} x{gpus}: {row['layouts']} layouts in {row['search_s']} s -> "
              f"{row['winner']} {row['winner_setting']}", flush=True)  # fmt: skip
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "search.json"), "w") as f:
        json.dump(provenance.with_provenance({"rows": rows}, prov), f, indent=1)
    lines = [
        "# `oases plan --gpus N`: search time and choice",
        "",
        "`python benchmarks/planner/search.py` (do not edit by hand). Predicted iteration times "
        "of the planner's model (analytic profiles, host term at the profile's host_us_per_call), "
        "not measurements. Search time on this machine (2 CPUs, shared), the model's validation "
        "by Megatron's parser excluded.",
        "",
        "| model | cluster | GPUs | global batch | layouts | search s | winner | setting | "
        "predicted s | rule of thumb | its predicted s | winner's gain |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        gain = r["rule_of_thumb_s"] / r["winner_s"] if r["rule_of_thumb_s"] else None
        lines.append(
            f"| {r['model']} | {r['cluster']} | {r['gpus']} | {r['global_batch_size']} | "
            f"{r['layouts']} | {r['search_s']} | {r['winner']} | {r['winner_setting']}"
            f"{' (host-bound)' if r['winner_host_bound'] else ''} | {r['winner_s']:.3f} | "
            f"{r['rule_of_thumb']} | {r['rule_of_thumb_s']:.3f} | "
            + (f"{gain:.2f}x |" if gain else "|")
        )
    lines += [
        "",
        "## The best stock layout beside the best Oases one",
        "",
        "Stock: Megatron's own schedule at a uniform TP, any layout, recompute setting "
        "(none, selective, selective+ln, full, block) and, where DP > 1, "
        "`--use-distributed-optimizer` (`dist-opt`), torch FSDP2 (`fsdp2`) or a Megatron-FSDP "
        "strategy (`mfsdp-o`, `mfsdp-og`, `mfsdp-ogp`: optim, optim_grads, optim_grads_params); "
        "Oases: an overlapped schedule (also under FSDP2) or per-layer degrees. Ratio: stock's "
        "predicted iteration ÷ Oases' (> 1: Oases wins). FSDP in detail: [fsdp.md](fsdp.md).",
        "",
        "| model | cluster | GPUs | best Oases | predicted s | best stock | predicted s | "
        "stock ÷ Oases | stock's launch line |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        ratio = r["stock_over_oases"]
        lines.append(
            f"| {r['model']} | {r['cluster']} | {r['gpus']} | {r['best_oases']} | "
            + (f"{r['best_oases_s']:.3f}" if r["best_oases_s"] else "-")
            + f" | {r['best_stock']} | "
            + (f"{r['best_stock_s']:.3f}" if r["best_stock_s"] else "-")
            + " | "
            + (f"{ratio:.2f}x" if ratio else "-")
            + f" | `{r['best_stock_launch_flags']}` |"
        )
    with open(os.path.join(args.out, "search.md"), "w") as f:
        f.write(provenance.markdown("\n".join(lines) + "\n", prov))
    provenance.print_summary(prov)
    print(f"wrote {args.out}/search.md")
    return 0


if __name__ == "__main__":
    sys.exit(main())
