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
    else the plan's or the profile's). Where the plan, the profile and the flags describe
    different models or runs, one line naming both values and the fix (a prediction of another
    run is a silent wrong answer); and where the plan's own batch or degrees do not fit the
    profile, a line naming the plan (the planner's messages name the flags of a solve, which the
    user did not pass). The checks run in this order; each raises :class:`OasesConfigError`."""
    fix = _replan_hint(plan, plan_path, profile_path)
    pp = _check_same_model(plan, profile, plan_path, profile_path, fix)
    _check_flags_agree(plan, flags, plan_path)
    run = _resolve(plan, flags, plan_path)
    _check_batch(run, profile.dp, profile_path, fix)
    _check_recompute_layers(run, len(plan["degrees"]) // pp)
    _check_split(run, plan["degrees"], profile.tp, plan_path)
    _check_degrees_fit(run, plan["degrees"], profile.dp, profile.tp, plan_path)
    predicted = plan.get("predicted")
    grad_sync = isinstance(predicted, dict) and bool(predicted.get("grad_sync_included"))
    return PlanSettings(
        global_batch_size=run.gbs,
        micro_batch_size=run.m,
        memory_gb=flags.memory_gb or plan.get("memory_gb") or profile.data.get("memory_gb"),
        schedule=run.schedule,
        recompute=run.recompute,
        recompute_layers=run.layers,
        split=run.split,
        sequence_parallel=run.sequence_parallel,
        distributed_optimizer=bool(plan.get("distributed_optimizer", flags.distributed_optimizer)),
        grad_sync=flags.grad_sync or grad_sync,
        allow_unsplit=run.allow_unsplit,
        margin=flags.margin,
        degrees=sorted(set(plan["degrees"])),
        host_us_per_call=flags.host_us_per_call,
    )


def _replan_hint(plan, path, prof):
    """The fix a plan-versus-profile message ends with."""
    made = plan.get("profile")
    return (
        f"evaluate it with the profile it was made from ({made})"
        if made and made != prof
        else "evaluate it with a profile of the model and parallel sizes it was made for"
    ) + f", or make a plan for this profile with `oases plan --profile {prof} ...`"


def _check_same_model(plan, profile, path, prof, fix):
    """The plan's layers and parallel sizes are the profile's; returns the pipeline size."""
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
    return pp


def _check_flags_agree(plan, flags, path):
    """No flag the user passed contradicts what the plan records."""
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
            flags.recompute,
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


@dataclass(frozen=True)
class _Run:
    """The run's settings, each the plan's or the flags' (``*_src``: which, for messages)."""

    gbs: int
    gbs_src: str
    m: int
    m_src: str
    schedule: str
    recompute: str
    layers: int
    layers_src: str
    split: str
    sequence_parallel: bool
    allow_unsplit: bool


def _resolve(plan, flags, path):
    """Each setting from the plan where it records one, else from the flags (or the default)."""
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
    recompute = recompute_mode(plan.get("recompute", flags.recompute), f"{path}")
    layers, layers_src = flags.recompute_num_layers, "--recompute-num-layers"
    if "recompute_num_layers" in plan:
        layers, layers_src = plan["recompute_num_layers"], f"plan {path}'s recompute_num_layers"
    return _Run(
        gbs=gbs,
        gbs_src=gbs_src,
        m=m,
        m_src=m_src,
        schedule=schedule,
        recompute=recompute,
        layers=layers,
        layers_src=layers_src,
        split=plan.get("split") or flags.split or "batch",
        sequence_parallel=plan.get("sequence_parallel", flags.sequence_parallel),
        allow_unsplit=bool(plan.get("allow_unsplit")) or flags.allow_unsplit,
    )


def _check_batch(run, D, prof, fix):
    """The plan's global batch splits over the profile's data-parallel size, its micro-batch
    divides each TMP domain's share (a flag's value is the planner's to check)."""
    if run.gbs_src != "--global-batch-size" and run.gbs % D:
        raise OasesConfigError(
            f"global batch {run.gbs} ({run.gbs_src}) is not a multiple of the data-parallel size "
            f"{D} of profile {prof}; {fix}"
        )
    per_domain = run.gbs // D if run.gbs > 0 else 0
    if run.m_src != "--micro-batch-size" and per_domain and per_domain % run.m:
        raise OasesConfigError(
            f"micro-batch {run.m} ({run.m_src}) does not divide the {per_domain} samples per TMP "
            f"domain (global batch {run.gbs} from {run.gbs_src} / data-parallel size {D} of "
            f"profile {prof}); {fix}"
        )


def _check_recompute_layers(run, per_stage):
    """A plan's recompute_num_layers is full recompute of 1 to a stage's layers."""
    if run.layers is None or run.layers_src == "--recompute-num-layers":
        return
    if run.recompute != "full" or not 1 <= run.layers <= per_stage:
        raise OasesConfigError(
            f"{run.layers_src} {run.layers} needs full recompute of 1 to {per_stage} layers "
            f"per pipeline stage (the plan records recompute {run.recompute!r}); edit the plan"
        )


def _check_split(run, degrees, T, path):
    """Sequence chunks need a split schedule; chunks and SP run every layer at T."""
    if run.split == "sequence" and run.schedule not in SPLIT_SCHEDULES:
        raise OasesConfigError(
            f"plan {path} splits micro-batches into sequence chunks, which schedule "
            f"{run.schedule} does not; edit its schedule (overlap, cross-pass or oases) or its "
            "split"
        )
    if (run.split == "sequence" or run.sequence_parallel) and set(degrees) != {T}:
        what = "sequence chunks" if run.split == "sequence" else "sequence parallelism"
        raise OasesConfigError(
            f"plan {path} runs {what}, which the runtime runs with every layer at T={T}, but has "
            f"degrees {sorted(set(degrees))}; set every degree to {T} or re-plan"
        )


def _check_degrees_fit(run, degrees, D, T, path):
    """Every layer's groups get a whole share of the micro-batch, two where it is split."""
    per_domain = run.gbs // D if run.gbs > 0 else 0
    micro = run.m or per_domain
    if not micro or per_domain % micro:
        return
    split_in_two = run.schedule in SPLIT_SCHEDULES and run.split != "sequence"
    need = 2 if split_in_two and not run.allow_unsplit else 1
    src = run.m_src if run.m else f"global batch {run.gbs} / data-parallel size {D}, the default"
    for i, d in enumerate(degrees):
        n = micro * d / T
        if n != int(n) or n < need:
            why = ""
            if n == 1 and need == 2:
                why = (
                    f" (schedule {run.schedule} splits it into two sub-batches; the plan does not "
                    "allow unsplit layers)"
                )
            raise OasesConfigError(
                f"plan {path}: layer {i} at degree {d} gets {n:g} samples per group of the "
                f"micro-batch of {micro} ({src}) over T={T}{why}; edit the plan's degrees"
                + (
                    " or pass another --micro-batch-size"
                    if run.m_src == "--micro-batch-size" and run.m
                    else " or micro_batch_size"
                )
                + ", or re-plan"
            )
