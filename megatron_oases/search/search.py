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

The whole space a Megatron user has: every layout with DP > 1 is also costed with the distributed
optimizer (``--use-distributed-optimizer``: Adam state sharded over DP, the gradient all-reduce
replaced by a reduce-scatter and a parameter all-gather), and TP = 1 layouts run stock Megatron
only (nothing to overlap). Stock Megatron at every layout and recompute setting is ranked too:
the result names the best stock layout (uniform degree, ``off``) beside the best Oases one
(an overlapped schedule or per-layer degrees) and their ratio, so a cluster where stock wins says
so. Sharded data parallelism too (:mod:`..planner.sharding`): every layout with DP > 1 is costed
with torch FSDP2 and each Megatron-FSDP strategy as stock settings, and with FSDP2 under the split
schedules (where Megatron and the runtime run them: FSDP2 without PP and for untied embeddings;
Megatron-FSDP stock only), each at its layout's uniform TP. See ``docs/planner.md`` ("Searching
the cluster").
"""

import copy
import dataclasses
import time
from dataclasses import replace

from ..errors import OasesConfigError
from ..planner.api import make_plan
from ..planner.choose import SETTINGS, choose_plan, setting_name
from ..planner.settings import AUTO, PlanSettings
from ..planner.sharding import STRATEGIES as SHARDINGS
from ..planner.sharding import label as sharding_label
from ..planner.sharding import launch_flags as sharding_flags
from ..planner.sharding import strategies_for
from .stage_split import best_split

#: Level one's settings: (schedule, recompute).
QUICK_SETTINGS = (("off", "full"), ("off", "none"), ("overlap", "none"), ("oases", "full"))
#: Level one's split setting where no setting fits: the one that needs the least memory
#: (``cross-pass`` with full recompute saves layer inputs only, ``oases`` block inputs). Without
#: it such a layout drops out of the search (llama-7b at 40 layers on 8 RTX 4090s, TP2 DP4 under
#: Megatron-FSDP, where stock Megatron-FSDP's prefetch window does not fit either).
QUICK_FALLBACK = ("cross-pass", "full")
#: Stock Megatron's recompute settings (level one tries each; the rule of thumb's choices).
STOCK_SETTINGS = ("none", "selective", "selective+ln", "full")
#: Level two's settings for stock Megatron and for the Oases schedules.
STOCK_CHOICES = tuple((s, r) for s, r in SETTINGS if s == "off")
OASES_CHOICES = tuple((s, r) for s, r in SETTINGS if s != "off")
#: How many of level one's fastest stock layouts (and Oases layouts) are planned in full for the
#: best stock (and best Oases) one. Level two's settings can move a layout far (llama-7b, seq
#: 1024, 8 L40S: TP2 PP1 DP4 mb8 from 2.82 s at level one to 2.15 s): at 3, the Megatron-FSDP
#: layouts with pipeline stages pushed it out, and the best Oases answer got worse (2.55 s).
STOCK_TOP = 5
#: The micro-batch sizes tried (those dividing the per-replica batch).
MICRO_BATCHES = (1, 2, 4, 8, 16)
#: The most model layers the search takes (each plan's cost grows with them; far beyond today's
#: models). ``--gpus`` has its bound in :mod:`.cli`.
MAX_LAYERS = 1024


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
    args = model_args(flat, {**(overrides or {}), **single})
    if args.num_layers > MAX_LAYERS:
        raise OasesConfigError(
            f"the search takes models of at most {MAX_LAYERS} layers; this one has "
            f"{args.num_layers} (--set num_layers?)"
        )
    return args


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
    """The layout's analytic profile. It depends on TP, PP and DP, not on the micro-batch (the
    planner reads that from its settings): :func:`search` builds one per (TP, PP, DP) and shares
    it among that layout's micro-batch sizes (a profile is read, never written, by the plans)."""
    from ..formats.profile import Profile
    from ..profiler.analytic import analytic_profile

    args = copy.copy(args)
    args.tensor_model_parallel_size = layout.tp
    args.pipeline_model_parallel_size = layout.pp
    args.data_parallel_size = layout.dp
    args.micro_batch_size = layout.micro_batch
    return Profile(analytic_profile(args, cluster))


