"""``oases plan --gpus N``: which DP × TP × PP layout, micro-batch and setting to run on N GPUs.

Two levels, as Rhino trades search time for quality: every layout (TP a power of two within a
node that divides the heads, PP dividing the layers evenly, DP the rest, every micro-batch that
divides the per-replica batch) is costed at a uniform TMP degree with four settings (stock with and
without full recompute, ``overlap`` without recompute, ``oases``); the ``top`` fastest are then
planned in full (every schedule and recompute setting, per-layer degrees, the host term). Each
candidate's time is the planner's model of one iteration: the 1F1B pipeline over its micro-batches
(bubble included), the exposed data-parallel gradient all-reduce, the larger of the device's and
the host's timelines. Pipelined candidates planned in full also try uneven stage splits (Megatron's
``--decoder-first/last-pipeline-num-layers``, :mod:`.stage_split`). The stage-to-stage sends
are in the analytic profiles (``pipeline_p2p``: one per pass of a micro-batch).
See ``docs/planner.md`` ("Searching the cluster").
"""

import copy
import dataclasses
import time

from ..errors import OasesConfigError
from .api import make_plan
from .choose import choose_plan, setting_name
from .stage_split import best_split

#: Level one's settings: (schedule, recompute).
QUICK_SETTINGS = (("off", "full"), ("off", "none"), ("overlap", "none"), ("oases", "full"))
#: The micro-batch sizes tried (those dividing the per-replica batch).
MICRO_BATCHES = (1, 2, 4, 8, 16)


@dataclasses.dataclass(frozen=True)
class Layout:
    """One way to place the model on the GPUs: TP × PP × DP ranks and the micro-batch size."""

    tp: int
    pp: int
    dp: int
    micro_batch: int

    def flags(self, global_batch_size):
        return (
            f"--tensor-model-parallel-size {self.tp} --pipeline-model-parallel-size {self.pp} "
            f"--micro-batch-size {self.micro_batch} --global-batch-size {global_batch_size}"
        )

    def name(self):
        return f"TP{self.tp} PP{self.pp} DP{self.dp} mb{self.micro_batch}"


def model_for_search(flat, global_batch_size, overrides=None):
    """Megatron's args of a model file's model, validated as one rank (TP = PP = DP = micro-batch
    = 1): the file's own parallel sizes are a layout the search replaces, not a constraint."""
    from ..profiler.model_config import model_args

    single = dict(
        tensor_model_parallel_size=1,
        pipeline_model_parallel_size=1,
        data_parallel_size=1,
        micro_batch_size=1,
        global_batch_size=global_batch_size,
    )
    return model_args(flat, {**(overrides or {}), **single})


