"""Plan a per-layer TMP degree list: build the instance, solve (ILP or DP), verify, report."""

import math
import time
from dataclasses import replace

from ..errors import OasesConfigError
from ..formats.plan import plan_document
from ..formats.profile import Profile, load_profile
from .build import build_problem
from .dp import min_memory, solve_dp
from .ilp import DEFAULT_TIME_LIMIT_S, solve_ilp
from .memory_model import memory_breakdown
from .time_model import decompose, evaluate

SOLVERS = ("ilp", "dp")
VERIFY_RTOL = 1e-6


class NoPlanFits(OasesConfigError):
    """No degree assignment fits the memory; ``need_gb``: the smallest memory that would (with
    the margin), or None when the pins and switch limit rule out every plan."""

    def __init__(self, message, need_gb=None):
        super().__init__(message)
        self.need_gb = need_gb


class PlannerVerificationError(RuntimeError):
    """``--verify``: the ILP and the DP disagree (a bug, not a user error)."""


def gb(nbytes):
    return nbytes / 1e9


def _infeasible(problem):
    need = min_memory(problem)
    margin = problem.margin
    have = problem.memory_bytes
    if need is None:
        return NoPlanFits("no plan satisfies --pin and --max-switches together; relax one of them")
    need_total = need * (1 + margin)
    return NoPlanFits(
        f"no plan fits in {gb(have):.2f} GB (peak memory per rank + {margin:.0%} safety margin); "
        f"the smallest memory that fits is {gb(need_total):.2f} GB",
        need_gb=gb(need_total),
    )


def solve(problem, solver="dp", verify=False, time_limit_s=DEFAULT_TIME_LIMIT_S):
    """Solve ``problem``; returns (Solution, verification dict or None).

    Raises OasesConfigError when infeasible and PlannerVerificationError when ``verify`` finds a
    disagreement. With ``verify``, the other solver runs too (cold: no warm start). If the ILP hits
    its time limit the check is *partial*: its incumbent must not beat the DP (the DP is exact)."""
    if solver not in SOLVERS:
        raise OasesConfigError(f"unknown solver {solver!r}; choose one of {', '.join(SOLVERS)}")
    dec = decompose(problem)
    runs = {}
    order = [solver] + ([s for s in SOLVERS if s != solver] if verify else [])
    for name in order:
        if name == "ilp":
            runs[name] = solve_ilp(problem, dec, time_limit_s=time_limit_s)
        else:
            runs[name] = solve_dp(problem, dec)
    sol = runs[solver]
    check = None
    if verify:
        a, b = runs["ilp"], runs["dp"]
        check = {
            "ilp": {"status": a.status, "objective": a.objective, "solve_time_s": a.solve_time_s},
            "dp": {"status": b.status, "objective": b.objective, "solve_time_s": b.solve_time_s},
        }
        tol = VERIFY_RTOL * max(abs(b.objective or 0.0), 1e-30)
        if a.status in ("time_limit", "error") and not a.feasible:
            check["agree"] = "inconclusive"
            check["note"] = f"ILP stopped with status {a.status} before finding a plan"
        elif a.feasible != b.feasible:
            raise PlannerVerificationError(
                f"--verify: ILP says {a.status}, DP says {b.status} — please report this instance"
            )
        elif a.feasible:
            diff = a.objective - b.objective
            check["relative_difference"] = abs(diff) / max(abs(b.objective), 1e-30)
            if diff < -tol:
                raise PlannerVerificationError(
                    f"--verify: the ILP found {a.objective:.9g} s, better than the DP's "
                    f"{b.objective:.9g} s — please report this instance"
                )
            if a.status == "optimal":
                if diff > tol:
                    raise PlannerVerificationError(
                        f"--verify: ILP optimum {a.objective:.9g} s ≠ DP optimum "
                        f"{b.objective:.9g} s — please report this instance"
                    )
                check["agree"] = True
            else:
                check["agree"] = "partial"
                check["note"] = (
                    f"ILP hit its {time_limit_s:g} s limit with incumbent {a.objective:.9g} s ≥ DP "
                    f"{b.objective:.9g} s (optimality not proven by CBC)"
                )
        else:
            check["agree"] = True
    if not sol.feasible:
        if sol.status == "infeasible":
            raise _infeasible(problem)
        raise OasesConfigError(
            f"the {solver} solver stopped with status {sol.status!r} "
            f"({sol.info.get('lp_status', '')}); try --solver dp or a longer --time-limit"
        )
    return sol, check


