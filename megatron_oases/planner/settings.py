"""The run a plan is made for, as one frozen value: :class:`PlanSettings`, the planner's only
settings type.

Built once, from ``oases plan``'s flags (:meth:`PlanSettings.from_args`) or from a plan file's
recorded run merged with the flags (:meth:`PlanSettings.from_plan`, ``--evaluate``; the recorded
run itself is read by :func:`~megatron_oases.formats.plan.recorded_run`, which the runtime's
plan-versus-run warning reads too, without the planner), and passed down whole
to :func:`.api.make_plan`, :func:`.choose.choose_plan`, :func:`.prediction.predict` and
:func:`.build.build_problem`; a :class:`~.problem.ChainProblem` hands it back as
``problem.settings``. The checks that need no profile live in ``__post_init__``, one line each
naming the flag (or the plan's key, where the value is the plan's); those that need the profile
(batch over DP, degrees, pins) stay in :mod:`.build`.
"""

import json
import math
import numbers
from dataclasses import dataclass, field
from typing import Optional

from ..errors import OasesConfigError
from ..formats.plan import PLAN_KEYS, parse_degrees, parse_pins, recompute_mode, recorded_run
from ..recompute_settings import SELECTIVE_MODES
from ..validation import (
    check_schedule,
    check_schedule_recompute,
    check_split,
    check_whole_layer_recompute,
)
from .problem import DEFAULT_GRANULE, DEFAULT_MARGIN
from .sharding import check_sharding

#: ``schedule`` of a settings object whose schedule, recompute setting and split
#: :func:`.choose.choose_plan` chooses (``oases plan --schedule auto``).
AUTO = "auto"

#: The largest values the planner takes (far beyond any cluster: a bound, so that a mistyped
#: number is one line rather than a search that never returns or a float that overflows).
MAX_BATCH = 1 << 24  # samples, global or micro
MAX_MEMORY_GB = 1e5  # per rank
MAX_MARGIN = 10.0  # 1000 %
MAX_GRANULE = 1 << 30  # bytes (--granule-mb 1024); the least is one byte
MAX_HOST_US_PER_CALL = 1e6  # one second per aten call

#: Each field's flag, the name a message gives a value the user passed (or left at its default).
FLAGS = {
    "global_batch_size": "--global-batch-size",
    "micro_batch_size": "--micro-batch-size",
    "memory_gb": "--memory",
    "schedule": "--schedule",
    "recompute": "--recompute",
    "recompute_layers": "--recompute-num-layers",
    "split": "--split",
    "sequence_parallel": "--sequence-parallel",
    "distributed_optimizer": "--distributed-optimizer",
    "data_parallel_sharding": "--data-parallel-sharding",
    "grad_sync": "--grad-sync",
    "allow_unsplit": "--allow-unsplit",
    "margin": "--margin",
    "granule": "--granule-mb",
    "degrees": "--degrees",
    "pins": "--pin",
    "max_switches": "--max-switches",
    "host_us_per_call": "--host-us-per-call",
}
#: The fields whose flag, where given, wins over the plan's value (the others agree with it).
_FLAG_FIRST = ("global_batch_size", "micro_batch_size", "memory_gb")
#: The flags that cannot contradict a plan under ``--evaluate``, in the order they are checked.
_AGREE = (
    "global_batch_size",
    "micro_batch_size",
    "schedule",
    "recompute",
    "recompute_layers",
    "split",
    "sequence_parallel",
    "distributed_optimizer",
    "data_parallel_sharding",
)


def recompute_label(value, recompute_num_layers=None):
    """``"no"``, ``"selective"``, ``"selective+ln"``, ``"full"`` or ``"first-N-layers full"``
    (block method): the setting as text says it (``… recompute``)."""
    mode = recompute_mode(value)
    if mode == "full" and recompute_num_layers is not None:
        return f"first-{recompute_num_layers}-layers full"
    return "no" if mode == "none" else mode


