"""``megatron-fsdp-cpu``: stock Megatron-FSDP (``--use-megatron-fsdp``, every
``--data-parallel-sharding-strategy``) on CPU gloo ranks, on top of the CPU shims
(:mod:`.cpu`: inert streams and events, ``device="cuda"`` factories on the CPU, the CPU RNG
tracker), which cover every other CUDA call on its training path.

Two places in Megatron-FSDP's adapter (``megatron.core.distributed.fsdp.mcore_fsdp_adapter``)
still name CUDA; each replacement builds the same object on the CPU and changes nothing of what
Megatron-FSDP computes (shards, buckets, collectives, hooks):

* ``DeviceMesh``: ``FullyShardedDataParallel._init_dist_index`` builds its data-parallel (and
  tensor-parallel) mesh with ``DeviceMesh.from_group(..., device_type="cuda")``: the same groups'
  mesh on ``cpu`` (:class:`.cpu._CpuDeviceMesh`, the one FSDP2 gets).
* ``FullyShardedDataParallel.__init__``: Megatron passes no ``device`` and the adapter formats
  ``torch.device(f"cuda:{torch.cuda.current_device()}")``, which under the CPU shims (where
  ``current_device()`` is the CPU device) is ``"cuda:cpu"``, an invalid device string; here the
  wrapper is given ``device=cpu``, and ``current_device()`` answers 0 while it is built (the
  wrapped ``MegatronFSDP`` formats the same string to compare it with the device it got; the
  warning that comparison logs on every rank, "using device cpu instead of the current device
  cuda:0", is dropped).

Gloo has no ``ReduceOp.PREMUL_SUM``, which Megatron-FSDP's gradient reduction uses by default to
divide by the data-parallel size inside the collective; ``--no-gradient-reduce-div-fusion`` (which
``oases-pretrain-gpt`` adds on CPU under ``--use-megatron-fsdp``, and
:func:`megatron_oases.validation.check_sharded_data_parallel` requires there) selects its own
other path, the same factor multiplied in before a SUM.
"""

import contextlib
import functools
import logging

import torch

from ..compat import require_call, require_symbol
from ..patching import Patch
from .cpu import _CpuDeviceMesh

PATCH_NAME = "megatron-fsdp-cpu"

#: What the wrapped ``MegatronFSDP`` logs once per rank when given a device other than
#: ``cuda:{current_device()}``: on CPU ranks always, and not a problem there.
DEVICE_WARNING = "instead of the current device"


class _DropDeviceWarning(logging.Filter):
    def filter(self, record):
        return DEVICE_WARNING not in record.getMessage()


@contextlib.contextmanager
def _cuda_index_zero(loggers):
    """``torch.cuda.current_device()`` is 0 (an index, as on a GPU) meanwhile, and the device
    warning of ``loggers`` dropped."""
    saved = torch.cuda.current_device
    torch.cuda.current_device = lambda: 0
    drop = _DropDeviceWarning()
    for one in loggers:
        one.addFilter(drop)
    try:
        yield
    finally:
        torch.cuda.current_device = saved
        for one in loggers:
            one.removeFilter(drop)


def make_init(original, loggers):
    """``FullyShardedDataParallel.__init__`` on the CPU (module docstring)."""

    @functools.wraps(original)
    def __init__(self, *args, device=None, **kwargs):
        with _cuda_index_zero(loggers):
            original(self, *args, device=device or torch.device("cpu"), **kwargs)

    return __init__


def replacements():
    """``[(owner, attr, replacement)]``, each checked against what Megatron calls."""
    from megatron.core.distributed.fsdp import mcore_fsdp_adapter as adapter

    wrapper = require_symbol(adapter, "FullyShardedDataParallel")
    init = require_symbol(wrapper, "__init__", parameters=("device",))
    require_call(init, "torch.cuda.current_device()")
    require_symbol(adapter, "DeviceMesh", called_by=(wrapper._init_dist_index,))
    require_call(wrapper._init_dist_index, "DeviceMesh.from_group(")
    megatron_fsdp = require_symbol(adapter, "MegatronFSDP")
    require_call(megatron_fsdp.__init__, "torch.cuda.current_device()")
    loggers = [
        logging.getLogger(megatron_fsdp.__module__),
        logging.getLogger(adapter.__name__),
    ]
    return [
        (adapter, "DeviceMesh", _CpuDeviceMesh),
        (wrapper, "__init__", make_init(wrapper.__dict__["__init__"], loggers)),
    ]


def needed(args):
    """Whether a run of Megatron's ``args`` needs the patch: ``--use-megatron-fsdp`` without
    CUDA (the CPU shims installed)."""
    from .cpu import is_active

    return bool(getattr(args, "use_megatron_fsdp", False)) and is_active()


def make_patch(args):
    """The ``megatron-fsdp-cpu`` patch for ``args``, else None (CUDA, or no Megatron-FSDP)."""
    if not needed(args):
        return None
    return Patch(PATCH_NAME, replacements=replacements())
