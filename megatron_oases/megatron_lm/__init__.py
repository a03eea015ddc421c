"""Megatron-LM integration: the ``--oases-*`` flags and patch install inside ``pretrain_gpt.py``.

Two ways in, sharing the helpers below:

* ``oases-pretrain-gpt`` / ``oases run`` (:mod:`megatron_oases.pretrain_gpt_oases`): runs a
  Megatron-LM checkout's ``pretrain_gpt.py`` machinery unmodified, with our flags chained in;
* ``patches/pretrain_gpt.oases.patch``: the same calls written into a fork's ``pretrain_gpt.py``.

What they do, in Megatron-LM's order of events:

1. argv: ``--transformer-impl local`` is added when absent (TE linears do their own TP
   communication and bypass the layers the patches act on); an explicit other value is an error
   (:func:`force_local_transformer_impl`).
2. parsing: :func:`chain_extra_args_providers` keeps any existing ``extra_args_provider``
   (``pretrain_gpt.py`` passes ``add_modelopt_args`` when ModelOpt is importable) and adds
   :func:`add_args` — the ``oases`` group of ``oases train``
   (:func:`megatron_oases.arguments.add_oases_args`) plus ``--log-json``. :func:`prepare` parses
   once with Megatron-LM's ``parse_args`` and validates before ``pretrain`` starts anything.
3. model build: :func:`wrap_builder` wraps ``gpt_builder``; its first call (distributed state is
   up, the model not yet built) runs :func:`install_patches`: validate
   (:func:`validate_megatron_args`), then
   :func:`megatron_oases.patches.install_from_args`, plus a golden-values recorder on
   ``megatron.training.training.training_log`` when ``--log-json`` is given.
"""

import importlib
import json
import os
import sys
import time

from ..arguments import add_oases_args
from ..errors import OasesConfigError

#: The Megatron-LM tag this integration (and ``patches/``) is written against.
MEGATRON_LM_TAG = "core_v0.16.0"
MEGATRON_LM_URL = "https://github.com/NVIDIA/Megatron-LM"
#: Environment variable naming a Megatron-LM checkout (alternative to putting it on PYTHONPATH).
MEGATRON_LM_DIR_ENV = "MEGATRON_LM_DIR"

_STATE = {"installed": False}


def missing_megatron_lm_message(detail):
    return (
        f"Megatron-LM is not importable ({detail}): the megatron-core wheel ships only "
        f"megatron.core; check out Megatron-LM tag {MEGATRON_LM_TAG} (git clone --branch "
        f"{MEGATRON_LM_TAG} {MEGATRON_LM_URL}) and put it on PYTHONPATH or set "
        f"{MEGATRON_LM_DIR_ENV}=/path/to/Megatron-LM"
    )


def import_pretrain_gpt():
    """Import Megatron-LM's ``megatron.training`` and ``pretrain_gpt`` (from a checkout).

    Raises :class:`OasesConfigError` (one line naming the tag to check out) when the checkout is
    missing, and a different one-liner when the checkout is there but one of its own dependencies is
    not installed.
    """
    root = os.environ.get(MEGATRON_LM_DIR_ENV)
    if root:
        if not os.path.isfile(os.path.join(root, "pretrain_gpt.py")):
            raise OasesConfigError(
                missing_megatron_lm_message(f"{MEGATRON_LM_DIR_ENV}={root} has no pretrain_gpt.py")
            )
        root = os.path.abspath(root)
        if root not in sys.path:
            sys.path.insert(0, root)
    for module in ("megatron.training", "pretrain_gpt"):
        try:
            importlib.import_module(module)
        except ModuleNotFoundError as exc:
            if exc.name in ("megatron", "megatron.training", "pretrain_gpt"):
                raise OasesConfigError(
                    missing_megatron_lm_message(f"no module named {exc.name!r}")
                ) from exc
            raise OasesConfigError(
                f"importing Megatron-LM's {module} failed: no module named {exc.name!r}; install "
                f"Megatron-LM's requirements (pip install {exc.name.split('.')[0]})"
            ) from exc
    return sys.modules["pretrain_gpt"]


# --------------------------------------------------------------------------------------------- argv


def _flag_value(argv, flag):
    """Value of the last ``flag VALUE`` / ``flag=VALUE`` in argv, or None."""
    value = None
    for i, tok in enumerate(argv):
        if tok == flag and i + 1 < len(argv):
            value = argv[i + 1]
        elif tok.startswith(flag + "="):
            value = tok.split("=", 1)[1]
    return value


