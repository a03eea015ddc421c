"""``oases plan``: choose a TMP degree per layer from a profile (Oases §4), write an editable plan.

oases plan --profile profile.json --global-batch-size 128 --memory 24 --out plan.json
oases plan ... --degrees 2,4 --pin 0-3=4 --max-switches 1 --verify
oases plan ... --schedule overlap --recompute selective    # or --schedule auto: pick the setting
oases plan ... --schedule oases --recompute-num-layers 20  # recompute only the first 20 layers
oases plan --profile profile.json --evaluate plan.json     # re-predict an (edited) plan
oases plan --profile sp-profile.json --global-batch-size 128 --sequence-parallel  # uniform T
oases plan --gpus 8 --cluster rtx3090-pcie --model gpt-6.7b --global-batch-size 64  # DP x TP x PP
oases plan ... --micro-batch-size 1 --schedule overlap --split sequence   # chunks, uniform T
"""

import argparse
import json
import math
import sys

from ..errors import OasesConfigError
from ..formats.plan import DATA_PARALLEL_SHARDINGS
from ..outputs import check_output_file, make_parent
from ..planner.ilp import DEFAULT_TIME_LIMIT_S
from ..planner.problem import DEFAULT_MARGIN
from ..planner.settings import AUTO, PlanSettings, recompute_label
from ..recompute_settings import RECOMPUTE_MODES
from ..validation import SCHEDULES, SPLITS
from .cli import add_search_flags

#: The longest ``--time-limit`` (a day): a bound, not a suggestion.
MAX_TIME_LIMIT_S = 86400.0


def build_parser():
    p = argparse.ArgumentParser(
        prog="oases plan",
        description="Plan one TMP degree per transformer layer with the Oases overlap-aware cost "
        "model (eq. 3–6): ILP (PuLP/CBC) or exact DP; writes an editable JSON plan.",
    )
    p.add_argument(
        "--profile", default=None, help="profile.json from `oases profile` (not with --gpus)"
    )
    add_search_flags(p)
    _add_run_flags(p.add_argument_group("the run to plan for"))
    _add_solve_flags(p.add_argument_group("the solve"))
    _add_output_flags(p.add_argument_group("what to print and write"))
    return p


def _add_run_flags(g):
    """Batch, memory, schedule, recompute and split: the Megatron run the plan is for."""
    g.add_argument(
        "--global-batch-size", type=int, help="global batch (required unless --evaluate)"
    )
    g.add_argument(
        "--micro-batch-size",
        type=int,
        default=None,
        help="per TMP domain; default: global batch / DP (no accumulation)",
    )
    g.add_argument(
        "--memory",
        type=float,
        default=None,
        metavar="GB",
        help="device memory per rank in GB (1e9 bytes); default: the profile's cluster",
    )
    g.add_argument(
        "--schedule",
        choices=SCHEDULES + ("auto",),
        default=None,
        help="the schedule to plan for (default oases; with --evaluate: the plan's); auto: plan "
        "stock Megatron and every Oases schedule with "
        "each recompute setting it supports (none, selective, selective+ln and full for off and "
        "overlap; full "
        "for cross-pass and oases) and keep the fastest that fits --memory (the plan's "
        "launch_flags say how to run it)",
    )
    g.add_argument(
        "--recompute",
        choices=RECOMPUTE_MODES,
        default=None,
        help="Megatron's recompute setting (default full): none keeps every activation; "
        "selective recomputes core attention (--recompute-granularity selective "
        "--recompute-modules core_attn; off/overlap); selective+ln also the two norms' outputs "
        "(--recompute-modules core_attn layernorm); full recomputes each layer",
    )
    g.add_argument(
        "--recompute-num-layers",
        type=int,
        default=None,
        metavar="N",
        help="with --recompute full: recompute only each pipeline stage's first N layers, the "
        "others keep their activations (Megatron's --recompute-method block "
        "--recompute-num-layers N); --schedule auto tries every N that fits itself",
    )
    g.add_argument(
        "--no-recompute",
        action="store_true",
        help="the same as --recompute none",
    )
    g.add_argument(
        "--grad-sync",
        action="store_true",
        help="add each layer's exposed data-parallel gradient all-reduce (params/d over "
        "D·T/d replicas) to the objective; not in the paper's eq. 5; analytic profiles",
    )
    g.add_argument(
        "--distributed-optimizer",
        action="store_true",
        help="memory model: Adam state sharded over each layer's data-parallel replicas "
        "(Megatron --use-distributed-optimizer)",
    )
    g.add_argument(
        "--data-parallel-sharding",
        choices=DATA_PARALLEL_SHARDINGS,
        default=None,
        help="sharded data parallelism (needs DP > 1 and an analytic profile): torch_fsdp2 "
        "(--use-torch-fsdp2; no PP, untied embeddings; also under the split schedules) or a "
        "Megatron-FSDP strategy (--use-megatron-fsdp --data-parallel-sharding-strategy ...; "
        "no PP; also under the split schedules): the state each shards, its gathered units and its all-gathers "
        "and reduce-scatters (those once per iteration with --grad-sync, as the DP all-reduce); "
        "every layer at T (the runtime runs FSDP with uniform TMP only)",
    )
    g.add_argument(
        "--sequence-parallel",
        action="store_true",
        help="Megatron's --sequence-parallel: all-gathers/reduce-scatters instead of all-reduces "
        "and s/T activations. The runtime supports it with uniform TMP only, so every layer is "
        "planned at T and the result is that plan's prediction (time, memory, fits); needs a "
        "profile made with `oases profile --sequence-parallel`",
    )
    g.add_argument(
        "--split",
        choices=SPLITS,
        default=None,
        help="how the overlapped schedules cut a micro-batch into two sub-batches (the runtime's "
        "--oases-split): batch (samples; the default) or sequence (the first and second half of "
        "every sample's tokens, so a micro-batch of one sample splits too; every layer at T, "
        "as the runtime runs chunks with uniform TMP only). --schedule auto plans both unless "
        "this is given",
    )
    g.add_argument(
        "--allow-unsplit",
        action="store_true",
        help="allow degrees whose group gets 1 sample per micro-batch (no sub-batch "
        "overlap for those layers; the runtime must support it)",
    )


