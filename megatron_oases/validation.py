"""The Oases rules, each written once: which schedules exist, what each needs, what a model and a
per-layer plan must satisfy. Every entry point (``oases-pretrain-gpt``, ``oases train``, the
Megatron-LM hooks, the schedule patch, the planner, the plan file) checks through here, so a rule
and its one-line error (the flag named, and the fix) exist in one place.

Pure functions of plain values and parsed args: no Megatron, no torch, no files.
"""

import enum
import os
from dataclasses import dataclass

from .errors import OasesConfigError
from .megatron_flags import NO_TE, NOT_INSTALLED, REFUSED, refusals
from .recompute_settings import recompute_mode_of


class Schedule(enum.StrEnum):
    """``--oases-schedule`` (see ``docs/schedules.md``); compares equal to its flag value."""

    OFF = "off"
    OVERLAP = "overlap"
    CROSS_PASS = "cross-pass"
    OASES = "oases"
    #: the run's first iterations time the schedules that can run; the fastest is kept
    #: (:mod:`.tuning`)
    AUTO = "auto"


#: ``--oases-schedule`` values that run one schedule throughout; ``off`` is stock Megatron.
SCHEDULES = ("off", "overlap", "cross-pass", "oases")
#: Schedules that run each micro-batch as two sub-batches.
SPLIT_SCHEDULES = ("overlap", "cross-pass", "oases")
#: Schedules that merge recomputation with backward: they need full, per-layer recomputation.
RECOMPUTE_SCHEDULES = ("cross-pass", "oases")
#: Sub-batches per micro-batch by default (the paper's two; ``--oases-sub-batches``).
SUB_BATCHES = 2
MAX_SUB_BATCHES = 8
#: Token runs the split schedules cut a stage's last MLP block into in forward (its last sub-batch
#: only, not under SP), so the pass ends on a piece of that block's all-reduce (the tail pieces of
#: :mod:`.schedule.engine.forward`; the planner's time model charges that piece at the pass end).
TAIL_PIECES = 4
#: ``--oases-split`` values: how a micro-batch becomes sub-batches (samples, or sequence chunks).
SPLITS = ("batch", "sequence")
#: ``--oases-cuda-graphs`` modes: ``capture`` (the flag alone) replays each block's main op from
#: a CUDA graph; ``eager`` runs the same bookkeeping without graphs (debugging, any device).
CUDA_GRAPH_MODES = ("capture", "eager")
_WORDS = {2: "two", 3: "three", 4: "four"}


#: The runtime's ``--oases-schedule auto`` (the planner's ``--schedule auto`` is its own): the
#: first iterations time the schedules (:mod:`.tuning`, which builds on this module), so the split
#: schedules' flags act under it too.
AUTO = "auto"


@dataclass(frozen=True)
class ActsWhen:
    """An ``--oases-*`` flag that acts only under some of the other flags: ``name`` (its
    attribute), ``flag``, ``default`` (argparse's: a value that asks for nothing), ``does`` (what
    it does, for the line), ``needs``: ``(acts(args, schedule), where it would not, the fix)``
    in order, the first unmet one refusing the flag; ``const``: the value the flag alone gives
    (shown as the flag alone)."""

    name: str
    flag: str
    default: object
    does: str
    needs: tuple
    const: object = True


def _splits(args, schedule):
    return schedule in SPLIT_SCHEDULES + (AUTO,)


def _auto(args, schedule):
    return schedule == AUTO


def _loads(args, schedule):
    return bool(getattr(args, "load", None))


def _saves(args, schedule):
    return bool(getattr(args, "save", None))


def _saves_elsewhere(args, schedule):
    """``--save`` is not the ``--load`` directory, the test of ``training/save_owner.py`` (with
    the same directory the run resumes from it, and nothing is replaced)."""
    load, save = getattr(args, "load", None), getattr(args, "save", None)
    return not (load and save and os.path.realpath(load) == os.path.realpath(save))


