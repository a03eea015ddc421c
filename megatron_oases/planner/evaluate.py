"""Re-predict a plan (``oases plan --evaluate``): the run it describes, checked against the
profile and the user's flags, then the planner's prediction of that run.

:func:`evaluate_plan` is the API (benchmarks call it without argparse); :func:`evaluated_run`
holds the plan-versus-profile-versus-flags rules, each a one-line :class:`OasesConfigError`.
"""

import json
from dataclasses import dataclass

from ..errors import OasesConfigError
from ..validation import SPLIT_SCHEDULES
from .api import host_bound_iteration, host_term
from .build import build_problem
from .prediction import predict
from .problem import DEFAULT_MARGIN
from .settings import PlanSettings, recompute_mode


@dataclass(frozen=True)
class EvaluateFlags:
    """What the user passed beside the plan; None (or False): not given, the plan's own value
    (or the default) holds. ``recompute`` is the setting (``"none"`` for ``--no-recompute``, which
    ``no_recompute`` records so that a message names the flag the user typed)."""

    global_batch_size: int = None
    micro_batch_size: int = None
    schedule: str = None
    recompute: str = None
    no_recompute: bool = False
    recompute_num_layers: int = None
    split: str = None
    sequence_parallel: bool = False
    distributed_optimizer: bool = False
    allow_unsplit: bool = False
    grad_sync: bool = False
    memory_gb: float = None
    margin: float = DEFAULT_MARGIN
    host_us_per_call: float = None


def evaluate_plan(plan, profile, flags=EvaluateFlags(), plan_path="plan", profile_path="profile"):
    """Predict the run ``plan`` describes on ``profile`` (a :class:`Profile`).

    Returns ``run`` (:func:`evaluated_run`: a :class:`~.settings.PlanSettings`), ``problem``
    (pipeline stage 0), ``ks`` (the plan's degree indices), ``prediction`` (:func:`predict`),
    ``host`` (the host term or None), ``device_time_s``, ``iteration_time_s`` (the larger of
    device and host issue time) and ``fits`` (peak memory with the margin within the memory)."""
    run = evaluated_run(plan, profile, flags, plan_path, profile_path)
    problem = build_problem(profile, run, num_layers=len(plan["degrees"]))
    ks = problem.index(plan["degrees"][: problem.num_layers])
    res = predict(profile, plan["degrees"], settings=run)
    host = host_term(profile, problem, run.host_us_per_call)
    device_s = res["iteration_time_s"]
    return dict(
        run=run,
        problem=problem,
        ks=ks,
        prediction=res,
        host=host,
        device_time_s=device_s,
        iteration_time_s=host_bound_iteration(device_s, host),
        fits=res["peak_memory_bytes"] * (1 + problem.margin) <= problem.memory_bytes,
    )


