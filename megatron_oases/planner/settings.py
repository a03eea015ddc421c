"""The run a plan is made for, as one frozen value: :class:`PlanSettings`.

Built once (``oases plan``: :meth:`PlanSettings.from_args`; ``--evaluate``: read back from the plan
file by :func:`.evaluate.evaluated_run`) and passed down whole to :func:`.api.make_plan`,
:func:`.choose.choose_plan`, :func:`.prediction.predict` and :func:`.build.build_problem`; a
:class:`~.problem.ChainProblem` hands it back as ``problem.settings``. The checks that need no
profile live in ``__post_init__``, one line each naming the flag; those that need the profile
(batch over DP, degrees, pins) stay in :mod:`.build`.
"""

from dataclasses import dataclass, replace
from typing import Optional

from ..errors import OasesConfigError
from ..recompute_settings import RECOMPUTE_MODES, SELECTIVE_MODES
from ..validation import (
    check_schedule,
    check_schedule_recompute,
    check_split,
    check_whole_layer_recompute,
)
from .problem import DEFAULT_GRANULE, DEFAULT_MARGIN

#: ``schedule`` of a settings object whose schedule, recompute setting and split
#: :func:`.choose.choose_plan` chooses (``oases plan --schedule auto``).
AUTO = "auto"


def recompute_mode(value, source="recompute"):
    """``value`` as one of :data:`RECOMPUTE_MODES`. Booleans are the older form (plans written
    before selective recomputation was planned, ``recompute=True`` callers): True is ``full``,
    False ``none``; None is the default, ``full``."""
    if value is None or value is True:
        return "full"
    if value is False:
        return "none"
    if value in RECOMPUTE_MODES:
        return value
    raise OasesConfigError(
        f"{source}: unknown recompute setting {value!r}; choose one of {', '.join(RECOMPUTE_MODES)}"
    )


def recompute_label(value, recompute_num_layers=None):
    """``"no"``, ``"selective"``, ``"selective+ln"``, ``"full"`` or ``"first-N-layers full"``
    (block method): the setting as text says it (``… recompute``)."""
    mode = recompute_mode(value)
    if mode == "full" and recompute_num_layers is not None:
        return f"first-{recompute_num_layers}-layers full"
    return "no" if mode == "none" else mode


@dataclass(frozen=True)
class PlanSettings:
    """One run's settings, as ``oases plan``'s flags name them. ``recompute`` is normalised by
    :func:`recompute_mode` (None: ``full``); ``recompute_layers``: Megatron's
    ``--recompute-num-layers`` under ``--recompute-method block``; ``granule`` in bytes;
    ``degrees`` (candidates, None: the profile's) and ``pins`` (``((layers, degree), ...)``) are
    the search's constraints. With ``schedule="auto"`` the schedule, the recompute setting and
    (where ``split`` is None) the split are left to :func:`.choose.choose_plan`."""

    global_batch_size: int
    micro_batch_size: Optional[int] = None
    memory_gb: Optional[float] = None
    schedule: str = "oases"
    recompute: Optional[str] = None
    recompute_layers: Optional[int] = None
    split: Optional[str] = None
    sequence_parallel: bool = False
    distributed_optimizer: bool = False
    grad_sync: bool = False
    allow_unsplit: bool = False
    margin: float = DEFAULT_MARGIN
    granule: float = DEFAULT_GRANULE
    degrees: Optional[tuple] = None
    pins: tuple = ()
    max_switches: Optional[int] = None
    host_us_per_call: Optional[float] = None

    def __post_init__(self):
        fix = object.__setattr__  # frozen: normalise once, here
        fix(self, "degrees", None if self.degrees is None else tuple(self.degrees))
        fix(self, "pins", tuple((tuple(layers), d) for layers, d in self.pins or ()))
        for flag in ("sequence_parallel", "distributed_optimizer", "grad_sync", "allow_unsplit"):
            fix(self, flag, bool(getattr(self, flag)))
        if self.split is not None:
            check_split(self.split, source="--split")
        if self.schedule == AUTO:
            self._check_auto()
        else:
            self._check_setting()
        if self.memory_gb is not None and self.memory_gb <= 0:
            raise OasesConfigError("--memory must be positive")
        if self.margin < 0:
            raise OasesConfigError("--margin must be ≥ 0")
        if self.granule <= 0:
            raise OasesConfigError("--granule-mb must be positive")
        if self.host_us_per_call is not None and self.host_us_per_call < 0:
            raise OasesConfigError("--host-us-per-call must be >= 0 (0: no host term)")
        if self.max_switches is not None and self.max_switches < 0:
            raise OasesConfigError("--max-switches must be ≥ 0")

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

    @classmethod
    def of(cls, settings=None, **overrides):
        """``settings`` with keyword ``overrides``, or a new object of them alone: the keyword
        form the planner's entry points still accept (``make_plan(profile, memory_gb=24, ...)``)."""
        if settings is None:
            return cls(**overrides)
        return replace(settings, **overrides) if overrides else settings

    @classmethod
    def from_args(cls, args):
        """``oases plan``'s flags (not ``--evaluate``, not ``--gpus``) as one settings object."""
        from ..formats.plan import parse_degrees
        from .api import parse_pins

        if args.global_batch_size is None:
            raise OasesConfigError("--global-batch-size is required")
        recompute = recompute_flag(args)
        schedule = args.schedule or "oases"
        if schedule == AUTO and args.no_recompute:
            raise OasesConfigError(
                "--schedule auto chooses the recompute setting; drop "
                + ("--recompute-num-layers" if args.recompute_num_layers else "--no-recompute")
            )
        return cls(
            global_batch_size=args.global_batch_size,
            micro_batch_size=args.micro_batch_size,
            memory_gb=args.memory,
            schedule=schedule,
            recompute=recompute,
            recompute_layers=args.recompute_num_layers,
            split=args.split,
            sequence_parallel=args.sequence_parallel,
            distributed_optimizer=args.distributed_optimizer,
            grad_sync=args.grad_sync,
            allow_unsplit=args.allow_unsplit,
            margin=args.margin,
            granule=args.granule_mb * (1 << 20),
            degrees=parse_degrees(args.degrees),
            pins=parse_pins(args.pin),
            max_switches=args.max_switches,
            host_us_per_call=args.host_us_per_call,
        )


def recompute_flag(args):
    """``--recompute`` / ``--no-recompute`` as one setting (None: not given)."""
    if args.no_recompute and args.recompute not in (None, "none"):
        raise OasesConfigError(
            f"--no-recompute contradicts --recompute {args.recompute}; drop one of them"
        )
    return "none" if args.no_recompute else args.recompute
