"""Stock Megatron's fallback warnings that mean nothing for our runs, kept out of the way.

Importing Megatron-Core on a machine without Apex / Transformer Engine / absl prints about 16
warnings per rank (the same ones on every rank): "Transformer Engine and Apex are not installed.
Falling back to ...", "Apex is not installed. Falling back to Torch Norm", "absl.logging is not
installed", ... On CPU these fallbacks are the only possibility, and the others are about choices
we make on purpose (a model provider rather than a ``ModelConfig``; the local layer spec rather
than TE's; the tokenizer default we pass to ``validate_args``). Each is filtered by its own text,
so any other warning — one that means something — still shows. The entry points call
:func:`install` before importing Megatron.
"""

import logging
import os
import warnings

#: Carries an entry point's choice (``cpu``: with the CPU-only filters, ``gpu``: without) to the
#: processes it starts: :mod:`.quiet_fork_server` applies it in
#: :func:`megatron_oases.launch.run_distributed`'s fork server, which imports Megatron-Core.
ENV = "OASES_QUIET"

#: Filtered everywhere: about our own choices, or optional packages that change nothing for us.
ALWAYS = (
    r"absl\.logging is not installed",
    r"Only transformer-engine>=[\d.]+ supports MoE experts, but your version is 0\.0\.0",
    r"MimoModelConfig is experimental",
    r"\s*It is recommended to use a ModelConfig",
    r"Overriding default arguments for tokenizer_type:GPT2BPETokenizer with "
    r"tokenizer_type:NullTokenizer",
    r"`torch\.distributed\.all_gather_into_tensor` is deprecated",
    r"`torch\.distributed\.distributed_c10d\._set_pg_timeout` is deprecated",
    # torch.distributed.checkpoint as Megatron's torch_dist checkpoints use it (every --load)
    r"torch\.distributed is disabled, unavailable or uninitialized, assuming the intent is to "
    r"load in a single process",
    r"The argument order of load has been changed",
    r"Please use DTensor instead and we are deprecating ShardedTensor",
)
#: Log records filtered everywhere, by logger: Megatron's sync save runs its own deprecated
#: "mcore" async machinery and says so on every save.
LOG_MESSAGES = {
    "megatron.core.dist_checkpointing.strategies.torch": ("MCore's async save is deprecated",),
}
#: Filtered only without CUDA: on a GPU these fallbacks cost speed, and the user should know.
CPU_ONLY = (
    r"Transformer Engine and Apex are not installed",
    r"Apex is not installed\. Falling back to Torch Norm",
    r"'pin_memory' argument is set as true but no accelerator is found",
)
#: Loggers whose CPU-only notices are dropped without CUDA (below ERROR).
CPU_ONLY_LOGGERS = ("torch.utils.cpp_extension",)  # "No CUDA runtime is found, using CUDA_HOME"


def install(cuda=None):
    """Add the filters (idempotent: ``warnings`` de-duplicates identical filters); ``cuda``:
    whether CUDA is available (default: ask torch)."""
    if cuda is None:
        import torch

        cuda = torch.cuda.is_available()
    os.environ[ENV] = "gpu" if cuda else "cpu"
    patterns = ALWAYS if cuda else ALWAYS + CPU_ONLY
    for pattern in patterns:
        warnings.filterwarnings("ignore", message=pattern)
    if not cuda:
        for name in CPU_ONLY_LOGGERS:
            logging.getLogger(name).setLevel(logging.ERROR)
    for name, messages in LOG_MESSAGES.items():
        logger = logging.getLogger(name)
        if not any(isinstance(f, _DropMessages) for f in logger.filters):
            logger.addFilter(_DropMessages(messages))
    return patterns


class _DropMessages(logging.Filter):
    """Drops the records whose message starts with one of ``messages``."""

    def __init__(self, messages):
        super().__init__()
        self.messages = tuple(messages)

    def filter(self, record):
        return not str(record.getMessage()).startswith(self.messages)