def uniform_costs(problem, known=None):
    """{degree: evaluate(...) + fits} for every candidate degree usable on all layers; ``known``:
    ``(ks, evaluate(problem, ks))`` already at hand (the plan's own: not evaluated twice)."""
    out = {}
    A, R, fixed, budget = problem.quantized()
    for k, d in enumerate(problem.degrees):
        ks = [k] * problem.num_layers
        res = known[1] if known and list(known[0]) == ks else evaluate(problem, ks)
        fits = budget is None or problem.peak_memory_granules(ks) <= budget
        out[d] = {
            "iteration_time_s": res["iteration_time_s"],
            "peak_memory_bytes_per_rank": res["peak_memory_bytes"],
            "fits": bool(fits),
        }
    return out


def make_plan(
    profile,
    settings,
    *,
    solver="dp",
    verify=False,
    time_limit_s=DEFAULT_TIME_LIMIT_S,
    profile_path=None,
):
    """Returns (plan dict, problem, solution) for the run ``settings``
    (:class:`~.settings.PlanSettings`; ``profile``: a :class:`Profile` or its path). With
    ``sequence_parallel`` or ``split="sequence"`` every layer runs at T
    (:func:`~.build.build_problem`): the plan is uniform and its ``predicted`` is the point.
    ``host_us_per_call``: the host's issue cost per aten call (:mod:`.host_model`; default: the
    analytic profile's cluster's, none for a measured profile, whose times were taken on its own
    host; 0: no host term)."""
    if not isinstance(profile, Profile):
        profile_path = profile_path or profile
        profile = load_profile(profile)
    settings = with_memory(settings, profile)
    t_build = time.perf_counter()
    problem = build_problem(profile, settings)
    build_s = time.perf_counter() - t_build
    sol, check = solve(problem, solver=solver, verify=verify, time_limit_s=time_limit_s)
    res = evaluate(problem, sol.ks)
    uniform = uniform_costs(problem, known=(sol.ks, res))
    host = host_term(profile, problem, settings.host_us_per_call)
    plan = plan_document(
        settings,
        profile,
        problem,
        sol,
        res,
        iteration_s=host_bound_iteration(res["iteration_time_s"], host),
        host=host,
        uniform=uniform,
        speedup=speedups(problem, uniform, res["iteration_time_s"]),
        memory_breakdown=memory_breakdown(problem, sol.ks),
        verify=check,
        build_time_s=build_s,
        profile_path=profile_path or profile.path,
    )
    assert math.isclose(plan["objective"], res["iteration_time_s"], rel_tol=1e-9, abs_tol=1e-12)
    return plan, problem, sol


def with_memory(settings, profile):
    """``settings`` with the device memory resolved: ``--memory``, else the profile's cluster's."""
    if settings.memory_gb is None:
        settings = replace(settings, memory_gb=profile.data.get("memory_gb"))
    if settings.memory_gb is None:
        raise OasesConfigError("pass --memory GB (device memory per rank)")
    return settings


def speedups(problem, uniform, device_s):
    """The plan's speedup over uniform T and over the fastest uniform degree that fits."""
    T = problem.meta["tensor_model_parallel_size"]
    fitting = [u["iteration_time_s"] for u in uniform.values() if u["fits"]]
    speedup = {}
    if T in uniform:
        speedup[f"uniform_{T}"] = uniform[T]["iteration_time_s"] / device_s
    if fitting:
        speedup["best_fitting_uniform"] = min(fitting) / device_s
    return speedup


def host_bound_iteration(device_s, host):
    """The predicted iteration: the longer of the device's and the host's timelines (marks
    ``host["host_bound"]``; ``host`` None: the device's)."""
    if not host:
        return device_s
    host["host_bound"] = host["issue_s"] > device_s
    return max(device_s, host["issue_s"])


def host_term(profile, problem, host_us_per_call=None):
    """The host's issue time of the planned iteration (:mod:`.host_model`), or None without a
    per-call cost (a measured profile: its times were taken on its own host)."""
    from .host_model import host_time

    us = host_us_per_call
    if us is None and profile.data.get("kind") == "analytic" and profile.data.get("cluster"):
        from ..testbed.clusters import load_cluster

        us = load_cluster(profile.data["cluster"]).host_us_per_call
    if not us:
        return None
    meta, settings = problem.meta, problem.settings
    issue_s, calls = host_time(
        settings.schedule,
        settings.recompute,
        settings.split,
        problem.subs,
        problem.num_layers,
        meta["num_microbatches"],
        us,
        recompute_num_layers=meta["recompute_num_layers"],
        sharding=settings.data_parallel_sharding,
    )
    return {"issue_s": issue_s, "calls": calls, "host_us_per_call": us}
