"""Arguments: Megatron-LM's own parser and checks, plus the ``--oases-*`` group and its rules.

Every entry point (``oases-pretrain-gpt``, ``oases train``, ``oases compare``, ``oases profile``,
the tests) parses the same way: :func:`with_defaults` adds the flags a CPU run needs and a user
should not have to know about, Megatron's ``parse_args``/``validate_args`` check the Megatron side
(their assertion messages become one error line), and :meth:`.config.OasesConfig.from_args` the
Oases side, once.
"""

import contextlib
import io
import os
import sys

from .config import OasesConfig, transformer_engine_installed
from .errors import OasesConfigError
from .tuning.candidates import AUTO, DROP_MARGIN, MIN_TRIAL, RETUNE_STEPS, TUNE_SHARE
from .validation import (
    CUDA_GRAPH_MODES,
    SCHEDULES,
    SPLITS,
    SUB_BATCHES,
    check_model_shape,
    check_transformer_impl,
)

#: Added when absent on a machine without CUDA: Megatron's defaults there need APEX/TE kernels.
CPU_DEFAULTS = (
    ("--distributed-backend", "gloo"),
    ("--no-gradient-accumulation-fusion", None),
    ("--no-persist-layer-norm", None),
    ("--no-masked-softmax-fusion", None),
    ("--no-bias-gelu-fusion", None),
    ("--no-bias-swiglu-fusion", None),
    ("--no-bias-dropout-fusion", None),
    ("--no-rope-fusion", None),
    ("--use-cpu-initialization", None),
)
#: Added to :data:`CPU_DEFAULTS` under ``--use-megatron-fsdp``: gloo has no ``PREMUL_SUM``, with
#: which Megatron-FSDP divides gradients inside their reduction; this is its own other path (the
#: same factor multiplied in before a SUM; platform/megatron_fsdp.py).
MEGATRON_FSDP_CPU_DEFAULTS = (("--no-gradient-reduce-div-fusion", None),)
#: Added when absent everywhere: our patches act on Megatron-Core's local linears.
ALWAYS_DEFAULTS = (("--transformer-impl", "local"),)
#: ``oases train`` only: a tiny model on mock data, so that a demo needs only the flags it varies.
DEMO_DEFAULTS = (
    ("--num-layers", "2"),
    ("--hidden-size", "64"),
    ("--num-attention-heads", "4"),
    ("--seq-length", "32"),
    ("--max-position-embeddings", "32"),
    ("--micro-batch-size", "2"),
    ("--train-iters", "10"),
    ("--lr", "1e-3"),
    ("--log-interval", "1"),
)
#: With ``--mock-data`` and no tokenizer given: token ids need no vocabulary files.
MOCK_DATA_DEFAULTS = (("--tokenizer-type", "NullTokenizer"), ("--vocab-size", "512"))
#: Megatron-LM computes ``train_iters // eval_interval`` and needs a save interval with --save.
LOOP_DEFAULTS = (("--eval-interval", "1000000"), ("--eval-iters", "0"))


EMULATE_LINK_HELP = (
    "testbed emulation, not a measurement: every collective completes no earlier than D x its "
    "ring alpha-beta time on PROFILE's links (a packaged cluster profile name, e.g. "
    "rtx3090-pcie, or a YAML path), D = the target GPU's rate / this host's matmul rate (per "
    "rank; see oases calibrate)"
)


def _escape_bare_percent(parser):
    """``--help`` of megatron-core 0.19 crashes on a help text with a bare ``%`` ("10%)"):
    escape such texts so that argparse can format them (Megatron's parsing is unaffected)."""
    import re

    for action in parser._actions:
        if action.help and "%" in action.help:
            try:
                parser._get_formatter()._expand_help(action)
            except (ValueError, TypeError, KeyError):
                action.help = re.sub(
                    r"%%|%\(\w+\)[a-zA-Z]|%",
                    lambda m: m[0] if len(m[0]) > 1 else "%%",
                    action.help,
                )