_UNDER = "under --oases-schedule {schedule}"
_SPLIT_FIX = "add --oases-schedule overlap (or cross-pass, oases, auto)"
_AUTO_FIX = "add --oases-schedule auto"
#: Every ``--oases-*`` flag that acts only under some flags, and what makes it act: given with
#: another value than its default where it would not act, it is refused with one line naming the
#: fix (:func:`check_flags_act`), not ignored (issue 60.5: ``--oases-sub-batches 3`` under the
#: default ``off`` trained stock without a word). The split schedules' flags act under ``auto``,
#: which may choose a split schedule (``auto`` refuses them where none can run).
ACT_WHEN = (
    ActsWhen(
        "oases_sub_batches",
        "--oases-sub-batches",
        None,
        "sets the split schedules' sub-batches per micro-batch",
        ((_splits, _UNDER, _SPLIT_FIX),),
    ),
    ActsWhen(
        "oases_split",
        "--oases-split",
        "batch",
        "sets how the split schedules cut a micro-batch into sub-batches",
        ((_splits, _UNDER, _SPLIT_FIX),),
    ),
    ActsWhen(
        "oases_cuda_graphs",
        "--oases-cuda-graphs",
        None,
        "graphs the split schedules' blocks",
        ((_splits, _UNDER, _SPLIT_FIX),),
        const="capture",
    ),
    ActsWhen(
        "oases_tune_steps",
        "--oases-tune-steps",
        None,
        "bounds the trial of --oases-schedule auto",
        ((_auto, _UNDER, _AUTO_FIX),),
    ),
    ActsWhen(
        "oases_retune",
        "--oases-retune",
        False,
        "times the schedules of --oases-schedule auto again where a resumed checkpoint holds "
        "a choice",
        ((_auto, _UNDER, _AUTO_FIX), (_loads, "without --load", "add --load DIR (to resume)")),
    ),
    ActsWhen(
        "oases_retune_interval",
        "--oases-retune-interval",
        None,
        "re-times the choice of --oases-schedule auto every N iterations",
        ((_auto, _UNDER, _AUTO_FIX),),
    ),
    ActsWhen(
        "oases_start_over",
        "--oases-start-over",
        False,
        "lets a run replace the checkpoints in --save without resuming from them",
        (
            (_saves, "without --save", "add --save DIR"),
            (
                _saves_elsewhere,
                "with --load the same directory as --save (the run resumes from it)",
                "give --save another directory than --load",
            ),
        ),
    ),
)
#: The ``oases`` argument group's flags that act under every schedule (a plan's degrees and the
#: trace, the emulated link and the golden values work under ``off`` too).
ACT_ALWAYS = ("--oases-schedule", "--oases-plan", "--oases-trace", "--emulate-link", "--log-json")


def check_flags_act(args, schedule):
    """Every flag of :data:`ACT_WHEN` given (not its default) acts under the others: else one
    line naming what would make it act. ``schedule``: the parsed ``--oases-schedule``. Checked
    once, on the user's command line (not on a candidate's view of it), before Megatron's checks."""
    for row in ACT_WHEN:
        value = getattr(args, row.name, row.default)
        if value == row.default:
            continue
        for acts, where, fix in row.needs:
            if not acts(args, schedule):
                given = row.flag if value == row.const else f"{row.flag} {value}"
                raise OasesConfigError(
                    f"{given} has no effect {where.format(schedule=schedule)}: it {row.does}; "
                    f"{fix} or drop {row.flag}"
                )


def check_schedule(schedule, source="--oases-schedule"):
    if schedule not in SCHEDULES:
        raise OasesConfigError(
            f"{source}: unknown schedule {schedule!r}; choose one of {', '.join(SCHEDULES)}"
        )
    return schedule


def check_schedule_recompute(
    schedule, recompute, flag="--oases-schedule", fix="add --recompute-granularity full"
):
    """``cross-pass``/``oases`` interleave recomputation with backward: without it they are not
    defined. ``flag``/``fix`` name the caller's flags (Megatron's, or the planner's)."""
    if schedule in RECOMPUTE_SCHEDULES and not recompute:
        raise OasesConfigError(
            f"{flag} {schedule} merges recompute with backward; {fix} or use {flag} overlap"
        )


def samples_per_group(micro_batch, degree, domain):
    """The one samples-per-group rule: a TMP domain of T = ``domain`` ranks runs a layer of TMP
    degree d as T/d groups of d ranks, and each group takes m·d/T of the domain's micro-batch of
    m = ``micro_batch`` samples. An int where that share is whole, else the fraction (a float,
    for messages: ``n != int(n)`` tells them apart)."""
    share, rest = divmod(micro_batch * degree, domain)
    return micro_batch * degree / domain if rest else share


def check_splittable(samples, what=None, need=None, parts=SUB_BATCHES):
    """A split schedule needs at least one sample per sub-batch (``parts`` of them). ``what``:
    whose share it is (a plan layer's), ``need``: the micro-batch size that gives every share
    enough."""
    need = parts if need is None else need
    if samples < parts:
        if what is None:
            raise OasesConfigError(
                f"micro-batch {samples} cannot be split; use --micro-batch-size ≥ {need}, "
                "--oases-split sequence (sub-batches of sequence chunks) or --oases-schedule off"
            )
        raise OasesConfigError(
            f"{what} leaves {samples} sample(s) per group, which cannot be split into "
            f"{_WORDS.get(parts, parts)} sub-batches; use --micro-batch-size ≥ {need} or --oases-schedule off"
        )


