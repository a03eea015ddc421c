"""Checkpoint directories checked up front, before any training: one line each, never a traceback.

``--save``: the directory must be writable (found before training, not at the first save), and
saves go through :mod:`.safe_save` (the previous good checkpoint is never overwritten in place; the
tracker is switched atomically).

``--load``: a save that crashed between its final renames is undone (:func:`.safe_save.recover`);
the tracker file must name an iteration whose directory is complete (every shard file as long as
the checkpoint's own ``.metadata`` says — a truncated copy or a save killed by a full disk is
refused; ``.metadata`` is a pickle, read only for that iteration, the one torch loads; an older
one offered instead is judged by its files alone); then Megatron's own ``check_checkpoint_args``
(layers, hidden size, heads, ...) runs on the checkpoint's saved arguments before any process
group or model exists, plus the model-defining flags it does not compare (norm, MLP, attention
groups, positions, biases, vocabulary) — which torch_dist would otherwise reject deep inside
loading with a traceback.
A shard that is damaged inside (same size, other bytes) is found only by the real load, whose
error becomes one line too (:func:`make_load_patch`).
"""

import os
import re
import sys
import warnings

from ..compat import require_symbol
from ..errors import OasesConfigError
from . import safe_save
from .save_owner import claim_save_dir, is_job_rank_0, same_dir

#: Flags that change the parameters' names or shapes, beyond Megatron's own comparison.
MODEL_FLAGS = (
    "normalization",
    "swiglu",
    "ffn_hidden_size",
    "query_groups",
    "position_embedding_type",
    "add_bias_linear",
    "untie_embeddings_and_output_weights",
    "padded_vocab_size",
    "kv_channels",
)
TRACKER = safe_save.TRACKER
_ITER_DIR = re.compile(r"^iter_(\d{7})$")


def _flag(name):
    return "--num-query-groups" if name == "query_groups" else "--" + name.replace("_", "-")


def _value(args, name):
    if name == "query_groups":  # Megatron fills num_query_groups in late when GQA is off
        gqa = getattr(args, "group_query_attention", False)
        return args.num_query_groups if gqa else args.num_attention_heads
    return getattr(args, name, None)


def _first_line(exc):
    """The root cause of a (torch.distributed.checkpoint) exception, on one line."""
    failures = getattr(exc, "failures", None)
    if failures:
        exc = next(iter(failures.values()))[0]
    text = str(exc).strip().splitlines()
    line = text[0] if text else ""
    if len(line) > 160:  # torch's hints run on for lines
        line = line[:160].rsplit(" ", 1)[0] + " ..."
    return f"{type(exc).__name__}: {line}" if line else type(exc).__name__


# ------------------------------------------------------------------------------------- --save


def check_save_dir(args):
    """``--save`` must be a directory this process can create and write, before training."""
    save = getattr(args, "save", None)
    if not save:
        return
    probe = os.path.join(save, f".oases-write-test-{os.getpid()}")
    try:
        os.makedirs(save, exist_ok=True)
        with open(probe, "w") as f:
            f.write("ok")
        os.unlink(probe)
    except OSError as exc:
        raise OasesConfigError(
            f"--save {save} is not writable ({exc.strerror or exc}); choose a directory you can "
            "write to (checked before training, so no work is lost)"
        ) from None


# ------------------------------------------------------------------------------------- --load


def torch_format_files(path):
    """The files of a ``--ckpt-format torch`` checkpoint directory (one ``torch.save`` file per
    model-parallel rank in ``mp_rank_*/``, Megatron's own test of the format), or None when
    ``path`` is not one."""
    try:
        ranks = sorted(n for n in os.listdir(path) if n.startswith("mp_rank_0"))
    except OSError:
        return None
    if not ranks:
        return None
    files = []
    for rank in ranks:
        try:
            names = sorted(os.listdir(os.path.join(path, rank)))
        except OSError:
            names = []
        files += [os.path.join(rank, n) for n in names if n.endswith(".pt")] or [
            os.path.join(rank, "model_optim_rng.pt")
        ]
    return files