def add_oases_args(parser):
    """The ``oases`` argument group (Megatron-LM's ``extra_args_provider`` convention)."""
    _escape_bare_percent(parser)
    g = parser.add_argument_group("oases")
    g.add_argument(
        "--oases-schedule",
        choices=SCHEDULES + (AUTO,),
        default="off",
        help="off = stock Megatron; overlap = two sub-batches, TMP all-reduce overlapped with the "
        "other sub-batch's compute; cross-pass = + recompute and backward merged; oases = + "
        "fine-grained recomputation (no all-reduce in recompute); auto = the first iterations "
        "time stock and every schedule (and sub-batch count, CUDA graphs) that can run with "
        "these flags, interleaved, and the rest of the run keeps the fastest: rank 0 prints the "
        "table and the flags that pin it, --log-json and checkpoints keep the choice",
    )
    g.add_argument(
        "--oases-sub-batches",
        type=int,
        default=None,
        metavar="N",
        help=f"sub-batches per micro-batch for the overlapped schedules (default {SUB_BATCHES}, "
        "the paper's; auto tries 2 and 4 unless given): with N, only 1/N of the last block's "
        "all-reduce per pass stays exposed, at the cost of N-times smaller matmuls; needs "
        "--micro-batch-size >= N and a split schedule or auto (refused under off)",
    )
    g.add_argument(
        "--oases-tune-steps",
        type=int,
        default=None,
        metavar="N",
        help="--oases-schedule auto: the trial takes at most N iterations (default: a warm-up "
        f"and 3 timed steps per candidate, at most {round(100 * TUNE_SHARE)}%% of the run: "
        "--train-iters, or --train-samples over --global-batch-size; "
        f"at least {MIN_TRIAL}, at most the run). The trial's steps train the model like "
        "any others; refused without auto",
    )
    g.add_argument(
        "--oases-retune",
        action="store_true",
        help="--oases-schedule auto, resumed (--load): time the schedules again instead of "
        "keeping the choice saved in the checkpoint; refused without auto or --load",
    )
    g.add_argument(
        "--oases-retune-interval",
        type=int,
        default=None,
        metavar="N",
        help="--oases-schedule auto: every N iterations after the choice, re-time the last "
        f"timing's best two (the choice and the runner-up; up to {RETUNE_STEPS} iterations, "
        "interleaved, the runner-up after a warm-up step) and switch if the runner-up is now "
        f"clearly faster (the choice's fastest step over {round(100 * DROP_MARGIN)}%% slower "
        f"than its slowest); N > {RETUNE_STEPS}. Re-timing steps train the model like any "
        "others; refused without auto",
    )
    g.add_argument(
        "--oases-split",
        choices=SPLITS,
        default="batch",
        help="how the overlapped schedules cut a micro-batch into sub-batches: batch = whole "
        "samples (the paper's; needs --micro-batch-size >= --oases-sub-batches); sequence = "
        "consecutive chunks of each sample's sequence, a later chunk attending to the earlier "
        "chunks' keys and values (runs --micro-batch-size 1; unfused attention, no SP, no plan; "
        "sequence is refused under off)",
    )
    g.add_argument(
        "--oases-cuda-graphs",
        nargs="?",
        const="capture",
        choices=CUDA_GRAPH_MODES,
        default=None,
        metavar="MODE",
        help="CUDA only: replay each block's attention / MLP (between its layernorm and its TMP "
        "reduction) from a CUDA graph, one launch where the host issued dozens of kernels; "
        "static memory per block and sub-batch, no attention dropout. 'eager' runs the same "
        "bookkeeping without graphs (debugging, any device). Needs a split schedule or auto "
        "(refused under off). Checked on an H100 by benchmarks/gpu/check.sh (step graphs)",
    )
    g.add_argument(
        "--oases-trace",
        default=None,
        help="write a Chrome-trace JSON of the last iteration per rank (any schedule, off "
        "included): PATH with '{rank}' in it, or PATH.rank<R>.json",
    )
    g.add_argument(
        "--oases-plan",
        default=None,
        metavar="PLAN_JSON",
        help="per-layer TMP degrees (plan file from `oases plan`); --tensor-model-parallel-size "
        "is the TMP domain",
    )
    g.add_argument(
        "--oases-start-over",
        action="store_true",
        help="let this run replace the checkpoints another run left in --save (without it, a run "
        "into a --save directory holding checkpoints must resume from them: --load the same "
        "directory); refused without --save or with --load the --save directory",
    )
    g.add_argument(
        "--emulate-link",
        default=None,
        metavar="PROFILE",
        help=EMULATE_LINK_HELP,
    )
    g.add_argument(
        "--log-json",
        default=None,
        help="write Megatron functional-test golden values (lm loss, iteration-time, "
        "tokens-per-sec, throughput, mem-allocated-bytes) per iteration to this JSON file from "
        "the last rank, rewritten every iteration",
    )
    return parser


