"""Re-predict a plan (``oases plan --evaluate``): the run it describes, checked against the
profile and the user's flags, then the planner's prediction of that run.

:func:`evaluate_plan` is the API; :func:`evaluated_run` holds the plan-versus-profile rules, each
a one-line :class:`OasesConfigError` (the plan-versus-flags ones are
:meth:`~.settings.PlanSettings.from_plan`'s).
"""

from dataclasses import replace

from ..errors import OasesConfigError
from ..formats.plan import MODEL_SHAPE, shape_differences
from ..validation import SPLIT_SCHEDULES, samples_per_group
from .api import host_bound_iteration, host_term
from .build import build_problem
from .prediction import predict
from .settings import PlanSettings


def evaluate_plan(plan, profile, args=None, plan_path="plan", profile_path="profile"):
    """Predict the run ``plan`` describes on ``profile`` (a :class:`Profile`), with ``args``
    (``oases plan``'s flags beside ``--evaluate``, or any object with some of their names; None:
    none).

    Returns ``run`` (:func:`evaluated_run`: a :class:`~.settings.PlanSettings`), ``problem``
    (pipeline stage 0), ``ks`` (the plan's degree indices), ``prediction`` (:func:`predict`),
    ``host`` (the host term or None), ``device_time_s``, ``iteration_time_s`` (the larger of
    device and host issue time) and ``fits`` (peak memory with the margin within the memory)."""
    run = evaluated_run(plan, profile, args, plan_path, profile_path)
    problem = build_problem(profile, run, num_layers=len(plan["degrees"]))
    ks = problem.index(plan["degrees"][: problem.num_layers])
    res = predict(profile, plan["degrees"], run)
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


def evaluated_run(plan, profile, args=None, plan_path="plan", profile_path="profile"):
    """The run that ``--evaluate`` predicts: :meth:`~.settings.PlanSettings.from_plan` of the
    plan and the flags, the memory the profile's where neither gives one. Where the plan and the
    profile describe different models or runs, one line naming both values and the fix (a
    prediction of another run is a silent wrong answer); and where the plan's own batch or
    degrees do not fit the profile, a line naming the plan (the planner's messages name the flags
    of a solve, which the user did not pass). The checks run in this order; each raises
    :class:`OasesConfigError`."""
    fix = _replan_hint(plan, plan_path, profile_path)
    run = PlanSettings.from_plan(plan, args, plan_path)
    pp = _check_same_model(run, plan["degrees"], profile, plan_path, profile_path, fix)
    _check_same_shape(plan, profile, plan_path, profile_path, fix)
    if run.global_batch_size is None:
        raise OasesConfigError("pass --global-batch-size (the plan does not record one)")
    _check_batch(run, profile.dp, profile_path, fix)
    _check_recompute_layers(run, len(plan["degrees"]) // pp)
    _check_split(run, plan["degrees"], profile.tp, plan_path)
    _check_degrees_fit(run, plan["degrees"], profile.dp, profile.tp, plan_path)
    if run.memory_gb is None and profile.data.get("memory_gb"):
        run = replace(run, memory_gb=profile.data["memory_gb"])
    return run


def _replan_hint(plan, path, prof):
    """The fix a plan-versus-profile message ends with."""
    made = plan.get("profile")
    return (
        f"evaluate it with the profile it was made from ({made})"
        if made and made != prof
        else "evaluate it with a profile of the model and parallel sizes it was made for"
    ) + f", or make a plan for this profile with `oases plan --profile {prof} ...`"


def _check_same_model(run, degrees, profile, path, prof, fix):
    """The plan's layers and parallel sizes are the profile's; returns the pipeline size."""
    T = profile.tp
    if len(degrees) != profile.num_layers:
        raise OasesConfigError(
            f"plan {path} has {len(degrees)} layer degrees but profile {prof} is of a "
            f"{profile.num_layers}-layer model; {fix}"
        )
    pp = int(profile.data.get("pipeline_model_parallel_size", 1))
    for name, ours, what in (
        ("tensor_model_parallel_size", T, "TMP domain T"),
        ("data_parallel_size", profile.dp, "data-parallel size"),
        ("pipeline_model_parallel_size", pp, "pipeline-parallel size"),
    ):
        theirs = getattr(run, name)
        if theirs is not None and theirs != ours:
            raise OasesConfigError(
                f"plan {path} is for a {what} of {theirs} but profile {prof} has {ours}; {fix}"
            )
    return pp


def _check_same_shape(plan, profile, path, prof, fix):
    """The model the plan records (``model_shape``; older plans record none) is the profile's:
    a prediction on another model's profile would describe another run."""
    differ = shape_differences(plan, profile.shape)
    if differ:
        theirs = ", ".join(f"{MODEL_SHAPE[key]} {planned}" for key, planned, _ in differ)
        ours = ", ".join(f"{MODEL_SHAPE[key]} {value}" for key, _, value in differ)
        raise OasesConfigError(
            f"plan {path} was made for a model of {theirs} but profile {prof} is of {ours}; {fix}"
        )


def _check_batch(run, D, prof, fix):
    """The plan's global batch splits over the profile's data-parallel size, its micro-batch
    divides each TMP domain's share (a flag's value is the planner's to check)."""
    gbs, m = run.global_batch_size, run.micro_batch_size
    if run.recorded("global_batch_size") and gbs % D:
        raise OasesConfigError(
            f"global batch {gbs} ({run.source('global_batch_size')}) is not a multiple of the "
            f"data-parallel size {D} of profile {prof}; {fix}"
        )
    per_domain = gbs // D
    if run.recorded("micro_batch_size") and per_domain and per_domain % m:
        raise OasesConfigError(
            f"micro-batch {m} ({run.source('micro_batch_size')}) does not divide the "
            f"{per_domain} samples per TMP domain (global batch {gbs} from "
            f"{run.source('global_batch_size')} / data-parallel size {D} of profile {prof}); {fix}"
        )


def _check_recompute_layers(run, per_stage):
    """A plan's recompute_num_layers is full recompute of 1 to a stage's layers."""
    layers = run.recompute_layers
    if layers is None or not run.recorded("recompute_layers"):
        return
    if run.recompute != "full" or not 1 <= layers <= per_stage:
        raise OasesConfigError(
            f"{run.source('recompute_layers')} {layers} needs full recompute of 1 to "
            f"{per_stage} layers per pipeline stage (the plan records recompute "
            f"{run.recompute!r}); edit the plan"
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
    gbs, m = run.global_batch_size, run.micro_batch_size
    per_domain = gbs // D
    micro = m or per_domain
    if not micro or per_domain % micro:
        return
    split_in_two = run.schedule in SPLIT_SCHEDULES and run.split != "sequence"
    need = 2 if split_in_two and not run.allow_unsplit else 1
    src = (
        run.source("micro_batch_size")
        if m
        else f"global batch {gbs} / data-parallel size {D}, the default"
    )
    for i, d in enumerate(degrees):
        n = samples_per_group(micro, d, T)
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
                    " or micro_batch_size"
                    if run.recorded("micro_batch_size") or not m
                    else " or pass another --micro-batch-size"
                )
                + ", or re-plan"
            )