def is_oases(row):
    """Whether a ranking row runs Oases: an overlapped schedule or per-layer degrees (stock
    Megatron runs ``off`` at the layout's uniform TP)."""
    return row["schedule"] != "off" or row["degrees"] != [row["layout"]["tp"]]


def _optimizers(layout):
    """Distributed optimizer off, and on where there is data parallelism to shard over."""
    return (False, True) if layout.dp > 1 else (False,)


def _shardings(layout, untied):
    """The sharding strategies the layout can run stock (:func:`..planner.sharding.strategies_for`);
    which of them run under the split schedules: :func:`_runs`."""
    return strategies_for(layout.dp, layout.pp, untied)


def _modes(layout, untied, sharding=True):
    """``(distributed optimizer, sharding)`` pairs a layout is costed with: the optimizer off
    and on (DP > 1), then each sharding strategy ``sharding`` allows (:func:`search`)."""
    modes = [(optimizer, None) for optimizer in _optimizers(layout)]
    names = _shardings(layout, untied)
    if sharding is not True:
        names = [n for n in names if n in (sharding or ())]
    return modes + [(False, name) for name in names]


def _runs(schedule, sharding):
    """Whether ``schedule`` runs under ``sharding`` (Megatron-FSDP: stock only)."""
    return sharding is None or schedule == "off" or SHARDINGS[sharding].split_schedules


def _untied(profile):
    return bool(profile.shape.get("untie_embeddings_and_output_weights"))


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
        "distributed_optimizer": bool(plan.get("distributed_optimizer")),
        "data_parallel_sharding": plan.get("data_parallel_sharding"),
    }


def _flags(layout, setting, common):
    """A candidate's launch line: the layout's flags and its setting's (``setting``: a plan or a
    ranking row)."""
    from ..planner.choose import launch_flags

    own = launch_flags(
        setting["schedule"],
        setting["recompute"],
        setting.get("recompute_num_layers"),
        setting.get("split", "batch"),
    )
    if setting.get("distributed_optimizer"):
        own += " --use-distributed-optimizer"
    if setting.get("data_parallel_sharding"):
        own += " " + sharding_flags(setting["data_parallel_sharding"])
    return f"{layout.flags(common.global_batch_size)} {own}"


def _uniform(
    profile, layout, schedule, recompute, common, split="batch", optimizer=False, sharding=None
):
    """The layout's row for one setting at its uniform degree (None where it does not fit);
    ``optimizer``: the distributed optimizer; ``sharding``: a sharding strategy (None: none);
    ``common``: the search's settings (:class:`~..planner.settings.PlanSettings`)."""
    try:
        setting = replace(
            common,
            schedule=schedule,
            recompute=recompute,
            split=split,
            degrees=[layout.tp],
            micro_batch_size=layout.micro_batch,
            grad_sync=layout.dp > 1,
            distributed_optimizer=optimizer,
            data_parallel_sharding=sharding,
        )
        plan = make_plan(profile, setting)[0]
    except OasesConfigError:  # does not fit, or cannot split this micro-batch
        return None
    return _row(layout, plan)


def _try_uneven_split(row, profile, layout, plan, common, total_layers):
    """Level two, pipelined candidates at a uniform degree: the fastest stage split that fits
    (:mod:`.stage_split`) replaces the even one where it is faster; the row's time is scaled by
    the split's ratio to the even split, its memory is the fullest stage's."""
    if layout.pp < 2 or row["degrees"] != [layout.tp] or row.get("data_parallel_sharding"):
        return  # (sharded: each stage's own gathers are not costed per stage; not searched)
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