def _has(argv, flag):
    return any(tok == flag or tok.startswith(flag + "=") for tok in argv)


def flag_value(argv, flag):
    """Value of the last ``flag VALUE`` / ``flag=VALUE`` in argv, or None."""
    value = None
    for i, tok in enumerate(argv):
        if tok == flag and i + 1 < len(argv):
            value = argv[i + 1]
        elif tok.startswith(flag + "="):
            value = tok.split("=", 1)[1]
    return value


def _demo_length(argv, flag, value):
    """The demo's sequence length and position table follow the one the user gave: a filled-in
    ``--max-position-embeddings 32`` under ``--seq-length 512`` would fail on a value the user
    never wrote (and a filled-in ``--seq-length 32`` over a shorter table likewise)."""
    if flag == "--max-position-embeddings":
        return flag_value(argv, "--seq-length") or value
    if flag == "--seq-length":
        table = flag_value(argv, "--max-position-embeddings")
        if table is not None and table.isdigit() and int(table) < int(value):
            return table
    return value


def with_defaults(argv, demo=False, cuda=None):
    """argv plus the defaults above that it does not set (a user's flag always wins)."""
    import torch

    cuda = torch.cuda.is_available() if cuda is None else cuda
    argv = list(argv)
    impl = flag_value(argv, "--transformer-impl")
    if impl not in (None, "local"):  # before the defaults below, which assume the local spec
        schedule = flag_value(argv, "--oases-schedule") or "off"
        plan = bool(flag_value(argv, "--oases-plan"))
        check_transformer_impl(impl, schedule, plan, te_installed=transformer_engine_installed())
    groups = [ALWAYS_DEFAULTS, LOOP_DEFAULTS]
    if not cuda:
        groups.append(CPU_DEFAULTS)
        if _has(argv, "--use-megatron-fsdp"):
            groups.append(MEGATRON_FSDP_CPU_DEFAULTS)
    if demo:
        groups.append(DEMO_DEFAULTS)
        if not _has(argv, "--data-path") and not _has(argv, "--mock-data"):
            argv.append("--mock-data")
    if _has(argv, "--mock-data") and not _has(argv, "--tokenizer-type"):
        groups.append(MOCK_DATA_DEFAULTS)
    for group in groups:
        for flag, value in group:
            if _has(argv, flag):
                continue
            if flag == "--vocab-size" and _has(argv, "--vocab-file"):
                continue
            if flag == "--train-iters" and _has(argv, "--train-samples"):
                continue  # sample-based training: Megatron refuses both
            value = _demo_length(argv, flag, value) if group is DEMO_DEFAULTS else value
            argv += [flag] if value is None else [flag, value]
    if not _has(argv, "--save") and not _has(argv, "--rerun-mode"):
        # Megatron's default rerun mode answers a NaN/Inf loss by saving a checkpoint for a
        # re-run on another GPU, and crashes when there is no --save: stop with its message.
        argv += ["--rerun-mode", "disabled"]
    if _has(argv, "--save") and not _has(argv, "--save-interval"):
        argv += ["--save-interval", flag_value(argv, "--train-iters") or "1000000"]
    return argv


@contextlib.contextmanager
def _argv(prog, argv):
    saved = sys.argv
    sys.argv = [prog] + list(argv)
    try:
        yield
    finally:
        sys.argv = saved


def _one_line(exc):
    """The exception's first line; for a bare ``assert`` the asserted condition and its place."""
    import traceback

    text = str(exc).strip().splitlines()
    if text:
        return text[0]
    frame = traceback.extract_tb(exc.__traceback__)[-1]
    return f"{frame.line} ({os.path.basename(frame.filename)}:{frame.lineno})"


