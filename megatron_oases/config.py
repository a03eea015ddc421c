"""The Oases settings of one run, parsed and checked once (:meth:`OasesConfig.from_args`), then
passed down as an argument, named ``config``: to the patches (:mod:`.patches`, every factory takes
it and nothing else), the per-layer runtime (:mod:`.layer_degrees.runtime`) and the attention swap
(:mod:`.attention`), through one door (:mod:`.prepare`) that both entry points
(``oases-pretrain-gpt``, Megatron-LM's patched ``pretrain_gpt.py``) share. The Megatron settings a
patch reads are copied in here, typed, so that no patch reads Megatron's ``args``."""

from dataclasses import dataclass
from typing import Optional

from .validation import (
    SUB_BATCHES,
    Schedule,
    check_before_megatron,
    check_flags_act,
    check_oases_args,
    check_sharded_data_parallel,
    plan_differences,
    split_kind,
    sub_batches,
)


@dataclass(frozen=True)
class EmulatedLink:
    """``--emulate-link PROFILE`` and what :func:`.testbed.emulator.resolve_dilation` needs of
    the model for its per-shape dilation D: ``shape`` (the layer as :mod:`.device_model` counts
    it, :func:`.testbed.emulator.shape_of_args`; None: unknown, D from the GEMM rates alone), the
    TMP degree, the micro-batch's samples, sequence parallelism, the host's dtype (half or fp32)
    and ``--attention-backend`` (its name; None: the device's default)."""

    profile: str
    shape: Optional[dict] = None
    tensor_model_parallel_size: int = 1
    micro_batch_size: int = 1
    sequence_parallel: bool = False
    half_precision: bool = False
    attention_backend: Optional[str] = None

    @classmethod
    def from_args(cls, profile, args):
        """At the layer shape of Megatron's (validated) ``args``."""
        from .testbed.emulator import shape_of_args

        backend = getattr(args, "attention_backend", None)
        return cls(
            profile=profile,
            shape=shape_of_args(args),
            tensor_model_parallel_size=args.tensor_model_parallel_size,
            micro_batch_size=args.micro_batch_size,
            sequence_parallel=bool(getattr(args, "sequence_parallel", False)),
            half_precision=_half(args),
            attention_backend=getattr(backend, "name", backend),
        )


@dataclass(frozen=True)
class OasesConfig:
    """Every ``--oases-*`` flag (and ``--emulate-link``, ``--log-json``), checked against the
    model and the batch, plus the Megatron settings the patches read.

    ``schedule``: ``--oases-schedule``, parsed once (:class:`Schedule`). ``plan``: the
    ``--oases-plan`` file's contents (read and checked once), or None. ``cuda_graphs``:
    ``--oases-cuda-graphs``'s mode (``capture``, ``eager``) or None. ``trace``: ``--oases-trace``'s
    path pattern. ``emulate_link``: :class:`EmulatedLink` or None. ``log_json``: the golden-values
    file. ``start_over``: ``--oases-start-over``. ``autotune``: under ``--oases-schedule auto``
    its :class:`~.tuning.candidates.AutoTune` (candidates, trial budget), else None. Megatron's: ``tensor_model_parallel_size`` (the
    TMP domain a plan's degrees divide), ``attention_backend``, ``half_precision``,
    ``reset_attention_mask``, ``sequence_parallel``, ``recompute_granularity``,
    ``recompute_modules``, ``distributed_optimizer`` (``--use-distributed-optimizer``) and
    ``fsdp2_checkpoints`` (``--use-torch-fsdp2`` with ``--save`` or ``--load``)."""

    schedule: Schedule = Schedule.OFF
    sub_batches: int = SUB_BATCHES
    split: str = "batch"
    plan: Optional[dict] = None
    plan_path: Optional[str] = None
    cuda_graphs: Optional[str] = None
    trace: Optional[str] = None
    emulate_link: Optional[EmulatedLink] = None
    log_json: Optional[str] = None
    start_over: bool = False
    tensor_model_parallel_size: int = 1
    attention_backend: str = "auto"
    half_precision: bool = False
    reset_attention_mask: bool = False
    sequence_parallel: bool = False
    recompute_granularity: Optional[str] = None
    recompute_modules: tuple = ()
    distributed_optimizer: bool = False
    fsdp2_checkpoints: bool = False
    autotune: Optional[object] = None

    @property
    def overlapped(self):
        """A split schedule runs (the micro-batch becomes sub-batches; under ``auto``: may)."""
        if self.schedule == Schedule.AUTO:
            return self.autotune.splits
        return self.schedule != Schedule.OFF

    @property
    def patches_model(self):
        """The model needs the schedule patch: a split schedule or a per-layer plan."""
        return self.overlapped or self.plan is not None

    @classmethod
    def from_args(cls, args, validate_megatron=None):
        """The one place the ``--oases-*`` flags are read from Megatron's parsed ``args`` and
        checked (:mod:`.validation`, each rule once), ``--oases-plan`` read once; a rejected
        combination raises :class:`~.errors.OasesConfigError` with one line naming the fix.

        ``validate_megatron(args)``: Megatron's own checks, run after the rules they would mask
        with a less helpful message and before the rest (which read what Megatron derives);
        None where Megatron already ran them (Megatron-LM's ``pretrain_gpt.py``)."""
        import torch

        from .tuning.candidates import STOCK, pinned, plan_autotune

        schedule = Schedule(args.oases_schedule)  # argparse checked it against SCHEDULES
        check_flags_act(args, str(schedule))  # the user's flags, not a candidate's view
        auto = schedule == Schedule.AUTO  # stock is checked here, the other candidates below
        checked = Schedule.OFF if auto else schedule

        def view():
            return pinned(args, STOCK) if auto else args

        check_sharded_data_parallel(view(), checked, cuda_available=torch.cuda.is_available())
        te_installed = transformer_engine_installed()
        check_before_megatron(view(), checked, te_installed=te_installed)
        if validate_megatron is not None:
            validate_megatron(args)
        plan, path = None, getattr(args, "oases_plan", None)
        if path:
            from .formats.plan import load_plan

            plan = load_plan(
                path,
                num_layers=args.num_layers,
                tensor_model_parallel_size=args.tensor_model_parallel_size,
            )
        cuda = torch.cuda.is_available()
        check_oases_args(view(), checked, plan, cuda_available=cuda, te_installed=te_installed)
        autotune = plan_autotune(args, plan, cuda, te_installed) if auto else None
        if plan is not None:
            _warn_plan_differences(path, plan, args, schedule)
        _warn_nothing_to_overlap(checked, args)
        backend = getattr(args, "attention_backend", "auto")
        link = getattr(args, "emulate_link", None)
        if link:  # read and checked now, before any process group or model (a bad one: one line)
            from .testbed.clusters import load_cluster

            load_cluster(link)
        return cls(
            schedule=schedule,
            sub_batches=sub_batches(args),
            split=split_kind(args),
            plan=plan,
            plan_path=path,
            cuda_graphs=getattr(args, "oases_cuda_graphs", None),
            trace=getattr(args, "oases_trace", None),
            emulate_link=EmulatedLink.from_args(link, args) if link else None,
            log_json=getattr(args, "log_json", None),
            start_over=bool(getattr(args, "oases_start_over", False)),
            tensor_model_parallel_size=args.tensor_model_parallel_size,
            attention_backend=getattr(backend, "name", backend),
            half_precision=_half(args),
            reset_attention_mask=bool(getattr(args, "reset_attention_mask", False)),
            sequence_parallel=bool(getattr(args, "sequence_parallel", False)),
            recompute_granularity=getattr(args, "recompute_granularity", None),
            recompute_modules=tuple(getattr(args, "recompute_modules", None) or ()),
            distributed_optimizer=bool(getattr(args, "use_distributed_optimizer", False)),
            fsdp2_checkpoints=bool(
                getattr(args, "use_torch_fsdp2", False)
                and (getattr(args, "save", None) or getattr(args, "load", None))
            ),
            autotune=autotune,
        )