def _quick(profile, layout, common, sharding=True):
    """Level one at the uniform degree, with and without the distributed optimizer and with each
    sharding strategy (:func:`_modes`): the fastest Oases setting of :data:`QUICK_SETTINGS`
    (none at TP = 1; :data:`QUICK_FALLBACK` where nothing fits), the fastest stock recompute
    setting of :data:`STOCK_SETTINGS`, and stock with full recompute and neither (the rule of
    thumb's). ``(oases, stock, full)``, rows or None. ``sharding``: which sharding strategies
    (:func:`search`)."""
    oases = stock = full = None
    tried = [("off", r) for r in STOCK_SETTINGS]
    if layout.tp > 1:
        tried += [(s, r) for s, r in QUICK_SETTINGS if s != "off"]
    modes = _modes(layout, _untied(profile), sharding)

    def run(settings):
        nonlocal oases, stock, full
        for optimizer, name in modes:
            for schedule, recompute in settings:
                if not _runs(schedule, name):
                    continue
                split = "sequence" if schedule != "off" and layout.micro_batch == 1 else "batch"
                row = _uniform(profile, layout, schedule, recompute, common, split, optimizer, name)
                if row is None:
                    continue
                if (schedule, recompute, optimizer, name) == ("off", "full", False, None):
                    full = row
                if schedule == "off":
                    stock = _faster(row, stock)
                else:
                    oases = _faster(row, oases)

    run(tried)
    if oases is None and stock is None and layout.tp > 1:  # nothing fits: the leanest split
        run([QUICK_FALLBACK])
    return oases, stock, full


def _faster(row, best):
    """The faster of two level-one rows; at the same time the one that needs less memory (it
    leaves level two room to recompute fewer layers: ZeRO-3's strategies tie in time)."""
    if best is None:
        return row
    t, u = row["iteration_time_s"], best["iteration_time_s"]
    if t < u * (1 - 1e-9) or (
        t <= u * (1 + 1e-9) and row["peak_memory_gb"] < best["peak_memory_gb"]
    ):
        return row
    return best


