"""``oases plan --schedule auto``: choose the schedule and the recompute setting with the degrees.

The comparison a user makes is "the fastest thing that fits my memory": stock Megatron keeping
every activation, with selective recomputation of core attention (and of the norms' outputs) or
with full recomputation, or an overlapped schedule. Each (schedule, recompute) setting of :data:`SETTINGS` is planned in turn
(its own per-layer degrees under the same memory limit); the fastest predicted plan that fits
wins, and the plan records every setting tried (``alternatives``) and the Megatron flags that run
the winner (``launch_flags``). Recompute settings are
:data:`~megatron_oases.recompute_settings.RECOMPUTE_MODES`: ``selective`` (Megatron's
``--recompute-granularity selective --recompute-modules core_attn``) and ``selective+ln`` (also
``layernorm``) are planned for ``off`` and ``overlap``, the schedules whose runtime supports them; ``cross-pass``
and ``oases`` recompute whole layers (``full``) by construction.

Full recomputation is also planned per layer where it pays: Megatron's ``--recompute-method block
--recompute-num-layers N`` recomputes only each stage's first N layers and the others keep their
activations. Fewer recomputed layers cost less time and more memory (or, to fit, higher degrees: more
communication), so for each schedule every N that fits is planned and the fastest is kept (one
entry per schedule in ``alternatives``).

Each overlapped setting is also planned with sub-batches of sequence chunks (``--oases-split
sequence``, every layer at T): the only split of a micro-batch of one sample, and a lighter one
where causal attention is a large share (the earlier chunk attends to half as many keys).
``split`` restricts the search to one kind.

Every setting's predicted iteration is the longer of the device's and the host's timelines
(:mod:`.host_model`): a split that makes the host issue more calls than the device can keep up with
loses to stock, and the alternatives table marks such settings host-bound.
"""

from dataclasses import replace

from ..errors import OasesConfigError
from ..recompute_settings import RECOMPUTE_ARGV, block_argv
from ..validation import SPLIT_SCHEDULES
from .api import NoPlanFits, make_plan
from .ilp import DEFAULT_TIME_LIMIT_S
from .settings import recompute_label, recompute_mode
from .sharding import launch_flags as sharding_flags

#: (schedule, recompute) settings, cheapest memory last.
SETTINGS = (
    ("off", "none"),
    ("overlap", "none"),
    ("off", "selective"),
    ("overlap", "selective"),
    ("off", "selective+ln"),
    ("overlap", "selective+ln"),
    ("off", "full"),
    ("overlap", "full"),
    ("cross-pass", "full"),
    ("oases", "full"),
)
#: Megatron's flags per recompute setting.
RECOMPUTE_FLAGS = {mode: " ".join(argv) for mode, argv in RECOMPUTE_ARGV.items()}


def launch_flags(schedule, recompute, recompute_num_layers=None, split="batch"):
    """The flags that select ``schedule`` with Megatron's ``recompute`` setting (``"none"``,
    ``"selective"``, ``"selective+ln"``, ``"full"``; a bool is the older form: True full, False none);
    ``recompute_num_layers``: full recompute of only each stage's first that many layers;
    ``split``: ``"sequence"`` adds ``--oases-split sequence``."""
    if recompute_num_layers is not None:
        flags = " ".join(block_argv(recompute_num_layers))
    else:
        flags = RECOMPUTE_FLAGS[recompute_mode(recompute)]
    if split == "sequence":
        flags = f"{flags} --oases-split sequence".strip()
    return f"--oases-schedule {schedule}" + (f" {flags}" if flags else "")


def setting_name(schedule, recompute, recompute_num_layers=None, split="batch"):
    """``"overlap (selective recompute)"``: a setting as the table and messages name it."""
    chunks = ", sequence chunks" if split == "sequence" else ""
    if recompute_num_layers is not None:
        return f"{schedule} (full recompute, first {recompute_num_layers} layers{chunks})"
    return f"{schedule} ({recompute_label(recompute)} recompute{chunks})"


def _setting(entry):
    """(schedule, recompute, recompute_num_layers, split) of an ``alternatives`` entry."""
    return (
        entry["schedule"],
        entry["recompute"],
        entry.get("recompute_num_layers"),
        entry.get("split", "batch"),
    )


