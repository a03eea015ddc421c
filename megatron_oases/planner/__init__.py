"""Oases parallel strategy planner (paper §4): overlap-aware cost model, ILP and DP solvers, plans.

Public API::

    PlanSettings(global_batch_size=..., memory_gb=..., schedule=..., ...)  # one run, frozen
    predict(profile, degrees, settings)
        -> {iteration_time_s, forward_s, backward_s, edges_s, peak_memory_bytes, per_layer}
    make_plan(profile, settings) -> (plan, problem, solution)
    load_plan / save_plan / uniform_plan / validate_plan
"""

from ..formats.plan import load_plan, save_plan, uniform_plan, validate_plan
from .api import make_plan
from .build import build_problem
from .prediction import predict
from .settings import PlanSettings
from .time_model import evaluate

__all__ = [
    "PlanSettings",
    "build_problem",
    "evaluate",
    "load_plan",
    "make_plan",
    "predict",
    "save_plan",
    "uniform_plan",
    "validate_plan",
]