def force_local_transformer_impl(argv):
    """Return argv with ``--transformer-impl local`` (added when absent; another value is an error).

    Megatron-LM's default is ``transformer_engine``, whose linears do their own TP communication;
    the Oases patches act on Megatron-Core's local linears.
    """
    argv = list(argv)
    value = _flag_value(argv, "--transformer-impl")
    if value is None:
        return argv + ["--transformer-impl", "local"]
    if value != "local":
        raise OasesConfigError(
            f"--transformer-impl {value} is not supported: TE linears do their own TP "
            "communication; use --transformer-impl local (or leave the flag out)"
        )
    return argv


# ------------------------------------------------------------------------------------------ parsing


def add_args(parser):
    """``extra_args_provider`` for Megatron-LM: the ``oases`` group plus ``--log-json``."""
    add_oases_args(parser)
    g = parser.add_argument_group("oases golden values")
    g.add_argument(
        "--log-json",
        default=None,
        help="write Megatron functional-test golden values (lm loss, iteration-time, "
        "mem-allocated-bytes) to this JSON file from the last rank, rewritten every iteration",
    )
    return parser


def chain_extra_args_providers(*providers):
    """One ``extra_args_provider`` applying each given provider in order (``None`` entries skipped).

    A provider may return the parser (Megatron's convention) or ``None`` (then the same parser is
    kept).
    """
    providers = [p for p in providers if p is not None]

    def chained(parser):
        for provider in providers:
            result = provider(parser)
            parser = parser if result is None else result
        return parser

    chained.providers = tuple(providers)
    return chained


def extra_args_provider(existing=None):
    """The provider to pass to ``pretrain(..., extra_args_provider=...)``: ``existing`` + ours."""
    return chain_extra_args_providers(existing, add_args)


def prepare(existing_provider=None, argv=None):
    """Everything before ``pretrain(...)``: returns the ``extra_args_provider`` to pass it.

    Forces ``--transformer-impl local`` into ``sys.argv`` (Megatron-LM parses ``sys.argv``), chains
    ``existing_provider`` with :func:`add_args`, parses once with Megatron-LM's ``parse_args`` and
    validates our flags — so a bad combination fails before any process group starts. ``argv``
    (program name excluded) replaces ``sys.argv[1:]`` when given. Raises :class:`OasesConfigError`.
    """
    from megatron.training.arguments import parse_args

    args_in = sys.argv[1:] if argv is None else list(argv)
    sys.argv[:] = sys.argv[:1] + force_local_transformer_impl(args_in)
    provider = extra_args_provider(existing_provider)
    validate_megatron_args(parse_args(provider, ignore_unknown_args=False))
    return provider


def prepare_or_exit(existing_provider=None, prog="pretrain_gpt.py"):
    """:func:`prepare` for scripts: a user error is printed as one line and exits with status 2."""
    try:
        return prepare(existing_provider)
    except OasesConfigError as exc:
        print(f"{prog}: error: {exc}", file=sys.stderr, flush=True)
        sys.exit(2)


# ----------------------------------------------------------------------------------------- validate


def validate_megatron_args(args):
    """Reject combinations the Oases patches do not support, on Megatron-LM's parsed args."""
    impl = getattr(args, "transformer_impl", "local")
    if impl != "local":
        raise OasesConfigError(
            f"--transformer-impl {impl} is not supported: TE linears do their own TP "
            "communication; use --transformer-impl local"
        )
    if getattr(args, "oases_plan", None):
        raise OasesConfigError(
            "--oases-plan (per-layer TMP) runs with `oases train` only: Megatron-LM's training "
            "loop does not sync replicated-layer gradients; drop --oases-plan here"
        )
    schedule = getattr(args, "oases_schedule", "off")
    if schedule == "off":
        return args
    if getattr(args, "sequence_parallel", False):
        raise OasesConfigError(
            f"--oases-schedule {schedule} does not support --sequence-parallel (TMP all-reduce "
            "path only); drop --sequence-parallel"
        )
    if (getattr(args, "context_parallel_size", 1) or 1) != 1:
        raise OasesConfigError(
            f"--oases-schedule {schedule} does not support --context-parallel-size > 1"
        )
    if getattr(args, "num_experts", None):
        raise OasesConfigError(f"--oases-schedule {schedule} does not support MoE (--num-experts)")
    if getattr(args, "micro_batch_size", 2) is None:
        raise OasesConfigError(
            f"--oases-schedule {schedule} splits each micro-batch in two; set "
            "--micro-batch-size ≥ 2"
        )
    from ..schedule.patch import validate_schedule_args

    validate_schedule_args(args)
    return args


# ------------------------------------------------------------------------------------------ install


def install_patches(args):
    """Validate and install the patches ``args`` asks for, once per process; returns their names."""
    if _STATE["installed"]:
        return list(_STATE.get("names", []))
    from .. import patches

    validate_megatron_args(args)
    names = patches.install_from_args(args)
    if getattr(args, "log_json", None):
        patch = golden_values_patch(args.log_json)
        if patch is not None:
            patches.REGISTRY.install(patch)
            names.append(patch.name)
    _STATE.update(installed=True, names=names)
    return list(names)


