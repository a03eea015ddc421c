"""Allocator-independent activation-memory meter (CPU has no ``torch.cuda.max_memory_allocated``).

:class:`LiveTensorMeter` is a ``TorchDispatchMode`` that counts the bytes of every storage created
by an ATen op while it is active and releases them when the last tensor referring to the storage
is garbage-collected. Outputs that share a storage with an untracked input (in-place ops such as
the ``zero_()`` of Megatron's gradient buffer, views of parameters) allocate nothing and are not
counted. ``peak_bytes`` is then the peak of live activation (+ temporary and gradient) memory
during the measured region; parameters, optimizer state and Megatron's gradient buffers
exist before the region and are not counted. Slow (Python per op): use it for measurement runs,
never for timing.
"""

import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten


def _storage(t):
    """``t``'s storage, or None for tensors without one (e.g. sparse)."""
    try:
        return t.untyped_storage()
    except (RuntimeError, NotImplementedError):
        return None


def _storage_ptr(t):
    storage = _storage(t)
    return storage.data_ptr() if storage is not None else 0


class LiveTensorMeter(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self._live = {}
        self.current_bytes = 0
        self.peak_bytes = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {
            _storage_ptr(t) for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)
        }
        inputs -= self._live.keys()  # views of tracked storages still count as references
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and _storage_ptr(t) not in inputs:
                self._track(t)
        return out

    def _track(self, t):
        storage = _storage(t)
        key = storage.data_ptr() if storage is not None else 0
        if key == 0:
            return
        entry = self._live.get(key)
        if entry is None:
            entry = self._live[key] = [0, storage.nbytes()]
            self.current_bytes += entry[1]
            self.peak_bytes = max(self.peak_bytes, self.current_bytes)
        entry[0] += 1
        weakref.finalize(t, self._release, key)

    def _release(self, key):
        entry = self._live.get(key)
        if entry is None:
            return
        entry[0] -= 1
        if entry[0] == 0:
            del self._live[key]
            self.current_bytes -= entry[1]