def _torch_file_problem(path, name):
    """Why the ``torch.save`` file ``name`` of ``path`` cannot be loaded (missing, or a zip
    archive without its end record: cut short), or None."""
    file = os.path.join(path, name)
    if not os.path.isfile(file):
        return f"{name} is missing"
    size = os.path.getsize(file)
    with open(file, "rb") as f:
        head = f.read(4)
        if head[:1] == b"\x80":  # torch.save's legacy (pickle) format: no end record to check
            return None
        if head != b"PK\x03\x04":
            return f"{name} is not a torch.save file"
        f.seek(max(0, size - 65557))  # the end record and the longest zip comment
        if b"PK\x05\x06" not in f.read():
            return f"{name} is truncated ({size} bytes, no zip end record)"
    return None


#: Formats saved by torch's distributed checkpoint alone: no ``metadata.json``; torch writes the
#: shards' index ``.metadata`` last (``--use-torch-fsdp2`` saves ``torch_dcp``).
DCP_FORMATS = ("torch_dcp", "fsdp_dtensor")


def _complete(path, read_index=True, ckpt_format=None):
    """Why the checkpoint directory ``path`` (torch_dist, torch_dcp or ``--ckpt-format torch``) is
    incomplete, or None if it is not. ``ckpt_format``: the run's ``--ckpt-format`` (a torch_dist
    save cut short before its ``metadata.json`` looks like a torch_dcp one).

    ``read_index``: check every shard against the checkpoint's ``.metadata``, torch's index of
    the shards: a pickle, and unpickling runs whatever code a crafted one holds. So only for the
    checkpoint that will be loaded (torch's load unpickles it anyway); for any other, the files
    the directory shows (:func:`_files_problem`)."""
    if not os.path.isdir(path):
        return "it is missing"
    torch_files = torch_format_files(path)
    if torch_files is not None:  # --ckpt-format torch: no metadata.json, no .metadata
        for name in torch_files:
            why = _torch_file_problem(path, name)
            if why:
                return why
        return None
    dcp = ckpt_format in DCP_FORMATS and not os.path.isfile(os.path.join(path, "metadata.json"))
    if dcp and not os.path.isfile(os.path.join(path, ".metadata")):
        return ".metadata is missing (written last by a torch_dcp save: the save did not finish)"
    if not dcp and not os.path.isfile(os.path.join(path, "metadata.json")):  # written last
        return "metadata.json is missing (the save did not finish)"
    if not os.path.isfile(os.path.join(path, ".metadata")):
        if _backend(path) == "torch_dist":  # before torch's reader warns on every rank
            return ".metadata is missing (torch_dist's index of the shards)"
        return None  # another format: Megatron's own load checks it
    if not read_index:
        return _files_problem(path)
    from torch.distributed.checkpoint import FileSystemReader

    try:
        metadata = FileSystemReader(path).read_metadata()
    except Exception as exc:  # noqa: BLE001 - a damaged index is the user's to fix
        return f".metadata cannot be read ({_first_line(exc)})"
    needed = {}
    for info in (getattr(metadata, "storage_data", None) or {}).values():
        end = int(info.offset) + int(info.length)
        needed[info.relative_path] = max(needed.get(info.relative_path, 0), end)
    for name, size in sorted(needed.items()):
        file = os.path.join(path, name)
        if not os.path.isfile(file):
            return f"{name} is missing"
        have = os.path.getsize(file)
        if have < size:
            return f"{name} is truncated ({have} of {size} bytes)"
    return None


def _files_problem(path):
    """Why the torch_dist directory ``path`` is incomplete, from its files alone (nothing is
    unpickled): an empty ``.metadata``, no shard file or an empty one, a ``common.pt`` cut
    short; None otherwise. (A shard cut short is found only against ``.metadata``, when that
    checkpoint is the one to load.)"""
    if os.path.getsize(os.path.join(path, ".metadata")) == 0:
        return ".metadata is empty"
    shards = sorted(n for n in os.listdir(path) if n.endswith(".distcp"))
    if not shards:
        return "it holds no shard file (*.distcp)"
    for name in shards:
        if os.path.getsize(os.path.join(path, name)) == 0:
            return f"{name} is empty"
    if os.path.exists(os.path.join(path, "common.pt")):
        return _torch_file_problem(path, "common.pt")
    return None