#: ``--recompute-modules`` the split schedules keep exact: core attention is recomputed inside
#: Megatron's own ``SelfAttention`` (no TP communication inside it); the norms' outputs are freed
#: and recomputed as ``TransformerLayer`` does, by the schedule's blocks (:mod:`.schedule.megatron.blocks`).
#: ``mlp`` would re-run the MLP's TP communication in Megatron's recomputation: not supported.
SELECTIVE_MODULES = ("core_attn", "layernorm")


def check_whole_layer_recompute(
    schedule,
    flag="--oases-schedule",
    fix="use --recompute-granularity full, or --oases-schedule overlap with selective "
    "recomputation",
):
    """``cross-pass``/``oases`` re-run whole layers: a selective recomputation setting is not
    theirs. ``flag``/``fix`` name the caller's flags (Megatron's, or the planner's)."""
    if schedule in RECOMPUTE_SCHEDULES:
        raise OasesConfigError(f"{flag} {schedule} recomputes whole layers; {fix}")


def check_selective_recompute(schedule, modules):
    """``--recompute-granularity selective``: ``overlap`` keeps each sub-batch's autograd graph
    and lets Megatron recompute core attention in backward; ``cross-pass``/``oases`` re-run whole
    layers and need full recomputation."""
    check_whole_layer_recompute(schedule)
    other = sorted(set(modules or SELECTIVE_MODULES) - set(SELECTIVE_MODULES))
    if other:
        raise OasesConfigError(
            f"--oases-schedule {schedule} supports --recompute-modules "
            f"{' '.join(SELECTIVE_MODULES)} only (got {' '.join(other)}); drop them or use "
            "--recompute-granularity full"
        )


def sub_batches(args):
    """``--oases-sub-batches``, checked: 2 to :data:`MAX_SUB_BATCHES` (not given: 2)."""
    n = getattr(args, "oases_sub_batches", None)
    n = SUB_BATCHES if n is None else n
    if not 2 <= n <= MAX_SUB_BATCHES:
        raise OasesConfigError(
            f"--oases-sub-batches {n} must be in [2, {MAX_SUB_BATCHES}] (2 is the paper's)"
        )
    return n


def check_split(kind, source="--oases-split"):
    if kind not in SPLITS:
        raise OasesConfigError(f"{source} {kind!r}: choose one of {', '.join(SPLITS)}")
    return kind


def split_kind(args):
    """``--oases-split``, checked."""
    return check_split(getattr(args, "oases_split", "batch") or "batch")


def check_sequence_split(args, plan=None):
    """``--oases-split sequence``: sub-batches are consecutive chunks of the sequence, a later
    chunk's causal attention reading the earlier chunks' keys and values (:mod:`.schedule.megatron.split`).
    What that is not built for is refused with the fix."""
    seq, parts = args.seq_length, sub_batches(args)
    if seq < parts:
        raise OasesConfigError(
            f"--seq-length {seq} cannot be cut into {parts} chunks; use --oases-split batch"
        )
    for flag, unsupported in (
        ("--sequence-parallel", getattr(args, "sequence_parallel", False)),
        ("--oases-plan", plan is not None or getattr(args, "oases_plan", None)),
        ("--reset-attention-mask", getattr(args, "reset_attention_mask", False)),
    ):
        if unsupported:
            raise OasesConfigError(
                f"--oases-split sequence does not support {flag}; drop it or use --oases-split batch"
            )
    backend = str(getattr(args, "attention_backend", "auto")).split(".")[-1]
    if backend in ("flash", "fused"):
        raise OasesConfigError(
            f"--oases-split sequence needs Megatron's unfused attention (a chunk attends to "
            f"the chunks before it, which a causal kernel would mask wrongly); drop "
            f"--attention-backend {backend} or use --oases-split batch"
        )


