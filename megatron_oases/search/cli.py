"""``oases plan --gpus N``: the cluster search's part of the command line (:mod:`.search`,
:mod:`.verify`)."""

import json
import sys

from ..errors import OasesConfigError
from ..outputs import check_output_file, make_parent

#: The most GPUs ``--gpus`` takes: far beyond today's clusters (the layouts searched grow with it).
MAX_GPUS = 1 << 16


def add_search_flags(p):
    """The search's flags, a group of ``oases plan``'s parser ``p``."""
    search = p.add_argument_group(
        "the cluster search (--gpus): DP x TP x PP, micro-batch and setting, from a model and a "
        "cluster profile instead of --profile"
    )
    search.add_argument(
        "--gpus",
        type=int,
        default=None,
        metavar="N",
        help="search every TP x PP x DP layout of N GPUs (at most 65536) and micro-batch size, "
        "each with every schedule and recompute setting; prints the ranked candidates and the "
        "winner's launch line (--out writes its plan)",
    )
    search.add_argument(
        "--cluster",
        default=None,
        help="with --gpus: a packaged cluster profile (a100-nvlink, h100-nvlink, rtx3090-nvlink, "
        "rtx3090-pcie, rtx4090-pcie) or a YAML path",
    )
    search.add_argument(
        "--model",
        default=None,
        metavar="PATH[:NAME]",
        help="with --gpus: model YAML or a packaged model (e.g. gpt-6.7b, h2048-l24)",
    )
    search.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="with --gpus: override a model setting, e.g. --set num_layers=48",
    )
    search.add_argument(
        "--verify-top",
        type=int,
        default=None,
        metavar="K",
        help="with --gpus: run the K fastest candidates on this host under the emulator "
        "(--emulate-link CLUSTER, N ranks, mock data) and print predicted against measured "
        "and their rank correlation; the runs' logs go next to --out (PLAN-verify/) or to a "
        "temporary directory. An emulation, not GPUs",
    )
    search.add_argument(
        "--top",
        type=int,
        default=5,
        help="with --gpus: how many of the fastest layouts are planned in full (default 5)",
    )


def run_with_line(plan, out=None):
    """``run with: FLAGS``, plus ``--oases-plan`` where a layer runs below the layout's TP (the
    runtime reads those degrees from the plan file; the flags alone would run stock)."""
    from ..formats.plan import needs_plan_file

    hint = ""
    if needs_plan_file(plan):
        hint = f" --oases-plan {out or 'PLAN_JSON (write it with --out)'}"
    return f"run with: {plan['launch_flags']}{hint}"


def fsdp2_notes(result):
    """Where the winner or the best stock layout runs torch FSDP2 and this Megatron cannot save
    and resume such a run: one line saying so (:func:`.platform.fsdp2_checkpoint.gap`)."""
    rows = [result["candidates"][0], result.get("best_stock")]
    if not any(r and r.get("data_parallel_sharding") == "torch_fsdp2" for r in rows):
        return []
    from ..platform.fsdp2_checkpoint import gap

    why = gap()
    return [f"torch FSDP2 trains here, but {why}"] if why else []


def search_main(args):
    """``--gpus N``: the cluster-wide search (:mod:`.search`)."""
    from ..formats.plan import save_plan
    from ..profiler.model_config import read_model_file, set_overrides
    from .search import model_for_search, search, table, verdict, why_first

    given = [f for f, v in (("--profile", args.profile), ("--evaluate", args.evaluate)) if v]
    if given:
        raise OasesConfigError(
            f"--gpus searches from --model and --cluster; drop {' and '.join(given)}"
        )
    missing = [f for f, v in (("--cluster", args.cluster), ("--model", args.model)) if not v]
    if missing:
        raise OasesConfigError(f"--gpus needs {' and '.join(missing)} (e.g. --cluster "
                               "rtx3090-pcie --model gpt-6.7b)")  # fmt: skip
    if args.gpus < 1 or args.top < 1 or (args.verify_top is not None and args.verify_top < 1):
        raise OasesConfigError("--gpus, --top and --verify-top must be ≥ 1")
    if args.gpus > MAX_GPUS:
        raise OasesConfigError(f"--gpus must be at most {MAX_GPUS}, got {args.gpus}")
    if args.global_batch_size is None:
        raise OasesConfigError("--global-batch-size is required")
    if args.out:
        check_output_file(args.out, example="plan.json")
    fixed = [f for f, v in (("--schedule", args.schedule), ("--degrees", args.degrees),
                            ("--micro-batch-size", args.micro_batch_size),
                            ("--data-parallel-sharding", args.data_parallel_sharding))
             if v]  # fmt: skip
    if fixed:
        raise OasesConfigError(f"--gpus chooses {', '.join(fixed)} itself; drop them")
    from ..testbed.clusters import load_cluster

    load_cluster(args.cluster)  # a bad name: one line before the model is validated
    flat = {**read_model_file(args.model), **set_overrides(args.set)}  # the model --verify-top runs
    margs = model_for_search(flat, args.global_batch_size)
    result = search(
        margs,
        args.cluster,
        args.gpus,
        args.global_batch_size,
        memory_gb=args.memory,
        top=args.top,
        host_us_per_call=args.host_us_per_call,
        progress=lambda line: print(f"oases plan: {line}", file=sys.stderr, flush=True),
    )
    print(
        f"{result['layouts_searched']} layouts of {args.gpus} GPUs on {args.cluster} searched in "
        f"{result['search_s']:.1f} s (the {args.top} fastest planned in full: level 2)"
    )
    print("\n".join(table(result, rows=args.max_rows or len(result["candidates"]))))
    print(f"\nwhy: {why_first(result)}")
    print("\n".join(verdict(result)))
    plan = result["winner_plan"]
    print(run_with_line(plan, args.out))
    for note in result["notes"] + fsdp2_notes(result):
        print(f"note: {note}")
    if args.verify_top:
        import os
        import tempfile

        from .verify import verify, verify_table

        where = (
            os.path.splitext(args.out)[0] + "-verify"
            if args.out
            else tempfile.mkdtemp(prefix="oases-verify-")
        )
        print(f"\nverifying the {args.verify_top} fastest under the emulator (runs in {where})")
        checked = verify(
            result,
            flat,
            where,
            args.verify_top,
            progress=lambda line: print(f"oases plan: {line}", file=sys.stderr, flush=True),
        )
        print("\n".join(verify_table(checked)))
        result["verified"] = checked
    if args.out:
        plan["search"] = {k: result[k] for k in ("gpus", "cluster", "memory_gb", "candidates")}
        if "verified" in result:
            plan["search"]["verified"] = result["verified"]
        plan["search"]["rule_of_thumb"] = result["rule_of_thumb"]
        for key in ("best_stock", "best_oases", "stock_over_oases"):  # formats/plan.py
            plan[key] = result[key]
        make_parent(args.out)
        save_plan(plan, args.out)
        print(f"wrote {args.out}")
    if args.json:
        print(json.dumps(result, indent=1, default=str))
    return 0
