"""What both entry points check before any training work (``oases-pretrain-gpt`` and Megatron-LM's
patched ``pretrain_gpt.py``): the data paths, then the checkpoint directories (writable, one run's,
complete and of this model); Megatron's console loss made exact; its dataset helpers built only where a Makefile is. Each refusal is one :class:`~megatron_oases.errors.OasesConfigError`
line naming the fix; see ``docs/reliability.md``."""

from . import console_log, dataset_helpers
from .checkpoint_check import prepare_checkpointing
from .data_check import check_data_paths


def check_before_training(args):
    """Refuse what would fail (or destroy checkpoints) later; install the safe-save patches and
    the console's loss fix (:mod:`.console_log`)."""
    check_data_paths(args)
    prepare_checkpointing(args)
    console_log.install(args)
    dataset_helpers.install()