def check_transformer_impl(impl, schedule=None, plan=False, te_installed=None):
    """``--transformer-impl``: the local spec only, for the reason of the case. Under a split
    schedule (``schedule`` None: one of them) or a per-layer plan, TE's linears would do their own
    TP communication; under ``off`` the package still builds and prepares the local spec only,
    or TE is not installed (``te_installed`` False)."""
    if impl == "local":
        return
    if schedule != "off" or plan:
        what = f"--oases-schedule {schedule}" if schedule else "--oases-schedule"
        what = "--oases-plan" if schedule == "off" else what
        raise OasesConfigError(
            f"--transformer-impl {impl} is not supported by {what}: TE linears do their own TP "
            "communication, which the schedule cannot defer; use --transformer-impl local"
        )
    if te_installed is False:
        raise OasesConfigError(
            f"--transformer-impl {impl} needs Transformer Engine, which is not installed here; "
            "use --transformer-impl local (the default)"
        )
    raise OasesConfigError(
        f"--transformer-impl {impl} is not supported: this package builds and prepares "
        "Megatron's local layer spec only (its attention choice and patches act on local "
        "modules); use --transformer-impl local (the default)"
    )


def check_megatron_flags(args, schedule, plan=False, te_installed=None, after_megatron=False):
    """Megatron's flags this run cannot honour: the refused verdicts of :mod:`.megatron_flags`
    (docs/reliability.md's table), each one line naming the fix. ``plan``: a per-layer plan is
    given; ``te_installed``: whether Transformer Engine is (None: not known, its rules skipped);
    ``after_megatron``: the rules that read what Megatron's checks derive, else those run before
    them (whose messages would mislead, or which they let through)."""
    split = schedule != "off"
    what = f"--oases-schedule {schedule}" if split or not plan else "--oases-plan"
    te = NOT_INSTALLED if te_installed is False else ""
    for rule in refusals():
        refusal = rule.refusal
        if refusal.after_megatron != after_megatron:
            continue
        verdict = rule.verdict(schedule)
        if not (
            verdict == REFUSED
            or (verdict == NO_TE and te_installed is False)
            or (plan and refusal.plan)
        ):
            continue
        given = refusal.given(args)
        if given:
            raise OasesConfigError(refusal.message.format(what=what, given=given, te=te))


#: Numeric flags and the smallest value each may take (Megatron checks these only where it uses
#: them, with an assertion or a ZeroDivisionError, or not at all); None values are not set.
AT_LEAST_ONE = (
    "num_layers",
    "hidden_size",
    "num_attention_heads",
    "seq_length",
    "max_position_embeddings",
    "micro_batch_size",
    "global_batch_size",
    "ffn_hidden_size",
    "kv_channels",
    "vocab_size",
    "make_vocab_size_divisible_by",
    "train_iters",
    "train_samples",
    "log_interval",
    "eval_interval",
    "save_interval",
    "exit_interval",
    "tensor_model_parallel_size",
    "pipeline_model_parallel_size",
)
AT_LEAST_ZERO = (
    "lr",
    "min_lr",
    "weight_decay",
    "clip_grad",
    "lr_warmup_iters",
    "lr_decay_iters",
    "eval_iters",
    "num_workers",
    "seed",
)
#: Probabilities: a dropout of 1 zeroes every activation.
PROBABILITIES = ("hidden_dropout", "attention_dropout")


def _flag(name):
    return "--" + name.replace("_", "-")


def check_ranges(args):
    """Every numeric flag in its range, one line naming the flag: a negative ``--train-iters``
    would train nothing and exit 0, ``--log-interval 0`` divide by zero mid-run, ``--vocab-size 0``
    fail in the tokenizer with a traceback."""
    for names, low in ((AT_LEAST_ONE, 1), (AT_LEAST_ZERO, 0)):
        for name in names:
            value = getattr(args, name, None)
            if name == "train_iters" and getattr(args, "skip_train", False):
                continue  # --skip-train: evaluation only
            if value is not None and not isinstance(value, bool) and value < low:
                raise OasesConfigError(f"{_flag(name)} {value} must be >= {low}")
    for name in PROBABILITIES:
        value = getattr(args, name, None)
        if value is not None and not 0.0 <= value < 1.0:
            raise OasesConfigError(f"{_flag(name)} {value} must be in [0, 1)")
    if getattr(args, "group_query_attention", False):
        groups = getattr(args, "num_query_groups", None)
        if groups is not None and groups < 1:
            raise OasesConfigError(f"--num-query-groups {groups} must be >= 1")


def check_model_shape(args):
    """Sizes Megatron checks only when it builds the model (or not at all): one line each."""
    check_ranges(args)
    tp, heads = args.tensor_model_parallel_size, args.num_attention_heads
    if args.hidden_size and heads and args.kv_channels is None and args.hidden_size % heads:
        raise OasesConfigError(
            f"--hidden-size {args.hidden_size} is not divisible by --num-attention-heads {heads}"
        )
    if heads and heads % tp:
        raise OasesConfigError(
            f"--num-attention-heads {heads} is not divisible by --tensor-model-parallel-size {tp}"
        )
    groups = args.num_query_groups if args.group_query_attention else None
    if groups and (heads % groups or groups % tp):
        raise OasesConfigError(
            f"--num-query-groups {groups} must divide --num-attention-heads {heads} and be "
            f"divisible by --tensor-model-parallel-size {tp}"
        )
    if args.ffn_hidden_size is not None and args.ffn_hidden_size % tp:
        raise OasesConfigError(
            f"--ffn-hidden-size {args.ffn_hidden_size} is not divisible by "
            f"--tensor-model-parallel-size {tp}"
        )


