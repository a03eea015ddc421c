"""One ``oases compare`` run's settings, as one frozen value: :class:`CompareSettings`.

Built once (the CLI: :meth:`CompareSettings.from_args`; a library caller: the constructor) and
passed whole to :func:`.session.run_comparison`. The checks that need no Megatron parse, no
cluster profile and no run live in ``__post_init__``, one :class:`OasesConfigError` line each
naming the flag; those that need Megatron's parse of the flags (every variant validated, PP under
``--one-rank``) come first in :func:`.session.run_comparison`, still before any run.
"""

import os
import shlex
from dataclasses import dataclass, fields
from typing import Optional

from ..errors import OasesConfigError
from ..outputs import check_output_dir
from .variants import DEFAULT_VARIANTS, MEMORY_VARIANTS, RESERVED, parse_variants

#: ``--out``'s default.
DEFAULT_OUT = "oases-compare"


def has_flag(argv, flag):
    """``flag`` is in ``argv``, as ``flag VALUE`` or ``flag=VALUE``."""
    return any(a == flag or a.startswith(flag + "=") for a in argv)


@dataclass(frozen=True)
class CompareSettings:
    """Every setting of one comparison, named as ``oases compare``'s flags name them.

    ``train_argv``: the Megatron-LM flags given to every variant's ``oases train`` run (what
    follows ``--``). ``variants`` (``--variants``): names, as a sequence or comma-separated; None:
    the default set (another one with ``memory_budget``). ``memory_budget`` (``--memory-budget``):
    GB values, as a sequence or comma-separated, or None. ``nproc`` (None: TP x PP x CP of the
    flags, at least 2), ``one_rank``, ``emulate_link`` (a profile name or path), ``oases_plan``
    (a path; made absolute), ``warmup``, ``iters``, ``loss_rtol`` (None: by dropout),
    ``threads_per_rank`` (None: a rank's share of the CPUs), ``repeats``, ``host_pass`` (False:
    ``--no-host-pass``), ``timeout`` (seconds per variant run), ``force`` (write over the results
    ``out`` holds), ``command`` (the command line results.json records; None: the equivalent
    :meth:`command_line`)."""

    train_argv: tuple = ()
    out: str = DEFAULT_OUT
    variants: Optional[tuple] = None
    memory_budget: Optional[tuple] = None
    nproc: Optional[int] = None
    one_rank: bool = False
    emulate_link: Optional[str] = None
    oases_plan: Optional[str] = None
    warmup: int = 2
    iters: int = 3
    loss_rtol: Optional[float] = None
    threads_per_rank: Optional[int] = None
    repeats: int = 1
    host_pass: bool = True
    timeout: float = 3600.0
    force: bool = False
    command: Optional[str] = None

    def __post_init__(self):
        fix = object.__setattr__  # frozen: normalise once, here
        # Every check before any expensive work: a bad flag costs one line, not a run.
        check_output_dir(self.out)  # a finished comparison must have somewhere to go
        train_argv = _shared_train_flags(list(self.train_argv))
        fix(self, "train_argv", tuple(train_argv))
        fix(self, "nproc", resolve_nproc(self.nproc, train_argv))
        if self.nproc < 1 or self.iters < 1 or self.warmup < 0 or self.repeats < 1:
            raise OasesConfigError("--nproc, --iters and --repeats must be >= 1 and --warmup >= 0")
        if self.one_rank and not self.emulate_link:
            raise OasesConfigError(
                "--one-rank needs --emulate-link PROFILE: without it the virtual ranks' "
                "collectives take no time and the comparison means nothing"
            )
        budgets = self.memory_budget
        if budgets is not None:
            from .memory import parse_budgets

            spec = budgets if isinstance(budgets, str) else ",".join(str(b) for b in budgets)
            budgets = tuple(parse_budgets(spec))
        fix(self, "memory_budget", budgets)
        spec = self.variants
        if spec is not None and not isinstance(spec, str):
            spec = ",".join(spec)
        variants = parse_variants(spec, MEMORY_VARIANTS if budgets else DEFAULT_VARIANTS)
        fix(self, "variants", tuple(v.name for v in variants))
        plan = os.path.abspath(self.oases_plan) if self.oases_plan else None
        if plan and not any(v.needs_plan for v in variants):
            raise OasesConfigError(
                "--oases-plan is used by the oases+planner variant only; add it to --variants"
            )
        fix(self, "oases_plan", plan)

    @classmethod
    def from_args(cls, own, train_argv, argv):
        """The settings of ``oases compare``'s parsed flags ``own``, the rest ``train_argv`` and
        the whole command line ``argv`` (recorded in results.json)."""
        return cls(
            train_argv=tuple(train_argv),
            out=own.out,
            variants=own.variants,
            memory_budget=own.memory_budget,
            nproc=own.nproc,
            one_rank=own.one_rank,
            emulate_link=own.emulate_link,
            oases_plan=own.oases_plan,
            warmup=own.warmup,
            iters=own.iters,
            loss_rtol=own.loss_rtol,
            threads_per_rank=own.threads_per_rank,
            repeats=own.repeats,
            host_pass=not own.no_host_pass,
            timeout=own.timeout,
            force=own.force,
            command="oases compare " + shlex.join(argv),
        )

    def command_line(self):
        """``command``, or the ``oases compare`` command line these settings stand for."""
        if self.command:
            return self.command
        argv = []
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name in ("train_argv", "command") or value == f.default:
                continue
            flag = "--" + f.name.replace("_", "-")
            if f.name == "host_pass":
                argv.append("--no-host-pass")
            elif value is True:
                argv.append(flag)
            elif isinstance(value, tuple):
                argv += [flag, ",".join(str(x) for x in value)]
            else:
                argv += [flag, str(value)]
        return "oases compare " + shlex.join(argv + ["--", *self.train_argv])


def _shared_train_flags(train_argv):
    """The flags after ``--``, refused where they hold one compare sets itself."""
    if train_argv and train_argv[0] == "--":
        train_argv = train_argv[1:]
    for flag in RESERVED:
        if has_flag(train_argv, flag):
            if flag == "--oases-plan":
                raise OasesConfigError(
                    "pass --oases-plan as a flag of oases compare (before --): it is given to the "
                    "oases+planner variant only"
                )
            raise OasesConfigError(f"oases compare sets {flag} itself; drop it from the flags")
    return train_argv


def resolve_nproc(nproc, train_argv):
    """``--nproc``, or when not given the model-parallel size of the flags (TP x PP x CP, at
    least 2): a world size the user never gave must not be the one Megatron's error names."""
    from ..arguments import flag_value

    sizes = {}
    for flag in (
        "--tensor-model-parallel-size",
        "--pipeline-model-parallel-size",
        "--context-parallel-size",
    ):
        value = flag_value(train_argv, flag) or "1"
        try:
            sizes[flag] = int(value)
        except ValueError:
            raise OasesConfigError(f"{flag} {value}: not an integer") from None
    model_parallel = 1
    for size in sizes.values():
        model_parallel *= max(1, size)
    if nproc is None:
        return max(2, model_parallel)
    if nproc >= 1 and nproc % model_parallel:
        raise OasesConfigError(
            f"--nproc {nproc} is not a multiple of the model-parallel size {model_parallel} "
            "(tensor x pipeline x context parallel); use --nproc "
            f"{model_parallel * max(1, nproc // model_parallel)} or leave --nproc out"
        )
    return nproc