def layouts(args, gpus, global_batch_size, gpus_per_node):
    """Every :class:`Layout` of ``gpus`` GPUs Megatron can run for ``args``' model."""
    from ..profiler.analytic import candidate_degrees

    tps = [t for t in candidate_degrees(args, min(gpus, gpus_per_node)) if gpus % t == 0]
    out = []
    for tp in tps:
        for pp in range(1, gpus // tp + 1):
            if (gpus // tp) % pp or args.num_layers % pp:
                continue
            dp = gpus // (tp * pp)
            if global_batch_size % dp:
                continue
            per_replica = global_batch_size // dp
            for mb in MICRO_BATCHES:
                if mb <= per_replica and per_replica % mb == 0:
                    out.append(Layout(tp, pp, dp, mb))
    if not out:
        raise OasesConfigError(
            f"no TP x PP x DP layout of {gpus} GPUs runs this model at global batch "
            f"{global_batch_size}; use a global batch divisible by the data-parallel size"
        )
    return out


def _profile(args, layout, cluster):
    from ..formats.profile import Profile
    from ..profiler.analytic import analytic_profile

    args = copy.copy(args)
    args.tensor_model_parallel_size = layout.tp
    args.pipeline_model_parallel_size = layout.pp
    args.data_parallel_size = layout.dp
    args.micro_batch_size = layout.micro_batch
    return Profile(analytic_profile(args, cluster))


def _row(layout, plan):
    """A candidate's ranking row from a plan (None: nothing fits)."""
    p = plan["predicted"]
    host = p.get("host") or {}
    return {
        "layout": dataclasses.asdict(layout),
        "name": layout.name(),
        "schedule": plan["schedule"],
        "recompute": plan["recompute"],
        "recompute_num_layers": plan.get("recompute_num_layers"),
        "split": plan.get("split", "batch"),
        "degrees": sorted(set(plan["degrees"])),
        "iteration_time_s": p["iteration_time_s"],
        "device_time_s": p.get("device_time_s", p["iteration_time_s"]),
        "host_bound": bool(host.get("host_bound")),
        "peak_memory_gb": p["peak_memory_bytes_per_rank"] / 1e9,
    }


def _flags(layout, setting, common):
    """A candidate's launch line: the layout's flags and its setting's (``setting``: a plan or a
    ranking row)."""
    from .choose import launch_flags

    own = launch_flags(
        setting["schedule"],
        setting["recompute"],
        setting.get("recompute_num_layers"),
        setting.get("split", "batch"),
    )
    return f"{layout.flags(common['global_batch_size'])} {own}"


def _uniform(profile, layout, schedule, recompute, common, split="batch"):
    """The layout's row for one setting at its uniform degree (None where it does not fit)."""
    try:
        plan = make_plan(
            profile,
            schedule=schedule,
            recompute=recompute,
            split=split,
            degrees=[layout.tp],
            micro_batch_size=layout.micro_batch,
            grad_sync=layout.dp > 1,
            **common,
        )[0]
    except OasesConfigError:  # does not fit, or cannot split this micro-batch
        return None
    return _row(layout, plan)


def _try_uneven_split(row, profile, layout, plan, common, total_layers):
    """Level two, pipelined candidates at a uniform degree: the fastest stage split that fits
    (:mod:`.stage_split`) replaces the even one where it is faster; the row's time is scaled by
    the split's ratio to the even split, its memory is the fullest stage's."""
    if layout.pp < 2 or row["degrees"] != [layout.tp]:
        return
    found = best_split(
        profile,
        row,
        common,
        layout.micro_batch,
        layout.dp > 1,
        total_layers,
        spread=total_layers // layout.pp,
    )
    if found is None:
        return
    for key in ("iteration_time_s", "device_time_s"):
        row[key] *= found["ratio"]
    row["peak_memory_gb"] = found["peak_bytes"] / 1e9
    row["stage_split"] = list(found["split"])  # layers on the first, each middle, the last stage
    row["even_split_ratio"] = found["ratio"]  # its time ÷ the even split's
    row["launch_flags"] += " " + found["flags"]


def _quick(profile, layout, common):
    """Level one: the fastest of :data:`QUICK_SETTINGS` at the uniform degree; also stock with
    full recompute on its own (the rule of thumb's setting). ``(best, stock)``, rows or None."""
    best = stock = None
    for schedule, recompute in QUICK_SETTINGS:
        split = "sequence" if schedule != "off" and layout.micro_batch == 1 else "batch"
        row = _uniform(profile, layout, schedule, recompute, common, split)
        if row is None:
            continue
        if (schedule, recompute) == ("off", "full"):
            stock = row
        if best is None or row["iteration_time_s"] < best["iteration_time_s"]:
            best = row
    return best, stock


#: Stock Megatron's recompute settings, the rule of thumb's choices.
STOCK_SETTINGS = ("none", "selective", "selective+ln", "full")


def rule_of_thumb(stock_rows, gpus_per_node, profiles, common):
    """What a Megatron user picks by the usual rules: TP as large as a node allows, the fewest
    pipeline stages that fit, the largest micro-batch that fits; stock Megatron with its fastest
    recompute setting that fits there. ``stock_rows``: level one's stock-with-full-recompute
    rows (where that fits)."""
    if not stock_rows:
        return None
    tp = max(r["layout"]["tp"] for r in stock_rows if r["layout"]["tp"] <= gpus_per_node)
    rows = [r for r in stock_rows if r["layout"]["tp"] == tp]
    pp = min(r["layout"]["pp"] for r in rows)
    rows = [r for r in rows if r["layout"]["pp"] == pp]
    best = max(rows, key=lambda r: r["layout"]["micro_batch"])
    layout = Layout(**best["layout"])
    for recompute in STOCK_SETTINGS:
        row = _uniform(profiles[layout], layout, "off", recompute, common)
        if row is not None and row["iteration_time_s"] < best["iteration_time_s"]:
            best = row
    return best


def search(
    args,
    cluster,
    gpus,
    global_batch_size,
    memory_gb=None,
    top=5,
    host_us_per_call=None,
    progress=None,
):
    """Rank the layouts of ``gpus`` GPUs for ``args``' model on ``cluster`` (a cluster profile's
    name). Returns ``{'candidates', 'winner_plan', 'rule_of_thumb', 'search_s', ...}``: the
    candidates fastest first (the ``top`` planned in full first, ``level`` 2), the winner's plan
    with ``launch_flags`` that include the layout."""
    from ..testbed.clusters import load_cluster

    t0 = time.perf_counter()
    spec = load_cluster(cluster)
    memory_gb = spec.memory_gb if memory_gb is None else memory_gb
    common = dict(
        global_batch_size=global_batch_size, memory_gb=memory_gb, host_us_per_call=host_us_per_call
    )
    options = layouts(args, gpus, global_batch_size, spec.gpus_per_node)
    quick, stock, profiles = [], [], {}
    for i, layout in enumerate(options):
        profiles[layout] = _profile(args, layout, cluster)
        best, stock_row = _quick(profiles[layout], layout, common)
        if best:
            quick.append(best)
        if stock_row:
            stock.append(stock_row)
        if progress and (i + 1) % 20 == 0:
            progress(f"searched {i + 1}/{len(options)} layouts")
    if not quick:
        raise OasesConfigError(
            f"no layout of {gpus} GPUs fits this model in {memory_gb:g} GB per GPU; "
            "add GPUs or lower the global batch"
        )
    quick.sort(key=lambda r: r["iteration_time_s"])
    refined, plans = [], {}
    for row in quick[:top]:
        layout = Layout(**row["layout"])
        try:
            plan = choose_plan(
                profiles[layout],
                micro_batch_size=layout.micro_batch,
                grad_sync=layout.dp > 1,
                **common,
            )[0]
        except OasesConfigError:
            continue
        plans[layout] = plan
        row = dict(_row(layout, plan), level=2, launch_flags=_flags(layout, plan, common))
        _try_uneven_split(row, profiles[layout], layout, plan, common, args.num_layers)
        if row.get("stage_split"):
            plan["stage_split"] = row["stage_split"]
        refined.append(row)
    refined.sort(key=lambda r: r["iteration_time_s"])
    done = {r["name"] for r in refined}
    rest = [dict(r, level=1) for r in quick if r["name"] not in done]
    for r in rest:
        r["launch_flags"] = _flags(Layout(**r["layout"]), r, common)
    candidates = refined + rest
    winner = candidates[0]
    layout = Layout(**winner["layout"])
    plan = plans[layout]
    plan["launch_flags"] = winner["launch_flags"]
    plan["layout"] = dataclasses.asdict(layout)
    thumb = rule_of_thumb(stock, spec.gpus_per_node, profiles, common)
    return {
        "gpus": gpus,
        "cluster": cluster,
        "memory_gb": memory_gb,
        "global_batch_size": global_batch_size,
        "layouts_searched": len(options),
        "candidates": candidates,
        "winner_plan": plan,
        "plans": {lay.name(): p for lay, p in plans.items()},  # level 2's, for --verify-top
        "rule_of_thumb": thumb,
        "search_s": time.perf_counter() - t0,
    }


def why_first(result):
    """One line on why the winner wins: against the runner-up and the rule of thumb."""
    c = result["candidates"]
    w = c[0]
    parts = [
        f"{w['name']} {setting_name(w['schedule'], w['recompute'], w['recompute_num_layers'], w['split'])}"
    ]
    if len(c) > 1:
        parts.append(
            f"the next ({c[1]['name']} {c[1]['schedule']}) takes "
            f"{c[1]['iteration_time_s'] / w['iteration_time_s']:.2f}x its time"
        )
    thumb = result["rule_of_thumb"]
    if thumb:
        stock = setting_name("off", thumb["recompute"])
        parts.append(
            f"the rule of thumb ({thumb['name']}, {stock}) takes "
            f"{thumb['iteration_time_s'] / w['iteration_time_s']:.2f}x"
        )
    if w.get("stage_split"):
        first, _, last = w["stage_split"]
        parts.append(
            f"its stage split ({first} layers first, {last} last) takes "
            f"{w['even_split_ratio']:.2f}x the even split's time"
        )
    if w["host_bound"]:
        parts.append("host-bound: the host's issue time sets its iteration")
    return "; ".join(parts)


def table(result, rows=10):
    """The ranked candidates as text lines."""
    head = f"{'#':>3}  {'layout':<22} {'setting':<62} {'iteration s':>11} {'GB/GPU':>7}  level"
    lines = [head]
    for i, r in enumerate(result["candidates"][:rows], 1):
        setting = setting_name(r["schedule"], r["recompute"], r["recompute_num_layers"], r["split"])
        if r["degrees"] != [r["layout"]["tp"]]:
            setting += f" degrees {r['degrees']}"
        if r.get("stage_split"):
            first, _, last = r["stage_split"]
            setting += f" stages {first}/../{last}"
        bound = " host-bound" if r["host_bound"] else ""
        lines.append(
            f"{i:>3}  {r['name']:<22} {setting:<62} {r['iteration_time_s']:>11.3f} "
            f"{r['peak_memory_gb']:>7.2f}  {r['level']}{bound}"
        )
    return lines


__all__ = ["Layout", "layouts", "model_for_search", "search", "rule_of_thumb", "why_first", "table"]