def transformer_engine_installed():
    """Whether Transformer Engine is installed (found, not imported: importing it sets up CUDA).
    The rules of :mod:`.validation` that depend on it take the answer as an argument."""
    import importlib.util

    return importlib.util.find_spec("transformer_engine") is not None


def _half(args):
    return bool(getattr(args, "fp16", False) or getattr(args, "bf16", False))


def _warn_plan_differences(path, plan, args, schedule):
    """Once per job (rank 0): the plan was made for another run than this command line's (the
    plan's recorded run, :func:`~.formats.plan.recorded_run`: the plan format's reader, which
    ``oases plan --evaluate`` reads too; the runtime imports no planner code) or for another
    sequence length or vocabulary (its ``model_shape``). A plan made for another layer shape
    (:data:`~.formats.plan.LAYER_SHAPE`: its degrees, memory and times were chosen for other
    layers) is refused, on every rank; a plan that records no shape (written before plans did)
    gets a note."""
    import os
    import sys

    from .errors import OasesConfigError
    from .formats.plan import LAYER_SHAPE, MODEL_SHAPE, recorded_run, shape_differences

    ours = {key: getattr(args, key, None) for key in MODEL_SHAPE}
    vocab, divisible = getattr(args, "vocab_size", None), "make_vocab_size_divisible_by"
    if ours["padded_vocab_size"] is None and vocab and getattr(args, divisible, None):
        # what pretrain() pads --vocab-size to (set later, by Megatron's tokenizer set-up)
        from megatron.core.tokenizers.utils.build_tokenizer import vocab_size_with_padding

        ours["padded_vocab_size"] = vocab_size_with_padding(vocab, args, logging_enabled=False)
    shape = [(MODEL_SHAPE[k], *values, k) for k, *values in shape_differences(plan, ours)]
    layer = [d for d in shape if d[3] in LAYER_SHAPE]
    if layer:
        raise OasesConfigError(
            f"--oases-plan {path} was made for a model of "
            + ", ".join(f"{flag} {planned}" for flag, planned, _, _ in layer)
            + "; this run has "
            + ", ".join(f"{flag} {value}" for flag, _, value, _ in layer)
            + ": its degrees, memory and times were chosen for those layers; re-plan for this "
            "model (`oases plan` with a profile of it)"
        )
    rank0 = int(os.environ.get("RANK", "0")) == 0
    if plan.get("model_shape") is None and rank0:
        print(
            f"oases: note: --oases-plan {path} records no model shape (written before plans "
            "recorded one): its degrees are checked against this model, but not that it was "
            "planned for it; re-plan to record the shape",
            file=sys.stderr,
            flush=True,
        )
    differences = [d[:3] for d in shape if d[3] not in LAYER_SHAPE]
    differences += plan_differences(recorded_run(plan, path), args, schedule)
    if schedule == Schedule.AUTO:  # auto tries the plan's schedule among others
        differences = [d for d in differences if d[0] != "--oases-schedule"]
    if not differences or not rank0:
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


def _warn_nothing_to_overlap(schedule, args):
    """Once per job (rank 0): a split schedule at TP=1 has no tensor-parallel all-reduce to
    overlap; it runs, its sub-batches only make the matmuls smaller (slower)."""
    import os
    import sys

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