def _backend(path):
    """The ``sharded_backend`` that the checkpoint's ``metadata.json`` names (None: unreadable;
    read through the one bounded reader: a FIFO or a device there is no backend)."""
    from ..formats import MAX_CONTROL_BYTES, read_json

    try:
        file = os.path.join(path, "metadata.json")
        return read_json(file, "metadata", None, MAX_CONTROL_BYTES).get("sharded_backend")
    except (OasesConfigError, AttributeError):
        return None


def complete_iterations(load_dir, ckpt_format=None):
    """Iterations of ``load_dir`` whose directory looks complete (its files, :func:`_complete`
    without reading ``.metadata``: these are only suggested, not loaded), ascending."""
    try:
        names = os.listdir(load_dir)
    except OSError:
        return []
    found = sorted(int(m[1]) for m in map(_ITER_DIR.match, names) if m)
    return [
        it
        for it in found
        if _complete(os.path.join(load_dir, f"iter_{it:07d}"), False, ckpt_format) is None
    ]


def _older(load_dir, but=None, ckpt_format=None):
    good = [it for it in complete_iterations(load_dir, ckpt_format) if it != but]
    where = os.path.join(load_dir, TRACKER)
    if good:
        return f"write {good[-1]} (a complete checkpoint there) into {where}"
    return "no complete checkpoint is left there: start without --load or use another directory"


def check_tracker(load_dir, ckpt_format=None):
    """The tracker names a complete checkpoint; returns its iteration (None: ``release``).
    ``ckpt_format``: the run's ``--ckpt-format`` (:func:`_complete`). The tracker is read through
    the one bounded reader (:func:`.safe_save.read_tracker`): not a regular file, oversized or
    binary is one line."""
    try:
        text = safe_save.read_tracker(load_dir, _older(load_dir, ckpt_format=ckpt_format))
    except OasesConfigError as exc:
        raise OasesConfigError(f"--load {load_dir}: {exc}") from None
    if text == "release":
        return None
    if not re.fullmatch(r"\d+", text):
        what = "empty" if not text else f"invalid ({text[:20]!r})"
        raise OasesConfigError(
            f"--load {load_dir}: {TRACKER} is {what}, an interrupted save?; "
            f"{_older(load_dir, ckpt_format=ckpt_format)}"
        )
    iteration = int(text)
    why = _complete(os.path.join(load_dir, f"iter_{iteration:07d}"), ckpt_format=ckpt_format)
    if why is not None:
        raise OasesConfigError(
            f"--load {load_dir}: the checkpoint of iteration {iteration} is incomplete or "
            f"damaged: {why}; {_older(load_dir, but=iteration, ckpt_format=ckpt_format)}"
        )
    return iteration


