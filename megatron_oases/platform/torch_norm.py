"""``torch-norm-sp``: Megatron's local-spec torch norms under ``--sequence-parallel``.

Without apex (every CPU machine, and GPU installs without it) the local layer spec builds its
LayerNorm/RMSNorm with ``megatron.core.transformer.torch_norm.WrappedTorchNorm``, which asserts
``not config.sequence_parallel``. The only reason it cannot run under sequence parallelism is that
its parameters are not tagged: under SP each TP rank normalises its own slice of the sequence, so
the norm's weight/bias gradients are partial sums that Megatron's ``finalize_model_grads``
all-reduces over the TP group for parameters with ``sequence_parallel = True`` (what apex's
``FusedLayerNorm`` and TE's norms set). The replacement builds the same torch module and sets that
tag, so stock Megatron and every Oases schedule run the same SP model here.
"""

import copy

from ..compat import require_symbol
from ..patching import Patch


def make_norm_new(original):
    """Replacement for ``WrappedTorchNorm.__new__``: build without the SP assertion, tag params."""

    def __new__(cls, config, hidden_size, *args, **kwargs):
        if not config.sequence_parallel:
            return original(cls, config, hidden_size, *args, **kwargs)
        plain = copy.copy(config)
        plain.sequence_parallel = False
        norm = original(cls, plain, hidden_size, *args, **kwargs)
        for param in norm.parameters():
            param.sequence_parallel = True
        return norm

    __new__.__wrapped__ = original
    return __new__


def make_patch(config):
    """``torch-norm-sp`` for ``--sequence-parallel`` with the local spec (the only one
    :mod:`megatron_oases.validation` lets through), else None."""
    if not config.sequence_parallel:
        return None
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    original = require_symbol(WrappedTorchNorm, "__new__")
    if "sequence_parallel" not in (original.__code__.co_names or ()):
        # the assertion is gone: Megatron handles SP itself; nothing to replace
        return None
    return Patch(
        "torch-norm-sp",
        replacements=[(WrappedTorchNorm, "__new__", staticmethod(make_norm_new(original)))],
    )