def check_plan_fits_model(plan, args, schedule):
    """A (format-valid) plan against the model shape and batch under ``schedule``: each layer's
    groups get whole, splittable shares of the micro-batch."""
    if plan.get("split") == "sequence":
        raise OasesConfigError(
            f"the plan is for --oases-split sequence, which runs every layer at T without "
            f"--oases-plan; drop --oases-plan and run with its launch flags "
            f"(--oases-schedule {plan.get('schedule') or 'overlap'} --oases-split sequence)"
        )
    T = args.tensor_model_parallel_size
    for layer, d in enumerate(plan["degrees"]):
        samples = samples_per_group(args.micro_batch_size, d, T)
        if samples != int(samples):
            raise OasesConfigError(
                f"layer {layer}: degree {d} splits the micro-batch over {T // d} groups, but "
                f"--micro-batch-size {args.micro_batch_size} is not divisible by {T // d}"
            )
        if schedule != "off":
            parts = sub_batches(args)
            check_splittable(
                samples,
                what=f"layer {layer}: degree {d}",
                need=parts * T // d,
                parts=parts,
            )


def check_plan_checkpoint_format(plan, args):
    """Only torch_dist's save rewrites a per-layer plan's shards into the stock layout
    (``megatron_oases/layer_degrees/checkpoint.py``); ``--ckpt-format torch`` would save each layer at
    its own degree, a checkpoint no other layout can load (a uniform plan is the stock layout)."""
    if getattr(args, "ckpt_format", "torch_dist") != "torch":
        return
    if not (getattr(args, "save", None) or getattr(args, "load", None)):
        return
    T = args.tensor_model_parallel_size
    if all(int(d) == T for d in plan["degrees"]):
        return
    raise OasesConfigError(
        "--oases-plan with --ckpt-format torch: that format keeps each layer at its plan's TMP "
        "degree, a checkpoint that stock Megatron and other plans cannot load; use "
        "--ckpt-format torch_dist (the default), which saves a plan's checkpoint in the stock "
        "layout"
    )


def check_megatron_features(mode, args):
    """Megatron features the split schedules cannot run (present in 0.19 or only on Megatron-LM
    main): GTP, whose weight shards are prefetched along a fixed layer order that sub-batch
    interleaving breaks (plain TP at remat size 1), and mHC hyper-connections (a hidden state of
    several residual streams, which the schedule's blocks do not carry)."""
    if mode == "off":
        return
    if (getattr(args, "gtp_weight_remat_size", 1) or 1) > 1:
        raise OasesConfigError(
            f"--oases-schedule {mode} does not support GTP weight sharding "
            f"(--tensor-parallel-num-weight-shards > --tensor-model-parallel-size); drop one of them"
        )
    if getattr(args, "enable_mhc_connections", False):
        raise OasesConfigError(
            f"--oases-schedule {mode} does not support mHC hyper-connections; drop "
            "--enable-mhc-connections or use --oases-schedule off"
        )


#: ``--hybrid-layer-pattern`` symbols whose layers are schedule blocks (self-attention, dense MLP;
#: each ends in one TMP all-reduce) and the pipeline boundary; Megatron's others (Mamba, gated
#: delta net, sparse attention, MoE, the MTP separator) are not scheduled.
HYBRID_SCHEDULED = "*-"
HYBRID_SEPARATORS = "|"