def _add_solve_flags(g):
    """Degrees, pins, solver, memory margin and host term: how the plan is solved."""
    g.add_argument("--degrees", default=None, help="candidate degrees, e.g. 1,2,4 (default: all)")
    g.add_argument(
        "--pin",
        action="append",
        default=[],
        metavar="LAYERS=DEGREE",
        help="fix layers to a degree, e.g. 0-3=4 (repeatable, or comma list)",
    )
    g.add_argument(
        "--max-switches",
        type=int,
        default=None,
        help="at most K degree changes along the layer chain",
    )
    g.add_argument(
        "--solver",
        choices=("dp", "ilp"),
        default="dp",
        help="dp: exact dynamic program over the layer chain (default, fast); ilp: eq. 5–6 "
        "in PuLP/CBC (slow on large memory-bound instances; see --time-limit)",
    )
    g.add_argument(
        "--verify",
        action="store_true",
        help="run both the ILP and the DP; fail unless their objectives agree",
    )
    g.add_argument(
        "--margin",
        type=float,
        default=DEFAULT_MARGIN,
        help=f"memory safety margin (default {DEFAULT_MARGIN:.2f} = predicted × 1.10)",
    )
    g.add_argument(
        "--granule-mb",
        type=float,
        default=1.0,
        help="memory discretisation in MiB (rounded up; default 1)",
    )
    g.add_argument(
        "--time-limit", type=float, default=DEFAULT_TIME_LIMIT_S, help="ILP time limit in seconds"
    )
    g.add_argument(
        "--host-us-per-call",
        type=float,
        default=None,
        metavar="US",
        help="the host's issue cost per aten call in microseconds: the iteration is the longer of "
        "the device's and the host's timelines (default: the analytic profile's cluster's "
        "host_us_per_call; none for a measured profile; 0 = no host term)",
    )


def _add_output_flags(g):
    """Where the plan goes (or which plan ``--evaluate`` predicts) and what is printed."""
    g.add_argument("--out", default=None, help="write the plan JSON here")
    g.add_argument(
        "--evaluate",
        default=None,
        metavar="PLAN",
        help="predict an existing plan file instead of solving",
    )
    g.add_argument(
        "--max-rows",
        type=int,
        default=40,
        help="explanation rows (layers near degree changes are kept); 0 = all",
    )
    g.add_argument("--quiet", action="store_true", help="no table, only the summary")
    g.add_argument("--json", action="store_true", help="print the plan JSON to stdout")


