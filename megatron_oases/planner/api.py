"""Plan a per-layer TMP degree list: build the instance, solve (ILP or DP), verify, report."""

import math
import time

from ..errors import OasesConfigError
from ..formats.plan import PLAN_VERSION
from ..formats.profile import Profile, load_profile, sha256_of
from .build import build_problem
from .dp import min_memory, solve_dp
from .ilp import DEFAULT_TIME_LIMIT_S, solve_ilp
from .memory_model import memory_breakdown
from .problem import DEFAULT_GRANULE, DEFAULT_MARGIN
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


def parse_pins(specs):
    """``["0-3=4", "7=2,9=1"]`` → ``[(range(0, 4), 4), ([7], 2), ([9], 1)]``."""
    pins = []
    for spec in specs or ():
        for part in str(spec).split(","):
            part = part.strip()
            if not part:
                continue
            try:
                layers, degree = part.split("=")
                if "-" in layers:
                    a, b = layers.split("-")
                    rng = list(range(int(a), int(b) + 1))
                    if not rng:
                        raise ValueError
                else:
                    rng = [int(layers)]
                pins.append((rng, int(degree)))
            except ValueError:
                raise OasesConfigError(
                    f"bad --pin {part!r}; use LAYER=DEGREE or FIRST-LAST=DEGREE, e.g. 0-3=4"
                ) from None
    return pins


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


def uniform_costs(problem):
    """{degree: evaluate(...) + fits} for every candidate degree usable on all layers."""
    out = {}
    for k, d in enumerate(problem.degrees):
        ks = [k] * problem.num_layers
        res = evaluate(problem, ks)
        A, R, fixed, budget = problem.quantized()
        fits = budget is None or problem.peak_memory_granules(ks) <= budget
        out[d] = {
            "iteration_time_s": res["iteration_time_s"],
            "peak_memory_bytes_per_rank": res["peak_memory_bytes"],
            "fits": bool(fits),
        }
    return out