def check_hybrid(mode, args, plan=None):
    """A ``HybridModel`` (``--hybrid-layer-pattern``): without Transformer Engine only ``*`` and
    ``-`` layers can be built (Megatron's other layers are TE-only); the split schedules run
    ``*`` and ``-`` layers, with the batch split and a uniform TMP degree."""
    pattern = getattr(args, "hybrid_layer_pattern", None)
    if not pattern:
        return
    other = "".join(sorted(set(pattern) - set(HYBRID_SCHEDULED + HYBRID_SEPARATORS)))
    local = getattr(args, "transformer_impl", "local") == "local"
    if other and local and getattr(args, "spec", None) is None:
        raise OasesConfigError(
            f"--hybrid-layer-pattern {pattern!r}: {other!r} layers need Transformer Engine "
            "(--transformer-impl transformer_engine); the local build has '*' (attention) and "
            "'-' (MLP) layers"
        )
    if mode == "off" and plan is None and not getattr(args, "oases_plan", None):
        return
    if plan is not None or getattr(args, "oases_plan", None):
        raise OasesConfigError(
            "--oases-plan supports GPTModel only; drop it for a HybridModel (--hybrid-layer-pattern)"
        )
    if other:
        raise OasesConfigError(
            f"--oases-schedule {mode} schedules the '*' (attention) and '-' (MLP) layers of "
            f"--hybrid-layer-pattern; {pattern!r} also has {other!r}: use --oases-schedule off"
        )
    if split_kind(args) == "sequence":
        raise OasesConfigError(
            "--oases-split sequence is not supported for a HybridModel; use --oases-split batch"
        )


def check_cuda_graphs(args, schedule, cuda_available):
    """``--oases-cuda-graphs`` under a split ``schedule`` (:func:`check_flags_act` refuses it
    under ``off``): graphs of the split schedules' main ops, which capture no collective, no RNG
    state change and no host-side gradient bookkeeping."""
    graphs = getattr(args, "oases_cuda_graphs", None)
    if not graphs:
        return
    if graphs not in CUDA_GRAPH_MODES:
        raise OasesConfigError(
            f"--oases-cuda-graphs: unknown mode {graphs!r}; choose from {', '.join(CUDA_GRAPH_MODES)}"
        )
    if getattr(args, "sequence_parallel", False):
        raise OasesConfigError(
            "--oases-cuda-graphs does not support --sequence-parallel yet; drop one of them"
        )
    if split_kind(args) == "sequence":
        raise OasesConfigError("--oases-cuda-graphs needs --oases-split batch; drop one of them")
    if graphs != "capture":
        return
    if not cuda_available:
        raise OasesConfigError(
            "--oases-cuda-graphs needs a CUDA GPU and this host has none; drop it (or pass "
            "--oases-cuda-graphs eager to run its bookkeeping without graphs)"
        )
    if (getattr(args, "attention_dropout", 0) or 0) > 0:
        raise OasesConfigError(
            "--oases-cuda-graphs cannot capture attention dropout (Megatron's RNG fork); use "
            "--attention-dropout 0 or drop --oases-cuda-graphs"
        )
    if getattr(args, "gradient_accumulation_fusion", False):
        raise OasesConfigError(
            "--oases-cuda-graphs cannot capture the fused weight-gradient accumulation; add "
            "--no-gradient-accumulation-fusion or drop --oases-cuda-graphs"
        )
    if getattr(args, "recompute_granularity", None) == "selective" and set(
        getattr(args, "recompute_modules", None) or ["core_attn"]
    ) - {"layernorm"}:
        raise OasesConfigError(
            "--oases-cuda-graphs cannot capture selective recompute inside attention or the MLP; "
            "use --recompute-modules layernorm, full recompute, or drop --oases-cuda-graphs"
        )


#: Megatron-FSDP's options that cannot run on CPU gloo ranks (what each needs), as
#: ``(flag, attribute, values that are no use of it, why)``: one refusal line each.
MEGATRON_FSDP_CUDA_ONLY = (
    ("--use-nccl-ub", "nccl_ub", (False, None), "registers NCCL user buffers (CUDA and NCCL)"),
    (
        "--fsdp-manual-registration",
        "fsdp_manual_registration",
        (False, None),
        "registers NCCL user buffers (CUDA and NCCL)",
    ),
    (
        "--fsdp-double-buffer",
        "fsdp_double_buffer",
        (False, None),
        "is untried on CPU ranks (its allocators wait on CUDA streams)",
    ),
    (
        "--megatron-fsdp-max-pool-double-buffer",
        "megatron_fsdp_max_pool_double_buffer",
        (False, None),
        "is untried on CPU ranks (its allocators wait on CUDA streams)",
    ),
    (
        "--num-distributed-optimizer-instances",
        "num_distributed_optimizer_instances",
        (1, None),
        "(hybrid sharding, HSDP) is untried on CPU ranks",
    ),
    ("--cuda-graph-impl", "cuda_graph_impl", ("none", None), "captures CUDA graphs (CUDA only)"),
    ("--enable-cuda-graph", "enable_cuda_graph", (False, None), "captures CUDA graphs (CUDA only)"),
    (
        "--external-cuda-graph",
        "external_cuda_graph",
        (False, None),
        "captures CUDA graphs (CUDA only)",
    ),
    ("--fp8-format", "fp8", (None,), "needs Transformer Engine on CUDA"),
    (
        "--fp8-param-gather",
        "fp8_param_gather",
        (False, None),
        "needs Transformer Engine on CUDA",
    ),
)