def _refine(profile, layout, row, common, total_layers, settings=SETTINGS, uniform=False):
    """Level two for one layout: every setting of ``settings`` planned in full (per-layer degrees
    unless ``uniform``, the host term, block recompute, uneven stage splits) with ``row``'s
    distributed optimizer and sharding. ``(row, plan)``, or None where nothing fits."""
    sharding = row.get("data_parallel_sharding")
    if layout.tp == 1:  # nothing to overlap: stock Megatron only
        settings = tuple(sr for sr in settings if sr[0] == "off")
    settings = tuple(sr for sr in settings if _runs(sr[0], sharding))
    if not settings:
        return None
    try:
        setting = replace(
            common,
            micro_batch_size=layout.micro_batch,
            grad_sync=layout.dp > 1,
            distributed_optimizer=row.get("distributed_optimizer", False),
            data_parallel_sharding=sharding,
            degrees=[layout.tp] if uniform or sharding else None,
        )
        plan = choose_plan(profile, setting, candidates=settings)[0]
    except OasesConfigError:
        return None
    out = dict(_row(layout, plan), level=2, launch_flags=_flags(layout, plan, common))
    dcommon = replace(common, distributed_optimizer=out["distributed_optimizer"])
    _try_uneven_split(out, profile, layout, plan, dcommon, total_layers)
    if out.get("stage_split"):
        plan["stage_split"] = out["stage_split"]
    plan["launch_flags"] = out["launch_flags"]
    plan["layout"] = dataclasses.asdict(layout)
    return out, plan


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
    sharding=True,
):
    """Rank the layouts of ``gpus`` GPUs for ``args``' model on ``cluster`` (a cluster profile's
    name). Returns ``{'candidates', 'winner_plan', 'rule_of_thumb', 'search_s', ...}``: the
    candidates fastest first (the ``top`` planned in full first, ``level`` 2), the winner's plan
    with ``launch_flags`` that include the layout. ``sharding``: True, every sharding strategy
    (FSDP) where it runs; False, none (for comparison); or the names of those to try (e.g.
    ``("torch_fsdp2",)``)."""
    from ..testbed.clusters import load_cluster

    t0 = time.perf_counter()
    spec = load_cluster(cluster)
    memory_gb = spec.memory_gb if memory_gb is None else memory_gb
    common = PlanSettings(  # each candidate's schedule, recompute and split: chosen below
        global_batch_size=global_batch_size,
        memory_gb=memory_gb,
        host_us_per_call=host_us_per_call,
        schedule=AUTO,
    )
    options = layouts(args, gpus, global_batch_size, spec.gpus_per_node)
    quick, stock, oases_quick, full, profiles, built = [], [], [], [], {}, {}
    for i, layout in enumerate(options):
        degree = (layout.tp, layout.pp, layout.dp)
        if degree not in built:
            built[degree] = _profile(args, layout, cluster)
        profiles[layout] = built[degree]
        oases_row, stock_row, full_row = _quick(profiles[layout], layout, common, sharding)
        rows = [r for r in (oases_row, stock_row) if r]
        if rows:
            quick.append(min(rows, key=lambda r: r["iteration_time_s"]))
        oases_quick += [oases_row] if oases_row else []
        stock += [stock_row] if stock_row else []
        full += [full_row] if full_row else []
        if progress and (i + 1) % 20 == 0:
            progress(f"searched {i + 1}/{len(options)} layouts")
    if not quick:
        raise OasesConfigError(
            f"no layout of {gpus} GPUs fits this model in {memory_gb:g} GB per GPU; "
            "add GPUs or lower the global batch"
        )
    by_time = lambda r: r["iteration_time_s"]  # noqa: E731
    quick.sort(key=by_time)
    refined, plans = [], {}
    for row in quick[:top]:
        layout = Layout(**row["layout"])
        found = _refine(profiles[layout], layout, row, common, args.num_layers)
        if found:
            refined.append(found[0])
            plans[layout.name()] = found[1]
    # the best Oases layout: level two's fastest Oases row, or level one's fastest Oases layouts
    # planned in full with the Oases settings only (a layout whose fastest setting is stock keeps
    # no Oases row at level two)
    best_oases = min((r for r in refined if is_oases(r)), key=by_time, default=None)
    for row in sorted(oases_quick, key=by_time)[:STOCK_TOP]:
        layout = Layout(**row["layout"])
        found = _refine(profiles[layout], layout, row, common, args.num_layers, OASES_CHOICES)
        if found and (best_oases is None or by_time(found[0]) < by_time(best_oases)):
            best_oases = found[0]
            if layout.name() not in plans or not any(r["name"] == layout.name() for r in refined):
                plans[layout.name()] = found[1]
    if best_oases is not None and best_oases not in refined:
        refined.append(best_oases)  # beside the layout's stock row, if any
    # the best stock layout at any TP: level one's fastest stock layouts planned in full (stock
    # recompute settings, block recompute, stage splits; uniform degree)
    best_stock = min((r for r in refined if not is_oases(r)), key=by_time, default=None)
    stock_plan = plans[best_stock["name"]] if best_stock else None
    for row in sorted(stock, key=by_time)[:STOCK_TOP]:
        layout = Layout(**row["layout"])
        found = _refine(
            profiles[layout], layout, row, common, args.num_layers, STOCK_CHOICES, uniform=True
        )
        if found and (best_stock is None or by_time(found[0]) < by_time(best_stock)):
            best_stock, stock_plan = found
    if best_stock is not None:  # what plain Megatron-LM takes (no --oases-* flag)
        best_stock["stock_launch_flags"] = " ".join(
            best_stock["launch_flags"].replace("--oases-schedule off", "").split()
        )
    if best_stock is not None and best_stock not in refined:
        # beside an Oases row of the same layout, or in place of a slower stock one
        refined = [r for r in refined if r["name"] != best_stock["name"] or is_oases(r)]
        refined.append(best_stock)
    refined.sort(key=by_time)
    done = {r["name"] for r in refined}
    rest = [dict(r, level=1) for r in quick if r["name"] not in done]
    for r in rest:
        r["launch_flags"] = _flags(Layout(**r["layout"]), r, common)
    candidates = refined + rest
    winner = candidates[0]
    plan = stock_plan if winner is best_stock else plans[winner["name"]]
    thumb = rule_of_thumb(full, spec.gpus_per_node, profiles, common)
    ratio = None
    if best_stock is not None and best_oases is not None:
        ratio = by_time(best_stock) / by_time(best_oases)
    notes = []
    fsdp2 = sharding is True or "torch_fsdp2" in (sharding or ())
    if fsdp2 and any(o.dp > 1 for o in options) and not args.untie_embeddings_and_output_weights:
        notes.append(
            "torch FSDP2 not searched: this model ties its embedding and output weights (FSDP2 "
            "needs --untie-embeddings-and-output-weights, which trains another model); "
            "Megatron-FSDP's strategies were"
        )
    return {
        "gpus": gpus,
        "cluster": cluster,
        "memory_gb": memory_gb,
        "global_batch_size": global_batch_size,
        "layouts_searched": len(options),
        "candidates": candidates,
        "winner_plan": plan,
        "plans": plans,  # level 2's, for --verify-top
        "rule_of_thumb": thumb,
        "best_stock": best_stock,
        "best_oases": best_oases,
        # the best stock layout's predicted iteration ÷ the best Oases one's (> 1: Oases wins)
        "stock_over_oases": ratio,
        "notes": notes,
        "search_s": time.perf_counter() - t0,
    }