def evaluated_run(plan, profile, flags, plan_path="plan", profile_path="profile"):
    """The run that ``--evaluate`` predicts, as a :class:`~.settings.PlanSettings`: the plan's
    settings, the flags' where the plan records none (memory, margin and host cost: the flags',
    else the plan's or the profile's). Where the plan, the profile and the flags describe different models or runs, one
    line naming both values and the fix (a prediction of another run is a silent wrong answer);
    and where the plan's own batch or degrees do not fit the profile, a line naming the plan
    (the planner's messages name the flags of a solve, which the user did not pass)."""
    path, prof = plan_path, profile_path
    made = plan.get("profile")
    fix = (
        f"evaluate it with the profile it was made from ({made})"
        if made and made != prof
        else "evaluate it with a profile of the model and parallel sizes it was made for"
    ) + f", or make a plan for this profile with `oases plan --profile {prof} ...`"
    degrees, T = plan["degrees"], profile.tp
    if len(degrees) != profile.num_layers:
        raise OasesConfigError(
            f"plan {path} has {len(degrees)} layer degrees but profile {prof} is of a "
            f"{profile.num_layers}-layer model; {fix}"
        )
    pp = int(profile.data.get("pipeline_model_parallel_size", 1))
    for key, ours, what in (
        ("tensor_model_parallel_size", T, "TMP domain T"),
        ("data_parallel_size", profile.dp, "data-parallel size"),
        ("pipeline_model_parallel_size", pp, "pipeline-parallel size"),
    ):
        if plan.get(key) is not None and plan[key] != ours:
            raise OasesConfigError(
                f"plan {path} is for a {what} of {plan[key]} but profile {prof} has {ours}; {fix}"
            )
    recompute_flag = flags.recompute
    given = (  # (plan key, the flag's value in the plan's terms or None: not given, the flag)
        (
            "global_batch_size",
            flags.global_batch_size,
            f"--global-batch-size {flags.global_batch_size}",
        ),
        (
            "micro_batch_size",
            flags.micro_batch_size,
            f"--micro-batch-size {flags.micro_batch_size}",
        ),
        ("schedule", flags.schedule, f"--schedule {flags.schedule}"),
        (
            "recompute",
            recompute_flag,
            "--no-recompute" if flags.no_recompute else f"--recompute {flags.recompute}",
        ),
        (
            "recompute_num_layers",
            flags.recompute_num_layers,
            f"--recompute-num-layers {flags.recompute_num_layers}",
        ),
        ("split", flags.split, f"--split {flags.split}"),
        ("sequence_parallel", flags.sequence_parallel or None, "--sequence-parallel"),
        ("distributed_optimizer", flags.distributed_optimizer or None, "--distributed-optimizer"),
    )
    for key, value, flag in given:
        # a null recompute_num_layers is a setting (every layer); other nulls: not recorded
        recorded = key in plan if key == "recompute_num_layers" else plan.get(key) is not None
        if value is None or not recorded:
            continue
        theirs = recompute_mode(plan[key], str(path)) if key == "recompute" else plan[key]
        if theirs != value:
            raise OasesConfigError(
                f"{flag} contradicts plan {path}, made for {key} {json.dumps(plan[key])}; drop "
                f"the flag to evaluate the plan as made, or re-plan with {flag}"
            )
    gbs, gbs_src = flags.global_batch_size, "--global-batch-size"
    if gbs is None:
        gbs, gbs_src = plan.get("global_batch_size"), f"plan {path}'s global_batch_size"
    if gbs is None:
        raise OasesConfigError("pass --global-batch-size (the plan does not record one)")
    m, m_src = flags.micro_batch_size, "--micro-batch-size"
    if m is None and plan.get("micro_batch_size") is not None:
        m, m_src = plan["micro_batch_size"], f"plan {path}'s micro_batch_size"
    schedule = plan.get("schedule") or flags.schedule or "oases"
    if schedule == "auto":
        raise OasesConfigError(
            f"--evaluate predicts one schedule and plan {path} records none; pass --schedule "
            "off, overlap, cross-pass or oases"
        )
    recompute = recompute_mode(plan.get("recompute", recompute_flag), f"{path}")
    layers_src = "--recompute-num-layers"
    layers = flags.recompute_num_layers
    if "recompute_num_layers" in plan:
        layers, layers_src = plan["recompute_num_layers"], f"plan {path}'s recompute_num_layers"
    split = plan.get("split") or flags.split or "batch"
    sequence_parallel = plan.get("sequence_parallel", flags.sequence_parallel)
    allow_unsplit = bool(plan.get("allow_unsplit")) or flags.allow_unsplit
    D = profile.dp
    if gbs_src != "--global-batch-size" and gbs % D:
        raise OasesConfigError(
            f"global batch {gbs} ({gbs_src}) is not a multiple of the data-parallel size {D} of "
            f"profile {prof}; {fix}"
        )
    per_domain = gbs // D if gbs > 0 else 0
    if m_src != "--micro-batch-size" and per_domain and per_domain % m:
        raise OasesConfigError(
            f"micro-batch {m} ({m_src}) does not divide the {per_domain} samples per TMP domain "
            f"(global batch {gbs} from {gbs_src} / data-parallel size {D} of profile {prof}); "
            f"{fix}"
        )
    if layers is not None and layers_src != "--recompute-num-layers":
        if recompute != "full" or not 1 <= layers <= len(degrees) // pp:
            raise OasesConfigError(
                f"{layers_src} {layers} needs full recompute of 1 to {len(degrees) // pp} layers "
                f"per pipeline stage (the plan records recompute {recompute!r}); edit the plan"
            )
    if split == "sequence" and schedule not in SPLIT_SCHEDULES:
        raise OasesConfigError(
            f"plan {path} splits micro-batches into sequence chunks, which schedule {schedule} "
            "does not; edit its schedule (overlap, cross-pass or oases) or its split"
        )
    if (split == "sequence" or sequence_parallel) and set(degrees) != {T}:
        what = "sequence chunks" if split == "sequence" else "sequence parallelism"
        raise OasesConfigError(
            f"plan {path} runs {what}, which the runtime runs with every layer at T={T}, but has "
            f"degrees {sorted(set(degrees))}; set every degree to {T} or re-plan"
        )
    micro = m or per_domain
    if micro and per_domain % micro == 0:
        need = 2 if schedule in SPLIT_SCHEDULES and split != "sequence" and not allow_unsplit else 1
        src = m_src if m else f"global batch {gbs} / data-parallel size {D}, the default"
        for i, d in enumerate(degrees):
            n = micro * d / T
            if n != int(n) or n < need:
                why = ""
                if n == 1 and need == 2:
                    why = (
                        f" (schedule {schedule} splits it into two sub-batches; the plan does not "
                        "allow unsplit layers)"
                    )
                raise OasesConfigError(
                    f"plan {path}: layer {i} at degree {d} gets {n:g} samples per group of the "
                    f"micro-batch of {micro} ({src}) over T={T}{why}; edit the plan's degrees"
                    + (
                        " or pass another --micro-batch-size"
                        if m_src == "--micro-batch-size" and m
                        else " or micro_batch_size"
                    )
                    + ", or re-plan"
                )
    predicted = plan.get("predicted")
    grad_sync = isinstance(predicted, dict) and bool(predicted.get("grad_sync_included"))
    return PlanSettings(
        global_batch_size=gbs,
        micro_batch_size=m,
        memory_gb=flags.memory_gb or plan.get("memory_gb") or profile.data.get("memory_gb"),
        schedule=schedule,
        recompute=recompute,
        recompute_layers=layers,
        split=split,
        sequence_parallel=sequence_parallel,
        distributed_optimizer=bool(plan.get("distributed_optimizer", flags.distributed_optimizer)),
        grad_sync=flags.grad_sync or grad_sync,
        allow_unsplit=allow_unsplit,
        margin=flags.margin,
        degrees=sorted(set(degrees)),
        host_us_per_call=flags.host_us_per_call,
    )
