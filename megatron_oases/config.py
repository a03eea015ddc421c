"""The Oases settings of one run, parsed and checked once (:meth:`OasesConfig.from_args`), then
passed down as an argument: to the patches (:mod:`.patches`), the per-layer runtime
(:mod:`.hetero.runtime`) and the attention swap (:mod:`.attention`), through one door
(:mod:`.prepare`) that both entry points (``oases-pretrain-gpt``, Megatron-LM's patched
``pretrain_gpt.py``) share."""

import enum
from dataclasses import dataclass
from typing import Optional

from .validation import (
    SUB_BATCHES,
    check_oases_args,
    plan_differences,
    split_kind,
    sub_batches,
)


class Schedule(enum.StrEnum):
    """``--oases-schedule`` (see ``docs/schedules.md``); compares equal to its flag value."""

    OFF = "off"
    OVERLAP = "overlap"
    CROSS_PASS = "cross-pass"
    OASES = "oases"


@dataclass(frozen=True)
class OasesConfig:
    """What the ``--oases-*`` flags ask for, checked against the model and the batch.

    ``plan``: the ``--oases-plan`` file's contents (read and checked once), or None.
    ``tensor_model_parallel_size``: the TMP domain a plan's degrees divide. ``cuda_graphs``:
    ``--oases-cuda-graphs``'s mode (``capture``, ``eager``) or None."""

    schedule: Schedule = Schedule.OFF
    sub_batches: int = SUB_BATCHES
    split: str = "batch"
    plan: Optional[dict] = None
    plan_path: Optional[str] = None
    tensor_model_parallel_size: int = 1
    attention_backend: str = "auto"
    half_precision: bool = False
    reset_attention_mask: bool = False
    cuda_graphs: Optional[str] = None

    @property
    def overlapped(self):
        """A split schedule runs (the micro-batch becomes sub-batches)."""
        return self.schedule != Schedule.OFF

    @property
    def patches_model(self):
        """The model needs the schedule patch: a split schedule or a per-layer plan."""
        return self.overlapped or self.plan is not None

    @classmethod
    def from_args(cls, args):
        """Check the parsed (Megatron-validated) ``args`` against the Oases rules
        (:mod:`.validation`), reading ``--oases-plan`` once; a rejected combination raises
        :class:`~.errors.OasesConfigError` with one line naming the fix."""
        plan, path = None, getattr(args, "oases_plan", None)
        if path:
            from .formats.plan import load_plan

            plan = load_plan(
                path,
                num_layers=args.num_layers,
                tensor_model_parallel_size=args.tensor_model_parallel_size,
            )
        import torch

        check_oases_args(args, plan=plan, cuda_available=torch.cuda.is_available())
        if plan is not None:
            _warn_plan_differences(path, plan, args)
        _warn_nothing_to_overlap(args)
        backend = getattr(args, "attention_backend", "auto")
        return cls(
            schedule=Schedule(getattr(args, "oases_schedule", "off")),
            sub_batches=sub_batches(args),
            split=split_kind(args),
            plan=plan,
            plan_path=path,
            tensor_model_parallel_size=args.tensor_model_parallel_size,
            attention_backend=getattr(backend, "name", backend),
            half_precision=bool(getattr(args, "fp16", False) or getattr(args, "bf16", False)),
            reset_attention_mask=bool(getattr(args, "reset_attention_mask", False)),
            cuda_graphs=getattr(args, "oases_cuda_graphs", None),
        )


def _warn_plan_differences(path, plan, args):
    """Once per job (rank 0): the plan was made for another run than this command line's."""
    import os
    import sys

    differences = plan_differences(plan, args)
    if not differences or int(os.environ.get("RANK", "0")) != 0:
        return
    theirs = ", ".join(f"{flag} {planned}" for flag, planned, _ in differences)
    ours = ", ".join(f"{flag} {value}" for flag, _, value in differences)
    print(
        f"oases: warning: --oases-plan {path} was made for {theirs}; this run has {ours}: the "
        "degrees run, but the plan's predicted time describes the other run (re-plan with "
        "these settings, or pass the plan's)",
        file=sys.stderr,
        flush=True,
    )


def _warn_nothing_to_overlap(args):
    """Once per job (rank 0): a split schedule at TP=1 has no tensor-parallel all-reduce to
    overlap; it runs, its sub-batches only make the matmuls smaller (slower)."""
    import os
    import sys

    schedule = getattr(args, "oases_schedule", "off")
    if schedule == "off" or args.tensor_model_parallel_size != 1:
        return
    if int(os.environ.get("RANK", "0")) != 0:
        return
    print(
        f"oases: warning: --oases-schedule {schedule} at --tensor-model-parallel-size 1 has no "
        "tensor-parallel communication to overlap: it only splits the matmuls (slower than "
        "--oases-schedule off); use --tensor-model-parallel-size 2 or more",
        file=sys.stderr,
        flush=True,
    )