def check_megatron_fsdp(args, cuda_available):
    """``--use-megatron-fsdp``: ``einops`` installed (Megatron-FSDP's device mesh needs it, and
    megatron-core does not install it); without CUDA (the ``megatron-fsdp-cpu`` platform patch),
    none of the options that cannot run on CPU ranks and its gradient division outside the
    collective (gloo has no ``PREMUL_SUM``). ``--save``/``--load`` run on every device through
    the ``megatron-fsdp-checkpoint`` patch (``platform/megatron_fsdp_checkpoint.py``)."""
    import importlib.util

    if importlib.util.find_spec("einops") is None:
        raise OasesConfigError(
            "--use-megatron-fsdp needs einops (Megatron-FSDP builds its device mesh with it); "
            "pip install einops"
        )
    if cuda_available is None or cuda_available:
        return
    for flag, attribute, unused, why in MEGATRON_FSDP_CUDA_ONLY:
        value = getattr(args, attribute, None)
        if value not in unused:
            given = flag if value is True else f"{flag} {value}"
            raise OasesConfigError(
                f"{given} {why}: it does not run under --use-megatron-fsdp on CPU ranks; drop it"
            )
    if getattr(args, "gradient_accumulation_fusion", False):
        raise OasesConfigError(
            "gradient-accumulation fusion under --use-megatron-fsdp needs Transformer Engine on "
            "CUDA; add --no-gradient-accumulation-fusion"
        )
    if getattr(args, "gradient_reduce_div_fusion", False):
        raise OasesConfigError(
            "--use-megatron-fsdp on CPU ranks divides gradients before their reduction (gloo has "
            "no PREMUL_SUM to divide inside it); add --no-gradient-reduce-div-fusion"
        )


def check_sharded_data_parallel(args, schedule, cuda_available):
    """Megatron's two sharded data-parallel wrappers (``--use-torch-fsdp2``,
    ``--use-megatron-fsdp``): what runs where (docs/megatron-lm.md, sharded data parallelism)."""
    torch_fsdp2 = getattr(args, "use_torch_fsdp2", False)
    megatron_fsdp = getattr(args, "use_megatron_fsdp", False)
    # Megatron-FSDP under the split schedules: each layer gathered and its gradients handed over
    # once by the engine (schedule/megatron/fsdp_params.py; parity: test_megatron_fsdp_split_e2e)
    if (
        megatron_fsdp
        and (getattr(args, "pipeline_model_parallel_size", 1) or 1) > 1
        and (getattr(args, "num_distributed_optimizer_instances", 1) or 1) > 1
    ):
        raise OasesConfigError(
            "--use-megatron-fsdp with --num-distributed-optimizer-instances > 1 (its hybrid "
            "sharding) does not run with --pipeline-model-parallel-size > 1 in this megatron-core "
            "(its mesh is laid out over the whole world as outer DP x DP x TP); drop one of them"
        )
    if megatron_fsdp:
        check_megatron_fsdp(args, cuda_available)
    if (torch_fsdp2 or megatron_fsdp) and getattr(args, "oases_plan", None):
        flag = "--use-torch-fsdp2" if torch_fsdp2 else "--use-megatron-fsdp"
        raise OasesConfigError(
            f"--oases-plan does not run under {flag} (a plan's replica gradient sum and its "
            "checkpoints work on whole tensor-parallel shards, which FSDP holds sharded over data "
            "parallelism); drop one of them"
        )
    if (torch_fsdp2 or megatron_fsdp) and getattr(args, "oases_cuda_graphs", None):
        flag, who = (
            ("--use-torch-fsdp2", "FSDP2")
            if torch_fsdp2
            else ("--use-megatron-fsdp", "Megatron-FSDP")
        )
        raise OasesConfigError(
            f"--oases-cuda-graphs does not run under {flag} ({who} re-allocates the gathered "
            "parameters at every all-gather, under the captured graphs); drop one of them"
        )