#: Megatron's sharded data parallelism: its checks refuse ``CUDA_DEVICE_MAX_CONNECTIONS=1``.
FSDP_FLAGS = ("--use-torch-fsdp2", "--use-megatron-fsdp")
MAX_CONNECTIONS = "CUDA_DEVICE_MAX_CONNECTIONS"
#: Set where :func:`default_max_connections` chose the value (jobs run one after another in one
#: process, e.g. ``oases compare``'s passes, each get the value of their own flags).
_MAX_CONNECTIONS_OURS = "OASES_DEFAULT_MAX_CONNECTIONS"


def default_max_connections(argv):
    """Megatron's own rule for ``CUDA_DEVICE_MAX_CONNECTIONS`` where the environment does not set
    it: 1 (Megatron asks for it with TP > 1 before Blackwell, and the split schedules need launch
    order = issue order on GPUs), but unset under FSDP, whose checks refuse 1 (Megatron then only
    warns about TP; docs/megatron-lm.md says what it costs)."""
    if os.environ.get(_MAX_CONNECTIONS_OURS) == "1":  # an earlier job of this process set it
        os.environ.pop(MAX_CONNECTIONS, None)
        os.environ.pop(_MAX_CONNECTIONS_OURS)
    if MAX_CONNECTIONS in os.environ or any(a.split("=", 1)[0] in FSDP_FLAGS for a in argv):
        return
    os.environ[MAX_CONNECTIONS] = "1"
    os.environ[_MAX_CONNECTIONS_OURS] = "1"


def parse_megatron_args(argv, prog="oases-pretrain-gpt", world_size=None, set_globals=False):
    """Megatron-LM's parse + validate of ``argv`` (defaults already added), then ours; the
    parsed args (:func:`parse_args_and_config` also gives the checked :class:`OasesConfig`)."""
    return parse_args_and_config(argv, prog, world_size, set_globals)[0]


def parse_args_and_config(argv, prog="oases-pretrain-gpt", world_size=None, set_globals=False):
    """``(args, OasesConfig)`` from ``argv``: Megatron's parse and checks, then ours, once.

    ``set_globals`` sets Megatron's global args/tokenizer/timers (what ``pretrain`` needs);
    without it nothing global changes, so the CLI and tests can check a command line up front.
    Raises :class:`OasesConfigError` with one line for any rejected combination.
    """
    from megatron.training import arguments as margs

    default_max_connections(argv)
    with _argv(prog, argv):
        err = io.StringIO()
        try:
            with contextlib.redirect_stderr(err):
                args = margs.parse_args(add_oases_args)
        except SystemExit as exc:  # argparse's usage and message (or --help's text on stdout)
            if exc.code in (0, None):
                sys.stderr.write(err.getvalue())
                raise
            errors = [ln for ln in err.getvalue().splitlines() if ": error: " in ln]
            if errors:  # "prog: error: argument --hidden-size: invalid int value: 'x'"
                message = errors[-1].split(": error: ", 1)[1]
                raise OasesConfigError(f"{message}; see {prog} --help") from None
            sys.stderr.write(err.getvalue())
            raise OasesConfigError(f"invalid command line (exit {exc.code}); see {prog} --help")
        sys.stderr.write(err.getvalue())  # whatever else parsing printed (warnings)
    if world_size is not None:
        args.world_size = world_size
    check_model_shape(args)
    config = OasesConfig.from_args(args, validate_megatron=_validate_megatron)
    if set_globals:
        from megatron.training.global_vars import set_global_variables

        set_global_variables(args)
    return args, config


def _validate_megatron(args):
    """Megatron's ``validate_args``, its assertion as one error line; then the model sizes again
    (Megatron derives ``ffn_hidden_size``)."""
    from megatron.training import arguments as margs

    from . import platform

    installed = platform.install_cpu_shims()  # validate_args queries the device (no-op on CUDA)
    try:
        margs.validate_args(args, {"tokenizer_type": "GPT2BPETokenizer"})
    except (AssertionError, ValueError, RuntimeError, ZeroDivisionError) as exc:
        raise OasesConfigError(f"Megatron rejects the arguments: {_one_line(exc)}") from exc
    finally:
        if installed:  # leave the process as we found it
            platform.uninstall_cpu_shims()
    check_model_shape(args)
