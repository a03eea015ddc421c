"""The two calls ``patches/pretrain_gpt.oases.patch`` adds to Megatron-LM's ``pretrain_gpt.py``
(:func:`extra_args_provider`, :func:`install`) and the hook on ``setup_model_and_optimizer`` that
installs the patches once the distributed state is up (see the package docstring)."""

import atexit
import functools
import os
import sys

from .. import patches
from ..arguments import ALWAYS_DEFAULTS, add_oases_args, default_max_connections
from ..config import OasesConfig
from ..errors import OasesConfigError, report_once

#: The Megatron-LM tag ``patches/pretrain_gpt.oases.patch`` is written against.
MEGATRON_LM_TAG = "core_v0.19.0"
MEGATRON_LM_URL = "https://github.com/NVIDIA/Megatron-LM"
#: Name of the hook patch in :data:`megatron_oases.patches.REGISTRY`.
HOOK_PATCH = "megatron-lm-model-setup"


def _chain(*providers):
    providers = [p for p in providers if p is not None]

    def chained(parser):
        for provider in providers:
            result = provider(parser)
            parser = parser if result is None else result  # Megatron's convention: return it
        return parser

    chained.providers = tuple(providers)
    return chained


def _local_transformer_impl_default(parser):
    """Our ``ALWAYS_DEFAULTS`` as parser defaults: an explicit flag on the command line still wins."""
    for flag, value in ALWAYS_DEFAULTS:
        for action in parser._actions:
            if flag in action.option_strings:
                parser.set_defaults(**{action.dest: value})
    return parser


def _install_cpu_shims():
    from .. import platform  # imports torch: not for the config helpers of this package

    return platform.install_cpu_shims()


def extra_args_provider(existing=None):
    """The ``extra_args_provider`` for Megatron-LM's ``parse_and_validate_args``: ``existing`` + ours.

    Call it before Megatron parses (the patch does, in the call's arguments): without CUDA it
    installs the CPU platform shims (a no-op with CUDA) and, as ``oases-pretrain-gpt`` does, sets
    ``CUDA_DEVICE_MAX_CONNECTIONS`` by Megatron's rule unless the environment sets it
    (:func:`megatron_oases.arguments.default_max_connections`).
    """
    from ..launch import die_with_launcher

    default_max_connections(sys.argv[1:])

    die_with_launcher()  # a launcher killed with SIGKILL leaves no orphan ranks
    _install_cpu_shims()
    return _chain(existing, add_oases_args, _local_transformer_impl_default)


def exit_with_error(message, status=2, rank=None):
    """Print ``message`` once per job (rank 0) and exit with ``status`` on every rank."""
    report_once(message, rank)
    sys.exit(status)


#: What ``python -m megatron_oases.megatron_lm defaults --cpu`` (the CPU_DEFAULTS) sets, by
#: Megatron's attribute names: a CUDA-less run with another value fails inside Megatron (NCCL,
#: APEX / fused kernels), once per rank.
CPU_SETTINGS = (
    ("distributed_backend", "gloo", "--distributed-backend nccl"),
    ("gradient_accumulation_fusion", False, "gradient accumulation fusion"),
    ("masked_softmax_fusion", False, "masked softmax fusion"),
    ("bias_gelu_fusion", False, "bias-GeLU fusion"),
    ("bias_swiglu_fusion", False, "bias-SwiGLU fusion"),
    ("bias_dropout_fusion", False, "bias-dropout fusion"),
    ("apply_rope_fusion", False, "RoPE fusion"),
    ("use_cpu_initialization", True, "GPU initialization"),
)


def check_cpu_settings(args, cuda=None):
    """Without CUDA, Megatron-LM's own defaults (NCCL, fused kernels) fail on every rank with a
    traceback: name the flags that ``oases-pretrain-gpt`` adds itself and a patched
    ``pretrain_gpt.py`` needs spelled out."""
    if cuda is None:
        import torch

        cuda = torch.cuda.is_available()
    if cuda:
        return
    wrong = [what for name, cpu, what in CPU_SETTINGS if getattr(args, name, cpu) != cpu]
    if wrong:
        raise OasesConfigError(
            f"no CUDA GPU here, but Megatron-LM's GPU defaults are on ({', '.join(wrong)}); add "
            "the CPU settings to the command line: "
            "$(python -m megatron_oases.megatron_lm defaults --cpu)"
        )


def install(args, prog=None):
    """After Megatron parsed ``args``, before ``pretrain()``: check the Oases flags, hook the build.

    A rejected combination exits with one ``<prog>: error: ...`` line and status 2
    (:func:`exit_with_error`). Idempotent. :func:`uninstall` reverts the hook and every Oases patch;
    it is registered to run at exit, which is when ``--oases-trace`` writes its trace files.
    """
    prog = prog or os.path.basename(sys.argv[0] or "pretrain_gpt.py")
    try:
        from ..compat import check_megatron_core

        check_megatron_core()
        config = OasesConfig.from_args(args)  # Megatron validated args already
        hook = model_setup_hook(args, config)
        check_cpu_settings(args)
        from ..training.preflight import check_before_training

        check_before_training(args, config)  # data paths, checkpoints: as oases-pretrain-gpt
    except OasesConfigError as exc:
        exit_with_error(f"{prog}: error: {exc}")
    _install_cpu_shims()  # already done by extra_args_provider(); a no-op with CUDA
    if not patches.is_installed(HOOK_PATCH):
        atexit.register(uninstall)
    return patches.install_patch(hook)


def uninstall():
    """Revert :func:`install` and every patch it led to."""
    return patches.uninstall_all()


def model_setup_hook(args, config, training_module=None):
    """A :class:`~megatron_oases.patches.Patch` on ``megatron.training.training.setup_model_and_optimizer``.

    ``pretrain()`` calls it once, after ``initialize_megatron`` and before any model exists, with
    either a config container holding the model config (``pretrain_gpt.py`` from core_v0.19) or a
    ``model_provider_func`` (older scripts); both build the model inside it. ``args``/``config``:
    the parsed Megatron args and the checked :class:`~megatron_oases.config.OasesConfig`.
    """
    from .. import prepare
    from ..compat import require_symbol

    if training_module is None:
        from megatron.training import training as training_module
    original = require_symbol(
        training_module, "setup_model_and_optimizer", called_by=[training_module.pretrain]
    )

    runtime = prepare.RuntimeOnce(config)

    def prepare_stages(stages):
        for stage in stages:
            prepare.prepare_model(stage, runtime.get())
        return stages

    @functools.wraps(original)
    def setup_model_and_optimizer(model_type, model_provider_func=None, *rest, **kwargs):
        runtime.get()  # the run's runtime: after initialize_megatron, before any model
        if prepare.changes_model(config):
            model_cfg = getattr(kwargs.get("cfg_container"), "model", None)
            if model_cfg is not None:
                model_cfg.pre_wrap_hooks.append(prepare_stages)
            elif model_provider_func is not None:
                model_provider_func = _provider_then(model_provider_func, prepare_stages)
        return original(model_type, model_provider_func, *rest, **kwargs)

    return patches.Patch(
        HOOK_PATCH, [(training_module, "setup_model_and_optimizer", setup_model_and_optimizer)]
    )


def _provider_then(model_provider_func, prepare_stages):
    @functools.wraps(model_provider_func)
    def provider(*a, **k):
        model = model_provider_func(*a, **k)
        prepare_stages([model])
        return model

    return provider