def _padded(vocab, divisor, tp):
    """Megatron's ``vocab_size_with_padding``: a multiple of divisor x TP."""
    multiple = divisor * tp
    return -(-vocab // multiple) * multiple


def _vocab_problem(saved, args):
    """The padded vocabulary differs: name ``--make-vocab-size-divisible-by`` and a value that
    pads this run's vocabulary at this TP to the checkpoint's."""
    saved_padded, tp, vocab = saved.padded_vocab_size, args.tensor_model_parallel_size, None
    divisor = getattr(saved, "make_vocab_size_divisible_by", None)
    saved_tp = getattr(saved, "tensor_model_parallel_size", None)
    fix = "use --make-vocab-size-divisible-by so that both pad to the same size"
    if getattr(saved, "vocab_size", None) == getattr(args, "vocab_size", None):
        vocab = args.vocab_size
    if vocab and saved_padded % tp == 0:
        candidates = [divisor * saved_tp // tp] if divisor and saved_tp else []
        candidates.append(saved_padded // tp)
        for d in candidates:
            if d >= 1 and _padded(vocab, d, tp) == saved_padded:
                fix = f"use --make-vocab-size-divisible-by {d}"
                break
    return (
        f"the padded vocabulary is {saved_padded} in the checkpoint (--vocab-size "
        f"{getattr(saved, 'vocab_size', '?')} padded to a multiple of "
        f"--make-vocab-size-divisible-by {divisor} x --tensor-model-parallel-size {saved_tp}), "
        f"{args.padded_vocab_size} here; {fix}"
    )


def _schedule(a):
    """What Megatron's ``OptimizerParamScheduler.load_state_dict`` compares (iteration-based
    training, as ``get_optimizer_param_scheduler`` computes it), keyed by the flags that set it."""
    gbs = a.global_batch_size
    decay = (a.lr_decay_iters or a.train_iters) * gbs
    warmup = (
        a.lr_warmup_fraction * decay
        if getattr(a, "lr_warmup_fraction", None) is not None
        else a.lr_warmup_iters * gbs
    )
    return {
        "--lr": a.lr,
        "--min-lr": a.min_lr,
        "the warm-up in samples (--lr-warmup-iters or --lr-warmup-fraction)": warmup,
        "the decay in samples (--lr-decay-iters, default --train-iters)": decay,
        "--lr-decay-style": a.lr_decay_style,
        "--start-weight-decay": a.start_weight_decay,
        "--end-weight-decay": a.end_weight_decay,
        "the weight-decay ramp in samples (--train-iters)": a.train_iters * gbs,
        "--weight-decay-incr-style": a.weight_decay_incr_style,
    }


def _schedule_problem(saved, args):
    """The learning-rate schedule differs and nothing says which one to use: Megatron would stop
    on an assertion after building the model."""
    if (
        args.override_opt_param_scheduler
        or args.use_checkpoint_opt_param_scheduler
        or args.finetune
        or args.no_load_optim
        or not args.train_iters
        or not getattr(saved, "train_iters", None)
    ):
        return None
    try:
        here, there = _schedule(args), _schedule(saved)
    except (AttributeError, TypeError):  # an older checkpoint's arguments: Megatron checks
        return None
    for what, value in here.items():
        if there[what] != value:
            return (
                f"the checkpoint's learning-rate schedule differs: {what} is {there[what]!r} "
                f"there, {value!r} here; add --override-opt-param-scheduler to use this run's "
                "schedule, or --use-checkpoint-opt-param-scheduler to keep the checkpoint's"
            )
    return None


def _gpt_into_hybrid(saved, args):
    """A GPT checkpoint loaded into a ``HybridModel`` (Megatron translates its keys at load time,
    ``gpt_checkpoint_interop``): its layer count is the pattern's GPT layers, not the hybrid
    layers (each GPT layer is a ``*`` and a ``-``). Returns the arguments Megatron's comparison
    skips then ({"num_layers"}), after checking that pairing; None for any other load."""
    pattern = getattr(args, "hybrid_layer_pattern", None)
    saved_pattern = getattr(saved, "hybrid_layer_pattern", None) or getattr(
        saved, "hybrid_override_pattern", None
    )
    if not pattern or saved_pattern:
        return None
    from megatron.core.dist_checkpointing.gpt_checkpoint_interop import gpt_compatible_layer_maps

    try:
        gpt_layers = gpt_compatible_layer_maps(pattern).num_gpt_layers
    except ValueError as exc:
        raise OasesConfigError(
            f"--load {args.load} holds a GPT checkpoint that --hybrid-layer-pattern {pattern!r} "
            f"cannot take: {_first_line(exc)}"
        ) from None
    if getattr(saved, "num_layers", gpt_layers) != gpt_layers:
        raise OasesConfigError(
            f"--load {args.load} holds a GPT checkpoint of {saved.num_layers} layers; "
            f"--hybrid-layer-pattern {pattern!r} pairs with {gpt_layers} (one '*' and one '-' "
            "per GPT layer)"
        )
    return {"num_layers"}


def check_nothing_to_load(args):
    """``--load`` without a checkpoint: right for a run's first start when it is also the
    ``--save`` directory (the restart-safe idiom: say so once), a mistyped resume otherwise."""
    load = args.load
    if same_dir(load, getattr(args, "save", None)):
        if is_job_rank_0():
            print(
                f"oases: --load {load} holds no checkpoint yet: training starts from scratch",
                file=sys.stderr,
                flush=True,
            )
        return
    if not os.path.exists(load):
        raise OasesConfigError(
            f"--load {load} does not exist; check the path, or drop --load to start from scratch"
        )
    raise OasesConfigError(
        f"--load {load} holds no checkpoint (no {TRACKER}); check the path, or drop --load to "
        "start from scratch"
    )


def check_load(args):
    """Raise :class:`OasesConfigError` if ``--load`` holds a damaged checkpoint or one of another
    model."""
    if not args.load:
        return
    safe_save.recover(args.load)
    if not os.path.lexists(os.path.join(args.load, TRACKER)):  # a FIFO or link there: read
        check_nothing_to_load(args)
        return  # the --save directory of a run's first start: Megatron starts from scratch
    ckpt_format = getattr(args, "ckpt_format", None)
    iteration = check_tracker(args.load, ckpt_format)
    from megatron.training import checkpointing

    load = require_symbol(checkpointing, "_load_base_checkpoint")
    check = require_symbol(checkpointing, "check_checkpoint_args")
    try:
        with warnings.catch_warnings():  # "single process" and API notes of this read-only peek
            warnings.simplefilter("ignore")
            state_dict, _, _, _ = load(args.load, args, rank0=True)
    except (Exception, SystemExit) as exc:  # noqa: BLE001 - an unreadable checkpoint is the user's
        raise OasesConfigError(
            f"--load {args.load}: cannot read the checkpoint ({_first_line(exc)}); "
            f"{_older(args.load, but=iteration, ckpt_format=ckpt_format)}"
        ) from None
    except BaseException as exc:  # torch's CheckpointException is a BaseException
        if type(exc).__name__ != "CheckpointException":
            raise
        raise OasesConfigError(
            f"--load {args.load}: cannot read the checkpoint ({_first_line(exc)}); "
            f"{_older(args.load, but=iteration, ckpt_format=ckpt_format)}"
        ) from None
    saved = (state_dict or {}).get("args")
    if saved is None:
        return
    check_torch_format_plan(args.load, iteration, saved)
    version = state_dict.get("checkpoint_version", 0)
    if ckpt_format in DCP_FORMATS and "checkpoint_version" not in state_dict:
        version = 3.0  # torch_dcp's peek reads only args and iteration; every save writes 3.0
    checkpointing.set_checkpoint_version(version)
    problems = []
    skip = _gpt_into_hybrid(saved, args)
    try:
        check(saved, **({"skip_args": skip} if skip else {}))
    except AssertionError as exc:
        problems.append(str(exc).strip())
    for name in MODEL_FLAGS:
        if _value(saved, name) != _value(args, name):
            if name == "padded_vocab_size":
                vocab = (getattr(saved, "vocab_size", None), getattr(args, "vocab_size", None))
                if None in vocab or vocab[0] == vocab[1]:
                    problems.append(_vocab_problem(saved, args))
                else:
                    problems.append(
                        f"--vocab-size is {vocab[0]} in the checkpoint, {vocab[1]} here."
                    )
                continue
            problems.append(
                f"{_flag(name)} is {_value(saved, name)!r} in the checkpoint, "
                f"{_value(args, name)!r} here."
            )
    if problems:
        problem = problems[0]
        if "make-vocab-size-divisible-by" in problem:
            raise OasesConfigError(f"--load {args.load}: {problem}")
        raise OasesConfigError(
            f"--load {args.load} holds a checkpoint of another model: {problem} Use the "
            "model flags it was saved with, or another --load directory"
        )
    problem = _optimizer_problem(saved, args) or _schedule_problem(saved, args)
    if problem:
        raise OasesConfigError(f"--load {args.load}: {problem}")


def _optimizer_problem(saved, args):
    """The checkpoint's optimizer state is laid out for the other optimizer: saved with
    ``--use-distributed-optimizer`` and loaded without it (Megatron-Core's load stops on a
    ``KeyError`` for the optimizer's keys, which the load patch called "damaged"), or the reverse
    (a ``CheckpointingException``, "ShardedTensor.flattened_range is not supported"). The
    checkpoint is intact: name the flag, and ``--no-load-optim`` (under which both load)."""
    if args.no_load_optim or args.finetune:
        return None
    if (getattr(args, "ckpt_format", None) or "torch_dist") != "torch_dist":
        return None  # the torch format and FSDP's formats lay optimizer state out otherwise
    if getattr(args, "use_torch_fsdp2", False) or getattr(args, "use_megatron_fsdp", False):
        return None
    there = bool(getattr(saved, "use_distributed_optimizer", False))
    if there == bool(getattr(args, "use_distributed_optimizer", False)):
        return None
    if there:
        return (
            "the checkpoint was saved with --use-distributed-optimizer and is intact: its "
            "optimizer state is sharded for the distributed optimizer; add "
            "--use-distributed-optimizer to resume it, or --no-load-optim to start a new "
            "optimizer from its weights"
        )
    return (
        "the checkpoint was saved without --use-distributed-optimizer and is intact: "
        "Megatron-Core cannot load its optimizer state into the distributed optimizer; drop "
        "--use-distributed-optimizer to resume it, or add --no-load-optim to start a new "
        "distributed optimizer from its weights"
    )


def _plan_degrees(path):
    """The per-layer degrees of the plan file ``path``, or None when it cannot be read (through
    the one bounded reader)."""
    from ..formats import read_json

    try:
        return [int(d) for d in read_json(path, "plan file", None)["degrees"]]
    except (OasesConfigError, ValueError, KeyError, TypeError):
        return None


def check_torch_format_plan(load_dir, iteration, saved):
    """A ``--ckpt-format torch`` checkpoint saved under a per-layer plan holds each layer at its
    plan's TMP degree (only torch_dist's save rewrites a plan's shards into the stock layout,
    :mod:`megatron_oases.layer_degrees.checkpoint`): no other layout can load it. Refused here, with one
    line, rather than by a shape mismatch on every rank. (New saves of that kind are refused by
    :func:`megatron_oases.validation.check_plan_checkpoint_format`.)"""
    plan = getattr(saved, "oases_plan", None)
    if not plan or iteration is None:
        return
    if torch_format_files(os.path.join(load_dir, f"iter_{iteration:07d}")) is None:
        return
    T = getattr(saved, "tensor_model_parallel_size", 1)
    degrees = _plan_degrees(plan)
    if degrees is not None and all(d == T for d in degrees):
        return  # a uniform plan: the stock layout
    raise OasesConfigError(
        f"--load {load_dir}: the checkpoint of iteration {iteration} was saved in --ckpt-format "
        f"torch under the per-layer plan {plan}, each layer at the plan's TMP degree, a layout "
        "that neither stock Megatron nor another plan can load; resume from a checkpoint saved "
        "in --ckpt-format torch_dist (the default), which keeps a plan's checkpoint in the "
        "stock layout"
    )


def make_load_patch(load_dir):
    """Megatron's checkpoint load with its errors (torch's ``CheckpointException``, a
    ``BaseException``, with every rank's traceback) turned into one line: ``TrainingStopped``,
    printed by the rank that saw it (a damaged shard may be read by one rank only)."""
    from megatron.core import dist_checkpointing
    from megatron.training import checkpointing

    from ..patches import Patch

    real = require_symbol(
        dist_checkpointing, "load", called_by=(checkpointing._load_global_dist_base_checkpoint,)
    )

    def load(*args, **kwargs):
        try:
            return real(*args, **kwargs)
        except BaseException as exc:
            if type(exc).__name__ != "CheckpointException" and not isinstance(
                exc, (EOFError, RuntimeError, ValueError, OSError)
            ):
                raise
            from ..errors import TrainingStopped  # not OasesConfigError: one rank may see it

            try:
                damaged = check_tracker(load_dir)
            except OasesConfigError:
                damaged = None
            raise TrainingStopped(
                f"--load {load_dir}: the checkpoint is damaged ({_first_line(exc)}); "
                f"restore it from a copy, or {_older(load_dir, but=damaged)}"
            ) from None

    return Patch("checkpoint-load-errors", [(dist_checkpointing, "load", load)])


def prepare_checkpointing(args, start_over):
    """Everything above, before ``pretrain()``: ``--save`` writable, one run's (:mod:`.save_owner`)
    and saved safely (its checkpoints replaced only with ``start_over``), ``--load`` there and
    complete and of this model, its load errors one line."""
    from ..patches import install_patch

    check_save_dir(args)
    check_load(args)
    claim_save_dir(args, start_over)  # after the checks every rank makes: rank 0 locks --save
    if args.load and os.path.isfile(os.path.join(args.load, TRACKER)):
        install_patch(make_load_patch(args.load))
    safe_save.install(args)
