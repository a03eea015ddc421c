"""Allocator-independent activation-memory meter (CPU has no ``torch.cuda.max_memory_allocated``).

:class:`LiveTensorMeter` is a ``TorchDispatchMode`` that counts the bytes of every storage created
by an ATen op while it is active and releases them when the last tensor referring to the storage
is garbage-collected or has had its ``.data`` swapped away. Outputs that share a storage with an untracked input (in-place ops such as
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
    """Live bytes per storage. A storage counts while a tensor created on it is alive *and still
    on it*: Megatron frees a kept graph's output by swapping its ``.data``
    (``deallocate_output_tensor``), which no op reports, so before a new peak is recorded the
    entries whose tensors all moved off their storage are dropped (else every freed output would
    count until its tensor dies, and the allocator's reuse of its address would hide new ones)."""

    def __init__(self):
        super().__init__()
        self._live = {}  # storage ptr -> [nbytes, weak refs of the tensors created on it]
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

    @staticmethod
    def _holds(key, entry):
        """Whether a tensor of ``entry`` is alive and still on storage ``key``."""
        for ref in entry[1]:
            t = ref()
            if t is not None and _storage_ptr(t) == key:
                return True
        return False

    def _drop(self, key):
        self.current_bytes -= self._live.pop(key)[0]

    def _track(self, t):
        storage = _storage(t)
        key = storage.data_ptr() if storage is not None else 0
        if key == 0:
            return
        entry = self._live.get(key)
        if entry is not None and not self._holds(key, entry):  # its storage was freed via .data
            self._drop(key)
            entry = None
        if entry is None:
            entry = self._live[key] = [storage.nbytes(), []]
            self.current_bytes += entry[0]
        entry[1].append(weakref.ref(t))
        weakref.finalize(t, self._release, key, entry)
        if self.current_bytes > self.peak_bytes:
            for stale in [k for k, e in self._live.items() if not self._holds(k, e)]:
                self._drop(stale)
            self.peak_bytes = max(self.peak_bytes, self.current_bytes)

    def _release(self, key, entry):
        if self._live.get(key) is not entry:  # dropped as stale, or its address reused since
            return
        entry[1] = [r for r in entry[1] if r() is not None]
        if not self._holds(key, entry):
            self._drop(key)