def uninstall_patches():
    from .. import patches

    _STATE.update(installed=False, names=[])
    return patches.uninstall_all()


def wrap_builder(builder, args_getter=None):
    """Wrap a Megatron-LM model builder (``gpt_builder``) so patches install before the first model.

    ``builder(args, pre_process, post_process, ...)`` keeps its signature; ``args_getter`` defaults
    to ``megatron.training.get_args`` and is used when the builder is called without args.
    """

    def oases_builder(args=None, *rest, **kwargs):
        if args is None:
            getter = args_getter
            if getter is None:
                from megatron.training import get_args as getter
            args = getter()
        install_patches(args)
        return builder(args, *rest, **kwargs)

    oases_builder.__wrapped__ = builder
    oases_builder.__name__ = getattr(builder, "__name__", "builder")
    return oases_builder


# ------------------------------------------------------------------------------------ golden values


class GoldenValuesRecorder:
    """Collect per-iteration metrics and write Megatron's golden-values JSON shape.

    ``{"lm loss": {"start_step", "end_step", "step_interval", "values"}, "iteration-time": ...,
    "mem-allocated-bytes": ...}``. The file is rewritten after every iteration so a run cut short
    still leaves what it reached.
    """

    def __init__(self, path):
        self.path = path
        self.steps = []
        self.values = {"lm loss": [], "iteration-time": [], "mem-allocated-bytes": []}
        self._last = None

    def record(self, iteration, loss, now=None, mem_bytes=None):
        now = time.perf_counter() if now is None else now
        elapsed = None if self._last is None else now - self._last
        self._last = now
        if loss is None:
            return
        self.steps.append(int(iteration))
        self.values["lm loss"].append(float(loss))
        self.values["iteration-time"].append(elapsed)
        self.values["mem-allocated-bytes"].append(mem_bytes)

    def as_dict(self):
        if not self.steps:
            return {}
        start, end = self.steps[0], self.steps[-1]
        interval = self.steps[1] - self.steps[0] if len(self.steps) > 1 else 1
        out = {}
        for key, vals in self.values.items():
            if all(v is None for v in vals):
                continue
            out[key] = {
                "start_step": start,
                "end_step": end,
                "step_interval": interval,
                "values": vals,
            }
        return out

    def write(self):
        os.makedirs(os.path.dirname(os.path.abspath(self.path)) or ".", exist_ok=True)
        tmp = f"{self.path}.tmp"
        with open(tmp, "w") as f:
            json.dump(self.as_dict(), f, indent=1)
        os.replace(tmp, self.path)


def _scalar(value):
    if value is None:
        return None
    if hasattr(value, "detach"):
        value = value.detach().float()
        if value.numel() == 0:
            return None
        return value.reshape(-1)[0].item()
    if isinstance(value, (list, tuple)):
        return _scalar(value[0]) if value else None
    return float(value)


def golden_values_patch(path, training_module=None, is_logging_rank=None):
    """A :class:`Patch` wrapping ``training_log`` to record the golden values into ``path``.

    ``loss_dict`` is non-empty only on the last pipeline stage; the logging rank is the last rank
    (last stage, as in ``oases train``).
    """
    from ..patches import Patch

    if training_module is None:
        training_module = importlib.import_module("megatron.training.training")
    original = getattr(training_module, "training_log", None)
    if original is None:
        return None
    if is_logging_rank is None:
        is_logging_rank = _is_last_rank
    recorder = GoldenValuesRecorder(path)

    def training_log(loss_dict, total_loss_dict, learning_rate, iteration, *rest, **kwargs):
        result = original(loss_dict, total_loss_dict, learning_rate, iteration, *rest, **kwargs)
        if is_logging_rank():
            loss = _scalar((loss_dict or {}).get("lm loss"))
            recorder.record(iteration, loss, mem_bytes=_mem_allocated())
            if loss is not None:
                recorder.write()
        return result

    training_log.recorder = recorder
    return Patch("megatron-lm-golden-values", [(training_module, "training_log", training_log)])


def _is_last_rank():
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized():
        return True
    return dist.get_rank() == dist.get_world_size() - 1


def _mem_allocated():
    import torch

    if torch.cuda.is_available() and torch.cuda.is_initialized():
        return int(torch.cuda.memory_allocated())
    return None


__all__ = [
    "MEGATRON_LM_TAG",
    "GoldenValuesRecorder",
    "add_args",
    "chain_extra_args_providers",
    "extra_args_provider",
    "force_local_transformer_impl",
    "golden_values_patch",
    "import_pretrain_gpt",
    "install_patches",
    "missing_megatron_lm_message",
    "uninstall_patches",
    "validate_megatron_args",
    "wrap_builder",
]
