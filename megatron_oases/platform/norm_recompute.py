"""``norm-recompute-without-te``: Megatron's ``--recompute-modules layernorm`` without Transformer Engine.

``TransformerLayer`` recomputes its norms with ``tensor_parallel.CheckpointWithoutOutput()``,
whose ``__init__`` sets ``self.fp8 = fp8 is not None``: the default ``fp8=False`` reads as fp8 on,
and the checkpoint then calls ``FP8GlobalStateManager`` and ``activation_recompute_forward``,
which ``megatron.core.tensor_parallel.random`` imports only when TE is installed (a NameError
otherwise, stock and schedule alike). Without TE fp8 cannot be on, so the replacement keeps the
original ``__init__`` and clears the flag; nothing else changes (the same norm, the same RNG
states, the same zero-copy refill of the freed output). Installed only where that ``__init__``
still has the test and TE is missing.
"""

import inspect

from ..compat import norm_checkpoint_callers, require_symbol
from ..patching import Patch


def make_init(original):
    def __init__(self, *args, **kwargs):
        original(self, *args, **kwargs)
        self.fp8 = False  # no Transformer Engine: no fp8

    __init__.__wrapped__ = original
    return __init__


def make_patch(config):
    """The patch for selective recomputation of ``layernorm`` without TE, else None."""
    if config.recompute_granularity != "selective":
        return None
    if "layernorm" not in config.recompute_modules:
        return None
    from megatron.core.tensor_parallel import random
    from megatron.core.transformer.transformer_layer import TransformerLayer

    if require_symbol(random, "HAVE_TE"):
        return None
    cls = require_symbol(
        random, "CheckpointWithoutOutput", called_by=norm_checkpoint_callers(TransformerLayer)
    )
    original = require_symbol(cls, "__init__")
    if "fp8 is not None" not in inspect.getsource(original):
        return None  # Megatron reads the flag as given: nothing to fix
    return Patch("norm-recompute-without-te", replacements=[(cls, "__init__", make_init(original))])
