"""Megatron-LM checkout integration: the two calls ``patches/pretrain_gpt.oases.patch`` adds.

With a Megatron-LM checkout (tag :data:`MEGATRON_LM_TAG`), its own ``pretrain_gpt.py`` takes the
``--oases-*`` flags after the patch adds, in ``__main__``::

    args = parse_and_validate_args(
        extra_args_provider=oases_megatron_lm.extra_args_provider(<the existing provider>), ...)
    oases_megatron_lm.install(args)
    ...
    pretrain(full_config, ...)

* :func:`extra_args_provider` chains the provider already there (ModelOpt's when installed) with
  :func:`megatron_oases.arguments.add_oases_args`, makes ``--transformer-impl local`` the default
  (:data:`megatron_oases.arguments.ALWAYS_DEFAULTS`), and on a machine without CUDA installs the CPU
  platform shims (:func:`megatron_oases.platform.install_cpu_shims`) — Megatron's ``validate_args``,
  which runs right after the provider, already queries the GPU.
* :func:`install` checks the parsed args once into the run's settings
  (:meth:`megatron_oases.config.OasesConfig.from_args`)
  (a rejected combination: one ``pretrain_gpt.py: error: ...`` line per job, exit status 2) and
  hooks Megatron's ``setup_model_and_optimizer``: its first call — distributed state up, no model
  built yet — runs :func:`megatron_oases.prepare.install` (the schedule, trace, link
  emulation and ``--log-json`` golden values), and a per-layer plan (``--oases-plan``) is applied to
  each built model stage before Megatron wraps it, as ``oases-pretrain-gpt`` does in
  :func:`megatron_oases.training.gpt.model_provider`.

Without a checkout, ``oases-pretrain-gpt`` (:mod:`megatron_oases.training.pretrain`) is the same
program on the ``megatron.training`` that the megatron-core wheel ships.
"""

from .hooks import (
    HOOK_PATCH,
    MEGATRON_LM_TAG,
    MEGATRON_LM_URL,
    exit_with_error,
    extra_args_provider,
    install,
    model_setup_hook,
    uninstall,
)

__all__ = [
    "HOOK_PATCH",
    "MEGATRON_LM_TAG",
    "MEGATRON_LM_URL",
    "exit_with_error",
    "extra_args_provider",
    "install",
    "model_setup_hook",
    "uninstall",
]
