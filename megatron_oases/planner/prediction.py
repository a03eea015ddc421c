"""Predicted iteration time and memory of a given per-layer degree list (no solving).

Builds one :class:`~.problem.ChainProblem` per pipeline stage, times it with the time model and
explains its peak memory; what ``oases predict``, the validation benchmark and the tests compare
against measurements. Kept apart from :mod:`.build` because it is an entry point over the whole
model (all stages), while the builder costs one stage.
"""

from dataclasses import replace

from ..errors import OasesConfigError
from .build import build_problem
from .memory_model import memory_breakdown
from .time_model import evaluate


def predict(profile, degrees, settings):
    """Predicted iteration of a per-layer degree list under ``settings``
    (:class:`~.settings.PlanSettings`).

    Returns ``{iteration_time_s, forward_s, backward_s, edges_s, peak_memory_bytes, per_layer,
    memory_breakdown_bytes}`` (seconds per iteration; bytes per rank *without* the safety margin;
    the breakdown separates parameter/optimizer state from saved activations, the worst layer's
    backward working set, logits and framework overhead). ``profile`` is a Profile or a path.
    With pipeline parallelism ``degrees`` covers every layer; each stage's slice is costed on its
    own (times of the slowest stage, memory of the fullest, and ``stages``: both per stage).
    """
    from ..formats.profile import Profile, load_profile

    if not isinstance(profile, Profile):
        profile = load_profile(profile)
    degrees = [int(d) for d in degrees]
    pp = int(profile.data.get("pipeline_model_parallel_size", 1))
    if len(degrees) % pp:
        raise OasesConfigError(
            f"{len(degrees)} layer degrees do not split evenly over {pp} pipeline stages"
        )
    per_stage = len(degrees) // pp
    stage_settings = replace(settings, degrees=sorted(set(degrees)))
    stages = []
    for stage in range(pp):
        problem = build_problem(profile, stage_settings, num_layers=len(degrees), stage=stage)
        ks = problem.index(degrees[stage * per_stage : (stage + 1) * per_stage])
        out = evaluate(problem, ks)
        out["memory_breakdown_bytes"] = memory_breakdown(problem, ks)
        stages.append(out)
    # 1F1B runs at the pace of the slowest stage; memory binds on the fullest one
    out = dict(max(stages, key=lambda o: o["iteration_time_s"]))
    fullest = max(stages, key=lambda o: o["peak_memory_bytes"])
    out["peak_memory_bytes"] = fullest["peak_memory_bytes"]
    out["memory_breakdown_bytes"] = fullest["memory_breakdown_bytes"]
    if pp > 1:
        out["stages"] = [
            {k: o[k] for k in ("iteration_time_s", "peak_memory_bytes", "memory_breakdown_bytes")}
            for o in stages
        ]
    return out