def _evaluate(args):
    """``--evaluate PLAN``: print :func:`..planner.evaluate.evaluate_plan`'s prediction."""
    from ..formats.plan import load_plan
    from ..formats.profile import load_profile
    from ..planner.evaluate import evaluate_plan
    from ..planner.explain import compress_degrees, explanation_table, host_line

    plan = load_plan(args.evaluate)
    out = evaluate_plan(plan, load_profile(args.profile), args, args.evaluate, args.profile)
    run, problem, res, host = out["run"], out["problem"], out["prediction"], out["host"]
    device_s, iteration_s = out["device_time_s"], out["iteration_time_s"]
    sp = ", sequence parallel" if run.sequence_parallel else ""
    sp += ", sequence chunks" if run.split == "sequence" else ""
    print(
        f"plan {args.evaluate}: {compress_degrees(plan['degrees'])} (schedule {run.schedule}, "
        f"{recompute_label(run.recompute, run.recompute_layers)} recompute{sp})"
    )
    print(
        f"predicted iteration {iteration_s * 1e3:.2f} ms (device {device_s * 1e3:.2f}: forward "
        f"{res['forward_s'] * 1e3:.2f}, backward {res['backward_s'] * 1e3:.2f}, re-shard "
        f"{res['edges_s'] * 1e3:.2f}); peak memory {res['peak_memory_bytes'] / 1e9:.2f} GB per rank"
    )
    print(host_line(dict(host=host, device_time_s=device_s, iteration_time_s=iteration_s)))
    if not out["fits"]:
        print(
            f"warning: needs more than {problem.memory_bytes / 1e9:g} GB with the "
            f"{problem.margin:.0%} margin",
            file=sys.stderr,
        )
    if not args.quiet:
        print(explanation_table(problem, out["ks"], res, max_rows=args.max_rows or None))
    if args.json:
        js = {k: v for k, v in res.items() if k != "per_layer"}
        js.update(iteration_time_s=iteration_s, device_time_s=device_s, host=host)
        print(json.dumps(js, indent=1))
    return 0


def _check_solve_flags(args):
    """The flags that are no :class:`PlanSettings` field: one line each, before any work."""
    if not (math.isfinite(args.time_limit) and 0 < args.time_limit <= MAX_TIME_LIMIT_S):
        raise OasesConfigError(
            f"--time-limit must be positive and finite, at most {MAX_TIME_LIMIT_S:g} s, got "
            f"{args.time_limit!r}"
        )
    if args.max_rows < 0:
        raise OasesConfigError(f"--max-rows must be ≥ 0 (0: all), got {args.max_rows}")


def main(argv):
    args = build_parser().parse_args(argv)
    _check_solve_flags(args)
    if args.gpus is not None:
        from .cli import search_main

        return search_main(args)
    search_only = [f for f, v in (("--cluster", args.cluster), ("--model", args.model),
                                  ("--set", args.set), ("--verify-top", args.verify_top)) if v]  # fmt: skip
    if search_only:
        raise OasesConfigError(f"{', '.join(search_only)}: only with --gpus N (the cluster search)")
    if args.profile is None:
        raise OasesConfigError(
            "pass --profile PROFILE_JSON (from `oases profile`), or --gpus N --cluster C "
            "--model M to search the cluster"
        )
    if args.evaluate:
        if args.out:
            raise OasesConfigError(
                "--evaluate re-predicts PLAN and writes nothing; drop --out (edit the plan file "
                "itself, or plan anew with --out)"
            )
        return _evaluate(args)
    if args.out:  # before the solve: a plan must not be lost to a path it cannot be written to
        check_output_file(args.out, example="plan.json")
    settings = PlanSettings.from_args(args)
    from ..formats.plan import save_plan
    from ..planner.api import PlannerVerificationError, make_plan
    from ..planner.choose import alternatives_table, choose_plan
    from ..planner.explain import explanation_table, summary

    plan_with = choose_plan if settings.schedule == AUTO else make_plan
    try:
        plan, problem, sol = plan_with(
            args.profile,
            settings,
            solver=args.solver,
            verify=args.verify,
            time_limit_s=args.time_limit,
        )
    except PlannerVerificationError as exc:
        print(f"oases plan: error: {exc}", file=sys.stderr)
        return 1
    if not args.quiet:
        print(explanation_table(problem, sol.ks, max_rows=args.max_rows or None))
        print()
    print(summary(plan))
    if "alternatives" in plan:
        print("\n".join(["", *alternatives_table(plan), f"run with: {plan['launch_flags']}"]))
    if args.out:
        make_parent(args.out)
        save_plan(plan, args.out)
        print(f"wrote {args.out}")
    if args.json:
        print(json.dumps(plan, indent=1))
    return 0