def choose_plan(
    profile,
    settings,
    *,
    candidates=SETTINGS,
    solver="dp",
    verify=False,
    time_limit_s=DEFAULT_TIME_LIMIT_S,
):
    """Plan every (schedule, recompute) pair of ``candidates`` (default :data:`SETTINGS`; the
    overlapped ones with each split kind, only ``settings.split`` where set) for the run
    ``settings`` (:class:`~.settings.PlanSettings`, usually with ``schedule="auto"``: its
    schedule, recompute setting and, where None, split are the ones tried); returns (plan,
    problem, solution) of the fastest that fits."""
    base = settings
    split = base.split  # None: both kinds
    solve_options = dict(solver=solver, verify=verify, time_limit_s=time_limit_s)
    best, tried = None, []

    def attempt(schedule, recompute, layers=None, kind="batch"):
        """(entry for ``tried``, result or None where it does not fit) of one setting."""
        entry = {"schedule": schedule, "recompute": recompute}
        if layers is not None:
            entry["recompute_num_layers"] = layers
        if kind != "batch":
            entry["split"] = kind
        try:
            one = replace(
                base, schedule=schedule, recompute=recompute, recompute_layers=layers, split=kind
            )
            result = make_plan(profile, one, **solve_options)
        except OasesConfigError as exc:  # does not fit, or cannot split this micro-batch
            need = exc.need_gb if isinstance(exc, NoPlanFits) else None
            return dict(entry, fits=False, why=str(exc), need_gb=need), None
        p = result[0]["predicted"]
        entry.update(
            fits=True,
            degrees=result[0]["degrees"],
            iteration_time_s=p["iteration_time_s"],
            peak_memory_bytes_per_rank=p["peak_memory_bytes_per_rank"],
        )
        if p.get("host"):  # the iteration is the longer of the device's and host's timelines
            entry.update(device_time_s=p["device_time_s"], host_bound=p["host"]["host_bound"])
        return entry, result

    for schedule, recompute in candidates:
        kinds = ("batch", "sequence") if schedule in SPLIT_SCHEDULES else ("batch",)
        for kind in kinds if split is None else [k for k in kinds if k == split]:
            entry, result = attempt(schedule, recompute, kind=kind)
            found = [(entry, result)]
            if result is not None and recompute == "full":
                found += _block_settings(attempt, schedule, result[1].num_layers, kind)
            for entry, result in found:
                tried.append(entry)
                t = entry.get("iteration_time_s")
                if result is not None and (
                    best is None or t < best[0]["predicted"]["iteration_time_s"]
                ):
                    best = result
    if best is None:
        needs = [t for t in tried if t["need_gb"] is not None]
        if not needs:
            raise OasesConfigError(f"no setting can be planned: {tried[-1]['why']}")
        t = min(needs, key=lambda t: t["need_gb"])
        raise NoPlanFits(
            f"no schedule and recompute setting fits in {base.memory_gb} GB; the "
            f"smallest memory that fits is {t['need_gb']:.2f} GB "
            f"({launch_flags(*_setting(t))})",
            need_gb=t["need_gb"],
        )
    plan = best[0]
    plan["alternatives"] = tried
    plan["launch_flags"] = launch_flags(
        plan["schedule"], plan["recompute"], plan.get("recompute_num_layers"), plan["split"]
    )
    if plan.get("distributed_optimizer"):
        plan["launch_flags"] += " --use-distributed-optimizer"
    if plan.get("data_parallel_sharding"):
        plan["launch_flags"] += " " + sharding_flags(plan["data_parallel_sharding"])
    return best


def _block_settings(attempt, schedule, L, kind):
    """The fastest block-recompute setting of ``schedule`` that fits, as ``[(entry, result)]``
    (empty if none does). Each N from L−1 down is planned until one does not fit: fewer
    recomputed layers need more memory, so no smaller N fits either. Fewer is not always faster:
    to fit, the planner may have to raise some layers' degrees (more communication)."""
    fastest = None
    for n in range(L - 1, 0, -1):
        entry, result = attempt(schedule, "full", n, kind)
        if result is None:
            break
        if fastest is None or entry["iteration_time_s"] < fastest[0]["iteration_time_s"]:
            fastest = (entry, result)
    return [fastest] if fastest else []


def alternatives_table(plan):
    """The settings tried, fastest first, as text lines (``recompute`` of plans written before
    selective recomputation was planned is a bool: read as full / none)."""
    rows = sorted(
        plan.get("alternatives", ()),
        key=lambda t: (not t["fits"], t.get("iteration_time_s", 0.0)),
    )
    names = [setting_name(*_setting(t)) for t in rows]
    w = max([32] + [len(n) for n in names])
    lines = [f"{'setting':<{w}} iteration ms  peak GB/rank  degrees"]
    for name, t in zip(names, rows):
        if t["fits"]:
            degrees = sorted(set(t["degrees"]))
            lines.append(
                f"{name:<{w}} {t['iteration_time_s'] * 1e3:>12.2f}  "
                f"{t['peak_memory_bytes_per_rank'] / 1e9:>12.2f}  {degrees}"
                + (
                    f"  host-bound (device {t['device_time_s'] * 1e3:.2f} ms)"
                    if t.get("host_bound")
                    else ""
                )
            )
        else:
            lines.append(f"{name:<{w}} {'does not fit':>12}")
    return lines