def _number_in(value, low, high, low_open=False):
    """Whether ``value`` is a finite number in [low, high] (``low_open``: above ``low``)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        return False
    if not math.isfinite(value):
        return False
    return (value > low if low_open else value >= low) and value <= high


def _count_in(value, low, high):
    """Whether ``value`` is an integer in [low, high]."""
    ok = isinstance(value, numbers.Integral) and not isinstance(value, bool)
    return ok and low <= value <= high


@dataclass(frozen=True)
class PlanSettings:
    """One run's settings, as ``oases plan``'s flags name them. ``recompute`` is normalised by
    :func:`recompute_mode` (None: ``full``); ``recompute_layers``: Megatron's
    ``--recompute-num-layers`` under ``--recompute-method block``; ``granule`` in bytes;
    ``degrees`` (candidates, None: the profile's) and ``pins`` (``((layers, degree), ...)``) are
    the search's constraints. With ``schedule="auto"`` the schedule, the recompute setting and
    (where ``split`` is None) the split are left to :func:`.choose.choose_plan`.
    ``data_parallel_sharding``: torch FSDP2 or a Megatron-FSDP strategy (None: none; the names
    of :data:`~megatron_oases.formats.plan.DATA_PARALLEL_SHARDINGS`, the rules in
    :mod:`.sharding`).

    ``global_batch_size`` None: not known (a plan that records none); planning needs it. The
    parallel sizes (``tensor_model_parallel_size``, ``data_parallel_size``,
    ``pipeline_model_parallel_size``) are the layout the run is for, None: the profile's (a plan
    records them; :mod:`.build` refuses a profile of another layout). ``sources``: where values
    came from, ``((field, source), ...)``: a flag (``"--no-recompute"``) or a plan file's key
    (``"plan p.json's micro_batch_size"``); not part of the value (equality, hash)."""

    global_batch_size: Optional[int] = None
    micro_batch_size: Optional[int] = None
    memory_gb: Optional[float] = None
    schedule: str = "oases"
    recompute: Optional[str] = None
    recompute_layers: Optional[int] = None
    split: Optional[str] = None
    sequence_parallel: bool = False
    distributed_optimizer: bool = False
    data_parallel_sharding: Optional[str] = None
    grad_sync: bool = False
    allow_unsplit: bool = False
    margin: float = DEFAULT_MARGIN
    granule: float = DEFAULT_GRANULE
    degrees: Optional[tuple] = None
    pins: tuple = ()
    max_switches: Optional[int] = None
    host_us_per_call: Optional[float] = None
    tensor_model_parallel_size: Optional[int] = None
    data_parallel_size: Optional[int] = None
    pipeline_model_parallel_size: Optional[int] = None
    sources: tuple = field(default=(), compare=False, repr=False)

    def __post_init__(self):
        fix = object.__setattr__  # frozen: normalise once, here
        fix(self, "degrees", None if self.degrees is None else tuple(self.degrees))
        fix(self, "pins", tuple((tuple(layers), d) for layers, d in self.pins or ()))
        fix(self, "sources", tuple(dict(self.sources).items()))
        for flag in ("sequence_parallel", "distributed_optimizer", "grad_sync", "allow_unsplit"):
            fix(self, flag, bool(getattr(self, flag)))
        if self.split is not None:
            check_split(self.split, source=self.source("split"))
        if self.schedule == AUTO:
            self._check_auto()
        else:
            self._check_setting()
        self._check_numbers()
        if self.data_parallel_sharding is not None:
            check_sharding(self)

    def source(self, name):
        """Where field ``name``'s value came from, as a message names it: the plan file's key
        where it is the plan's, else the flag (given or left at its default)."""
        return dict(self.sources).get(name) or FLAGS.get(name, name)

    def recorded(self, name):
        """Whether field ``name``'s value is a plan file's (:meth:`from_plan`)."""
        return not dict(self.sources).get(name, "--").startswith("--")

    def _check_auto(self):
        if self.recompute is not None or self.recompute_layers is not None:
            flag = "--recompute-num-layers" if self.recompute_layers else "--recompute"
            raise OasesConfigError(f"--schedule auto chooses the recompute setting; drop {flag}")

    def _check_setting(self):
        """One schedule with one recompute setting: the pair must be one the runtime runs."""
        check_schedule(self.schedule, source="--schedule")
        object.__setattr__(self, "split", self.split or "batch")
        recompute = recompute_mode(self.recompute, source="--recompute")
        object.__setattr__(self, "recompute", recompute)
        if recompute in SELECTIVE_MODES:
            check_whole_layer_recompute(
                self.schedule,
                flag="--schedule",
                fix=f"use --recompute full, or --schedule off or overlap with --recompute {recompute}",
            )
        check_schedule_recompute(
            self.schedule, recompute == "full", flag="--schedule", fix="use --recompute full"
        )

    def _check_numbers(self):
        """Finite, positive where a size, and bounded (:data:`MAX_BATCH` ...): one line each."""

        def fail(name, what, value=None):
            value = getattr(self, name) if value is None else value
            raise OasesConfigError(f"{self.source(name)} must be {what}, got {value!r}")

        for name in ("global_batch_size", "micro_batch_size"):
            value = getattr(self, name)
            if value is not None and not _count_in(value, 1, MAX_BATCH):
                fail(name, f"a positive integer of at most {MAX_BATCH}")
        if self.memory_gb is not None and not _number_in(self.memory_gb, 0, MAX_MEMORY_GB, True):
            fail("memory_gb", f"positive and finite, at most {MAX_MEMORY_GB:g} GB")
        if not _number_in(self.margin, 0, MAX_MARGIN):
            fail("margin", f"≥ 0 and finite, at most {MAX_MARGIN:g} ({MAX_MARGIN:.0%})")
        if not _number_in(self.granule, 1, MAX_GRANULE):  # bytes; the flag is in MiB
            mib = self.granule / (1 << 20) if isinstance(self.granule, numbers.Real) else None
            fail("granule", f"from {1 / (1 << 20):.3g} (a byte) to {MAX_GRANULE >> 20}", mib)
        host = self.host_us_per_call
        if host is not None and not _number_in(host, 0, MAX_HOST_US_PER_CALL):
            fail("host_us_per_call", f">= 0 (0: no host term) and at most {MAX_HOST_US_PER_CALL:g}")
        if self.max_switches is not None and not _count_in(self.max_switches, 0, math.inf):
            fail("max_switches", "≥ 0")

    @classmethod
    def from_args(cls, args):
        """``oases plan``'s flags (not ``--evaluate``, not ``--gpus``) as one settings object."""
        if args.global_batch_size is None:
            raise OasesConfigError("--global-batch-size is required")
        recompute = recompute_flag(args)
        if args.schedule == AUTO and args.no_recompute:
            raise OasesConfigError(
                "--schedule auto chooses the recompute setting; drop "
                + ("--recompute-num-layers" if args.recompute_num_layers else "--no-recompute")
            )
        return cls(
            global_batch_size=args.global_batch_size,
            micro_batch_size=args.micro_batch_size,
            memory_gb=args.memory,
            schedule=args.schedule or "oases",
            recompute=recompute,
            recompute_layers=args.recompute_num_layers,
            split=args.split,
            sequence_parallel=args.sequence_parallel,
            distributed_optimizer=args.distributed_optimizer,
            data_parallel_sharding=getattr(args, "data_parallel_sharding", None),
            grad_sync=args.grad_sync,
            allow_unsplit=args.allow_unsplit,
            margin=args.margin,
            granule=args.granule_mb * (1 << 20),
            degrees=parse_degrees(args.degrees),
            pins=parse_pins(args.pin),
            max_switches=args.max_switches,
            host_us_per_call=args.host_us_per_call,
        )

    @classmethod
    def from_plan(cls, plan, args=None, path="plan"):
        """The run ``plan`` (a plan file's dict, at ``path``) was made for, merged with ``args``
        (``oases plan``'s flags, or any object with some of their attribute names; None: no
        flags): the plan's recorded run (:func:`~megatron_oases.formats.plan.recorded_run`, which
        the runtime reads alone) merged with them: each field the plan's where it records one,
        else the flag's (or the default); batch sizes and memory the flags' first (where both are given
        they agree), margin and host cost the flags'. A flag that contradicts what the plan
        records is one line naming both (a prediction of another run would be a silent wrong
        answer). ``sources`` names the plan's key or the flag of each value, for messages and for
        :meth:`recorded`. Without flags, a plan whose recorded run cannot be planned is one line
        naming the file."""
        given = _given_flags(args)
        run = recorded_run(plan, path)  # the plan's half: formats/plan.py, the runtime's reader
        _check_flags_agree(plan, run, given, path)
        values, sources = {}, {}
        for name in PLAN_KEYS:
            if run.recorded(name) and not (name in _FLAG_FIRST and name in given):
                values[name], sources[name] = getattr(run, name), run.source(name)
            elif name in given:
                values[name], sources[name] = given[name][0], _flag_of(name, given)
        for name in ("margin", "host_us_per_call"):
            if name in given:
                values[name], sources[name] = given[name][0], _flag_of(name, given)
        if values.get("schedule") == AUTO:  # only a flag says auto: the plan records none
            raise OasesConfigError(
                f"--evaluate predicts one schedule and plan {path} records none; pass --schedule "
                "off, overlap, cross-pass or oases"
            )
        values["recompute"] = recompute_mode(values.get("recompute"), f"{path}")
        values["allow_unsplit"] = bool(plan.get("allow_unsplit")) or "allow_unsplit" in given
        predicted = plan.get("predicted")
        included = isinstance(predicted, dict) and bool(predicted.get("grad_sync_included"))
        values["grad_sync"] = included or "grad_sync" in given
        if plan.get("degrees"):
            values["degrees"] = sorted(set(plan["degrees"]))
        try:
            return cls(**values, sources=tuple(sources.items()))
        except OasesConfigError as exc:
            if args is not None:
                raise
            raise OasesConfigError(  # the plan alone: name the file, not a flag
                f"plan {path} records a run that cannot be planned ({exc}); edit or re-plan it"
            ) from None