def make_plan(
    profile,
    *,
    global_batch_size,
    memory_gb=None,
    schedule="oases",
    micro_batch_size=None,
    degrees=None,
    pins=None,
    max_switches=None,
    recompute=None,
    recompute_layers=None,
    solver="dp",
    verify=False,
    margin=DEFAULT_MARGIN,
    granule=DEFAULT_GRANULE,
    time_limit_s=DEFAULT_TIME_LIMIT_S,
    profile_path=None,
    grad_sync=False,
    allow_unsplit=False,
    distributed_optimizer=False,
    sequence_parallel=False,
    split="batch",
    host_us_per_call=None,
):
    """Returns (plan dict, problem, solution). With ``sequence_parallel`` or ``split="sequence"``
    every layer runs at T (:func:`~.build.build_problem`): the plan is uniform and its
    ``predicted`` is the point. ``host_us_per_call``: the host's issue cost per aten call
    (:mod:`.host_model`; default: the analytic profile's cluster's, none for a measured profile,
    whose times were taken on its own host; 0: no host term)."""
    if not isinstance(profile, Profile):
        profile_path = profile_path or profile
        profile = load_profile(profile)
    if memory_gb is None:
        memory_gb = profile.data.get("memory_gb")
    if memory_gb is None:
        raise OasesConfigError("pass --memory GB (device memory per rank)")
    if memory_gb <= 0:
        raise OasesConfigError("--memory must be positive")
    t_build = time.perf_counter()
    problem = build_problem(
        profile,
        schedule=schedule,
        global_batch_size=global_batch_size,
        micro_batch_size=micro_batch_size,
        degrees=degrees,
        recompute=recompute,
        recompute_layers=recompute_layers,
        memory_gb=memory_gb,
        margin=margin,
        granule=granule,
        pins=pins,
        max_switches=max_switches,
        grad_sync=grad_sync,
        allow_unsplit=allow_unsplit,
        distributed_optimizer=distributed_optimizer,
        sequence_parallel=sequence_parallel,
        split=split,
    )
    build_s = time.perf_counter() - t_build
    pp = problem.meta["pipeline_model_parallel_size"]
    sol, check = solve(problem, solver=solver, verify=verify, time_limit_s=time_limit_s)
    res = evaluate(problem, sol.ks)
    uniform = uniform_costs(problem)
    T = problem.meta["tensor_model_parallel_size"]
    fitting = [u["iteration_time_s"] for u in uniform.values() if u["fits"]]
    speedup = {}
    if T in uniform:
        speedup[f"uniform_{T}"] = uniform[T]["iteration_time_s"] / res["iteration_time_s"]
    if fitting:
        speedup["best_fitting_uniform"] = min(fitting) / res["iteration_time_s"]
    shape = profile.shape
    tokens = global_batch_size * shape["seq_length"]
    host = host_term(profile, problem, schedule, split, host_us_per_call)
    device_s = res["iteration_time_s"]
    iteration_s = max(device_s, host["issue_s"]) if host else device_s
    if host:
        host["host_bound"] = host["issue_s"] > device_s
    inputs = {
        "profile_sha256": profile.sha256,
        "schedule": schedule,
        "recompute": problem.meta["recompute"],
        "global_batch_size": global_batch_size,
        "micro_batch_size": problem.meta["micro_batch_size"],
        "memory_gb": memory_gb,
        "margin": margin,
        "granule": granule,
        "degrees": problem.degrees,
        "pins": [[list(l), d] for l, d in (pins or [])],
        "max_switches": max_switches,
        "grad_sync": bool(grad_sync),
        "allow_unsplit": bool(allow_unsplit),
        "distributed_optimizer": bool(distributed_optimizer),
        "sequence_parallel": bool(sequence_parallel),
    }
    if problem.meta["recompute_num_layers"] is not None:  # (plans without it hash as before)
        inputs["recompute_num_layers"] = problem.meta["recompute_num_layers"]
    if split != "batch":  # (likewise)
        inputs["split"] = split
    plan = {
        "version": PLAN_VERSION,
        "tensor_model_parallel_size": T,
        "data_parallel_size": problem.meta["data_parallel_size"],
        "num_layers": problem.meta["total_layers"],
        # one stage's plan, repeated on every pipeline stage (stage 0, which holds the most
        # in-flight activations, is the one planned)
        "degrees": [problem.degrees[k] for k in sol.ks] * pp,
        "pipeline_model_parallel_size": pp,
        "schedule": schedule,
        "recompute": problem.meta["recompute"],
        # with full recompute: only each stage's first N layers (Megatron's block method)
        "recompute_num_layers": problem.meta["recompute_num_layers"],
        "sequence_parallel": bool(sequence_parallel),
        # sub-batches of samples, or of sequence chunks (--oases-split sequence; uniform T)
        "split": split,
        "allow_unsplit": bool(allow_unsplit),
        "unsplit_degrees": problem.meta["unsplit_degrees"],
        "distributed_optimizer": bool(distributed_optimizer),
        "global_batch_size": int(global_batch_size),
        "micro_batch_size": problem.meta["micro_batch_size"],
        "num_microbatches": problem.meta["num_microbatches"],
        "predicted": {
            # the longer of the device's and the host's timelines (planner/host_model.py)
            "iteration_time_s": iteration_s,
            "device_time_s": device_s,
            "host": host,
            "forward_s": res["forward_s"],
            "backward_s": res["backward_s"],
            "edges_s": res["edges_s"],
            "grad_sync_s": res["grad_sync_s"],
            "grad_sync_included": res["grad_sync_included"],
            "peak_memory_bytes_per_rank": res["peak_memory_bytes"],
            "peak_memory_with_margin_bytes": res["peak_memory_bytes"] * (1 + margin),
            "memory_breakdown_bytes": memory_breakdown(problem, sol.ks),
            "tokens_per_s": tokens / iteration_s,
            "per_layer": res["per_layer"],
        },
        "uniform": {str(d): u for d, u in uniform.items()},
        "speedup": speedup,
        "objective": sol.objective,
        "objective_units": "seconds per iteration (eq. 5)",
        "solver": sol.solver,
        "solve_time_s": sol.solve_time_s,
        "build_time_s": build_s,
        "status": sol.status,
        "verify": check,
        "memory_gb": memory_gb,
        "memory_margin": margin,
        "memory_granule_bytes": granule,
        "constraints": {
            "degrees": problem.degrees,
            "pins": inputs["pins"],
            "max_switches": max_switches,
            "excluded_degrees": problem.meta["excluded_degrees"],
        },
        "input_hash": sha256_of(inputs),
        "profile": profile_path or profile.path,
        "profile_sha256": profile.sha256,
        "profile_kind": profile.data.get("kind"),
        "cluster": profile.data.get("cluster"),
        "model": shape.get("name"),
    }
    assert math.isclose(plan["objective"], res["iteration_time_s"], rel_tol=1e-9, abs_tol=1e-12)
    return plan, problem, sol


def host_term(profile, problem, schedule, split, host_us_per_call):
    """The host's issue time of the planned iteration (:mod:`.host_model`), or None without a
    per-call cost (a measured profile: its times were taken on its own host)."""
    from .host_model import host_time

    us = host_us_per_call
    if us is None and profile.data.get("kind") == "analytic" and profile.data.get("cluster"):
        from ..testbed.clusters import load_cluster

        us = load_cluster(profile.data["cluster"]).host_us_per_call
    if not us:
        return None
    meta = problem.meta
    issue_s, calls = host_time(
        schedule,
        meta["recompute"],
        split,
        problem.subs,
        problem.num_layers,
        meta["num_microbatches"],
        us,
        recompute_num_layers=meta["recompute_num_layers"],
    )
    return {"issue_s": issue_s, "calls": calls, "host_us_per_call": us}
