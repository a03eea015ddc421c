"""Brute force over every degree assignment: the reference the tests hold the planner's ILP and DP
to (test-only; not in the package).

It evaluates each assignment with :func:`megatron_oases.planner.time_model.evaluate` (the direct
eq. 3–4 walk), not with the unary/pairwise decomposition the solvers use, so it also checks that
decomposition.
"""

import time

from megatron_oases.planner.common import Solution
from megatron_oases.planner.problem import enumerate_assignments
from megatron_oases.planner.time_model import evaluate


def solve_brute(problem, limit=200_000):
    t0 = time.perf_counter()
    best, best_ks, n = None, None, 0
    for ks in enumerate_assignments(problem):
        n += 1
        if n > limit:
            raise ValueError(f"brute force limited to {limit} assignments")
        if not problem.feasible(ks):
            continue
        t = evaluate(problem, ks)["iteration_time_s"]
        if best is None or t < best - 1e-15:
            best, best_ks = t, list(ks)
    dt = time.perf_counter() - t0
    if best_ks is None:
        return Solution("brute", "infeasible", solve_time_s=dt, info={"assignments": n})
    return Solution("brute", "optimal", best_ks, best, dt, info={"assignments": n})