def _given_flags(args):
    """``{field: (value, flag)}`` of the flags ``args`` gives (None, False and the default
    margin: not given); ``recompute``'s flag is the one typed (``--no-recompute``)."""
    if args is None:
        return {}
    get = lambda name: getattr(args, name, None)  # noqa: E731
    given = {}
    for name, attr in (
        ("global_batch_size", "global_batch_size"),
        ("micro_batch_size", "micro_batch_size"),
        ("schedule", "schedule"),
        ("recompute_layers", "recompute_num_layers"),
        ("split", "split"),
        ("sequence_parallel", "sequence_parallel"),
        ("distributed_optimizer", "distributed_optimizer"),
        ("data_parallel_sharding", "data_parallel_sharding"),
        ("allow_unsplit", "allow_unsplit"),
        ("grad_sync", "grad_sync"),
        ("memory_gb", "memory"),
        ("host_us_per_call", "host_us_per_call"),
    ):
        value = get(attr)
        if value is not None and value is not False:
            flag = FLAGS[name] if isinstance(value, bool) else f"{FLAGS[name]} {value}"
            given[name] = (value, flag)
    recompute = recompute_flag(args) if hasattr(args, "no_recompute") else get("recompute")
    if recompute is not None:
        given["recompute"] = (
            recompute,
            "--no-recompute" if get("no_recompute") else f"--recompute {recompute}",
        )
    margin = get("margin")
    if margin is not None and margin != DEFAULT_MARGIN:
        given["margin"] = (margin, f"--margin {margin}")
    return given


def _flag_of(name, given):
    """The flag a message names for a given value: ``--micro-batch-size``, ``--no-recompute``."""
    return given[name][1].split(" ")[0] if name == "recompute" else FLAGS[name]


def _check_flags_agree(plan, run, given, path):
    """No flag the user passed contradicts what the plan records (``run``: its
    :func:`~megatron_oases.formats.plan.recorded_run`)."""
    for name in _AGREE:
        key = PLAN_KEYS[name]
        if name not in given or not run.recorded(name):
            continue
        value, flag = given[name]
        if getattr(run, name) != value:
            raise OasesConfigError(
                f"{flag} contradicts plan {path}, made for {key} {json.dumps(plan[key])}; drop "
                f"the flag to evaluate the plan as made, or re-plan with {flag}"
            )


def recompute_flag(args):
    """``--recompute`` / ``--no-recompute`` as one setting (None: not given)."""
    if args.no_recompute and args.recompute not in (None, "none"):
        raise OasesConfigError(
            f"--no-recompute contradicts --recompute {args.recompute}; drop one of them"
        )
    return "none" if args.no_recompute else args.recompute
