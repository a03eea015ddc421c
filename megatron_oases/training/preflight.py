"""What both entry points check before any training work (``oases-pretrain-gpt`` and Megatron-LM's
patched ``pretrain_gpt.py``): the trace and ``--log-json`` paths, the data paths, then the
checkpoint directories (writable, one run's, complete and of this model); Megatron's console loss
made exact; its dataset helpers built only where a Makefile is. Each refusal is one
:class:`~megatron_oases.errors.OasesConfigError` line naming the fix; see ``docs/reliability.md``.
"""

from ..errors import OasesConfigError
from ..outputs import check_output_file
from . import console_log, dataset_helpers
from .checkpoint_check import prepare_checkpointing
from .data_check import check_data_paths


def check_output_paths(config):
    """``--oases-trace`` (written at the end of the run) and ``--log-json`` (after each
    iteration), from the run's :class:`~megatron_oases.config.OasesConfig`, are checked like an
    ``--out``: a path that cannot be written is one line now, not a lost trace after the whole
    run or a stop after iteration 1. The trace's rank-0 file stands for every rank's (they share
    its directory)."""
    trace = config.trace
    if trace:
        from ..instrument.trace import trace_path

        try:
            first = trace_path(trace, 0)
        except (KeyError, IndexError, ValueError):
            raise OasesConfigError(
                f"--oases-trace {trace}: only {{rank}} may stand in braces; e.g. "
                "--oases-trace trace.rank{rank}.json"
            ) from None
        check_output_file(first, flag="--oases-trace", example="trace.json")
    if config.log_json:
        check_output_file(config.log_json, flag="--log-json", example="golden.json")


def check_before_training(args, config):
    """Refuse what would fail (or destroy checkpoints) later; install the safe-save patches, the
    console's loss fix (:mod:`.console_log`), Megatron-FSDP's platform patch on CPU ranks and its
    checkpoint patch where it saves or loads.
    ``args``: Megatron's; ``config``: the run's :class:`~megatron_oases.config.OasesConfig`."""
    check_output_paths(config)
    check_data_paths(args)
    prepare_checkpointing(args, config.start_over)
    console_log.install(args)
    dataset_helpers.install()
    install_megatron_fsdp(args)


def install_megatron_fsdp(args):
    """``--use-megatron-fsdp``: on CPU ranks the ``megatron-fsdp-cpu`` platform patch, before
    Megatron builds the model (:mod:`megatron_oases.platform.megatron_fsdp`); with ``--save`` or
    ``--load``, on any device, the ``megatron-fsdp-checkpoint`` patch
    (:mod:`megatron_oases.platform.megatron_fsdp_checkpoint`); with pipeline stages, on any
    device, the ``megatron-fsdp-pipeline`` patch
    (:mod:`megatron_oases.platform.megatron_fsdp_pipeline`)."""
    from ..patches import install_patch
    from ..platform import megatron_fsdp, megatron_fsdp_checkpoint, megatron_fsdp_pipeline

    for make_patch in (
        megatron_fsdp.make_patch,
        megatron_fsdp_pipeline.make_patch,
        megatron_fsdp_checkpoint.make_patch,
    ):
        patch = make_patch(args)
        if patch is not None:
            install_patch(patch)
