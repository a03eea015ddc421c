"""``oases-pretrain-gpt`` / ``oases run``: Megatron-LM's ``pretrain_gpt.py`` + ``--oases-*`` flags.

For users with a Megatron-LM checkout (tag ``core_v0.16.0``) on ``PYTHONPATH`` (or in
``MEGATRON_LM_DIR``).
Reuses ``pretrain_gpt``'s ``forward_step``, dataset provider, ``model_provider``/``gpt_builder`` and
``get_embedding_ranks`` as they are; adds, through :mod:`megatron_oases.megatron_lm`:

* ``--transformer-impl local`` (forced when absent, an error when another value is given);
* the ``oases`` flag group (same flags as ``oases train``) and ``--log-json``, chained after any
  existing ``extra_args_provider`` (``add_modelopt_args`` when ModelOpt is importable);
* validation of those flags right after parsing (one error line, exit 2, before any process group);
* the patch install before the model is built (first ``gpt_builder`` call), reverted at exit.

Launch like ``pretrain_gpt.py``:
``torchrun --nproc_per_node 8 -m megatron_oases.pretrain_gpt_oases ...`` or
``torchrun ... $(which oases-pretrain-gpt) ...``.
"""

import sys
from functools import partial

from . import megatron_lm
from .errors import OasesConfigError

PROG = "oases-pretrain-gpt"


def _existing_extra_args_provider(pretrain_gpt):
    """What ``pretrain_gpt.py``'s ``__main__`` passes: ``add_modelopt_args`` if ModelOpt imports."""
    if getattr(pretrain_gpt, "has_nvidia_modelopt", False):
        return getattr(pretrain_gpt, "add_modelopt_args", None)
    return None


def run(argv):
    """Run ``pretrain_gpt``'s ``__main__`` block with our additions (argv without the program)."""
    pretrain_gpt = megatron_lm.import_pretrain_gpt()
    from megatron.core.enums import ModelType

    saved_argv = sys.argv
    sys.argv = [PROG]  # Megatron-LM's parse_args reads sys.argv; prepare() fills it in
    try:
        provider = megatron_lm.prepare(_existing_extra_args_provider(pretrain_gpt), argv)

        set_startup_timestamps = getattr(pretrain_gpt, "set_startup_timestamps", None)
        if set_startup_timestamps is not None:
            import time

            start = getattr(pretrain_gpt, "_PROGRAM_START_TIME", time.time())
            set_startup_timestamps(program_start=start, main_entry=time.time())

        pretrain_gpt.train_valid_test_datasets_provider.is_distributed = True
        pretrain = pretrain_gpt.pretrain
        kwargs = {}
        restart = getattr(pretrain_gpt, "inprocess_restart", None)
        if restart is not None:
            pretrain, store = restart.maybe_wrap_for_inprocess_restart(pretrain)
            kwargs["store"] = store
        builder = megatron_lm.wrap_builder(pretrain_gpt.gpt_builder)
        pretrain(
            pretrain_gpt.train_valid_test_datasets_provider,
            partial(pretrain_gpt.model_provider, builder),
            ModelType.encoder_or_decoder,
            pretrain_gpt.forward_step,
            args_defaults={"tokenizer_type": "GPT2BPETokenizer"},
            extra_args_provider=provider,
            get_embedding_ranks=pretrain_gpt.get_embedding_ranks,
            **kwargs,
        )
    finally:
        sys.argv = saved_argv
        megatron_lm.uninstall_patches()
    return 0


def main(argv=None):
    """Entry for ``oases run`` (the CLI prints :class:`OasesConfigError` as one line, exit 2)."""
    return run(list(sys.argv[1:] if argv is None else argv))


def console_main(argv=None):
    """Entry for the ``oases-pretrain-gpt`` console script."""
    try:
        rc = main(argv)
    except OasesConfigError as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr, flush=True)
        return 2
    return rc or 0


if __name__ == "__main__":
    sys.exit(console_main())