def _describe(r):
    opt = ", distributed optimizer" if r.get("distributed_optimizer") else ""
    if r.get("data_parallel_sharding"):
        opt = ", " + sharding_label(r["data_parallel_sharding"])
    setting = setting_name(r["schedule"], r["recompute"], r["recompute_num_layers"], r["split"])
    if r["degrees"] != [r["layout"]["tp"]]:
        setting += f" degrees {r['degrees']}"
    return f"{r['name']} {setting}{opt} ({r['iteration_time_s']:.3f} s)"


def verdict(result):
    """Lines naming the best Oases and the best stock layout and their ratio; where stock wins,
    one line saying so with stock's launch line."""
    o, s, ratio = result["best_oases"], result["best_stock"], result["stock_over_oases"]
    lines = [
        f"best Oases: {_describe(o) if o else 'none fits'}",
        f"best stock: {_describe(s) if s else 'none fits'}",
    ]
    if ratio is not None and ratio >= 1:
        lines.append(f"Oases over the best stock layout: {ratio:.2f}x")
    elif s is not None:
        faster = f"{1 / ratio:.2f}x faster than the best Oases layout" if ratio else "the only fit"
        who = "stock Megatron"
        if s.get("data_parallel_sharding"):
            who += f" with {sharding_label(s['data_parallel_sharding'])}"
        lines.append(
            f"{who} wins here: {s['name']} is {faster}; run stock Megatron-LM with: "
            f"{s['stock_launch_flags']}"
        )
    return lines


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
    stock = result.get("best_stock")
    if stock and stock is not w:
        parts.append(
            f"the best stock layout ({stock['name']}, "
            f"{setting_name('off', stock['recompute'], stock['recompute_num_layers'])}) takes "
            f"{stock['iteration_time_s'] / w['iteration_time_s']:.2f}x"
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
        if r.get("distributed_optimizer"):
            setting += " dist-opt"
        if r.get("data_parallel_sharding"):
            setting += " " + SHARDINGS[r["data_parallel_sharding"]].short
        bound = " host-bound" if r["host_bound"] else ""
        lines.append(
            f"{i:>3}  {r['name']:<22} {setting:<62} {r['iteration_time_s']:>11.3f} "
            f"{r['peak_memory_gb']:>7.2f}  {r['level']}{bound}"
        )
    return lines


__all__ = [
    "Layout",
    "layouts",
    "model_for_search",
    "search",
    "rule_of_thumb",
    "why_first",
    "verdict",
    "table",
    "is_oases",
]