def check_before_megatron(args, schedule, te_installed=None):
    """The ``--oases-*`` rules that Megatron's own checks would mask with a less helpful message
    (run before them by :meth:`~.config.OasesConfig.from_args`), and Megatron's flags the run
    cannot honour (:func:`check_megatron_flags`). ``schedule``: the parsed ``--oases-schedule``;
    ``te_installed``: whether Transformer Engine is (None: not known)."""
    plan_path = getattr(args, "oases_plan", None)
    impl = getattr(args, "transformer_impl", "local")
    check_transformer_impl(impl, schedule, plan=bool(plan_path), te_installed=te_installed)
    check_megatron_flags(args, schedule, plan=bool(plan_path), te_installed=te_installed)
    if getattr(args, "sequence_parallel", False) and plan_path:
        raise OasesConfigError(
            "--oases-plan does not support --sequence-parallel (per-layer degrees would "
            "re-shard the sequence between layers); drop one of them"
        )


def check_oases_args(args, schedule, plan=None, cuda_available=None, te_installed=None):
    """The other ``--oases-*`` rules, on Megatron-validated args. ``schedule``: the parsed
    ``--oases-schedule``; ``plan``: the loaded ``--oases-plan``; ``cuda_available``: whether the
    run has a CUDA GPU (None: not known, the GPU rules skipped); ``te_installed``: whether
    Transformer Engine is (None: not known)."""
    planned = plan is not None or bool(getattr(args, "oases_plan", None))
    check_megatron_flags(args, schedule, planned, te_installed, after_megatron=True)
    check_megatron_features(schedule, args)
    check_hybrid(schedule, args, plan)
    check_schedule_recompute(schedule, args.recompute_granularity == "full")
    if (schedule != "off" or plan is not None) and (
        args.recompute_granularity == "full"
        and args.recompute_method == "uniform"
        and (args.recompute_num_layers or 1) != 1
    ):
        what = f"--oases-schedule {schedule}" if schedule != "off" else "--oases-plan"
        raise OasesConfigError(
            f"{what} recomputes one layer per checkpoint; use --recompute-method uniform "
            "--recompute-num-layers 1 (every layer), or --recompute-method block "
            "--recompute-num-layers N (a stage's first N layers)"
        )
    if schedule != "off":
        if args.recompute_granularity == "selective":
            check_selective_recompute(schedule, getattr(args, "recompute_modules", None))
        if split_kind(args) == "sequence":
            check_sequence_split(args, plan)
        else:
            check_splittable(args.micro_batch_size, parts=sub_batches(args))
    if plan is not None:
        check_plan_fits_model(plan, args, schedule)
        check_plan_checkpoint_format(plan, args)
    check_cuda_graphs(args, schedule, cuda_available if cuda_available is not None else True)
    return args


def plan_differences(planned, args, schedule):
    """Where the run a plan was made for differs from this command line: ``[(flag, plan's value,
    this run's value)]``. ``planned``: the plan's recorded run, read by
    :meth:`~megatron_oases.planner.settings.PlanSettings.from_plan` (its ``recorded(field)`` says
    what the plan records; a hand-written or uniform plan records little). Compared: the
    schedule, the batch sizes, the recompute setting, the pipeline and data-parallel sizes,
    sequence parallelism and the distributed optimizer (on/off). The degrees still run; the
    plan's prediction describes the other run."""
    recompute_layers = None
    if getattr(args, "recompute_method", None) == "block":
        recompute_layers = getattr(args, "recompute_num_layers", None)
    ours = [  # (the run's field, the flag, this run's value)
        ("schedule", "--oases-schedule", str(schedule)),
        ("micro_batch_size", "--micro-batch-size", getattr(args, "micro_batch_size", None)),
        ("global_batch_size", "--global-batch-size", getattr(args, "global_batch_size", None)),
        ("recompute", "--recompute-granularity", recompute_mode_of(args)),
        ("recompute_layers", "--recompute-num-layers (block)", recompute_layers),
        (
            "pipeline_model_parallel_size",
            "--pipeline-model-parallel-size",
            getattr(args, "pipeline_model_parallel_size", None) or 1,
        ),
        (
            "sequence_parallel",
            "--sequence-parallel",
            bool(getattr(args, "sequence_parallel", False)),
        ),
        (
            "distributed_optimizer",
            "--use-distributed-optimizer",
            bool(getattr(args, "use_distributed_optimizer", False)),
        ),
    ]
    if getattr(args, "data_parallel_size", None) is not None:  # Megatron derives it
        ours.append(("data_parallel_size", "data-parallel size", args.data_parallel_size))
    out = []
    for name, flag, value in ours:
        theirs = getattr(planned, name)
        if theirs is None or not planned.recorded(name):
            continue  # not recorded (a hand-written or uniform plan)
        if name == "recompute_layers" and not planned.recorded("recompute"):
            continue
        if theirs != value:
            if isinstance(value, bool):
                theirs, value = ("on" if theirs else "off"), ("on" if value else "off")
            out.append((flag, theirs, value))
    return out
