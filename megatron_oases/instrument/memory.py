"""Allocator-independent activation-memory meter (CPU has no ``torch.cuda.max_memory_allocated``).

:class:`LiveTensorMeter` is a ``TorchDispatchMode`` that counts the bytes of every storage created
by an ATen op while it is active and releases them when the last tensor referring to the storage
is garbage-collected or has had its ``.data`` swapped away. Outputs that share a storage with an untracked input (in-place ops such as
the ``zero_()`` of Megatron's gradient buffer, views of parameters) allocate nothing and are not
counted. ``peak_bytes`` is then the peak of live activation (+ temporary and gradient) memory
during the measured region; parameters, optimizer state and Megatron's gradient buffers
exist before the region and are not counted. Slow (Python per op): use it for measurement runs,
never for timing.

With ``breakdown=True`` the meter also says *what* is live at the peak (:attr:`live_at_peak`): the
live storages grouped by where they were created (the innermost Megatron or megatron-oases
function on the Python stack), shape and dtype, and :attr:`peak_site`, the call chain of the op
that set the peak. That is what explains a peak that does not fit a memory budget.
"""

import os
import sys
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

    def __init__(self, breakdown=False):
        super().__init__()
        self._live = {}  # storage ptr -> [nbytes, weak refs of the tensors created on it]
        self.current_bytes = 0
        self.peak_bytes = 0
        self.breakdown = breakdown
        self._labels = {}  # storage ptr -> (site, shape, dtype) of its creation (breakdown only)
        #: ``[{'site', 'shape', 'dtype', 'bytes', 'count'}]`` live at the peak, largest first
        self.live_at_peak = []
        #: the call chain (innermost first) of the op that set the peak
        self.peak_site = ""

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

    def _drop(self, key, entry):
        """Stop counting ``entry`` if it is still ``key``'s (a finalizer may have dropped it)."""
        if self._live.get(key) is entry:
            del self._live[key]
            self.current_bytes -= entry[0]
            self._labels.pop(key, None)

    def _track(self, t):
        storage = _storage(t)
        key = storage.data_ptr() if storage is not None else 0
        if key == 0:
            return
        entry = self._live.get(key)
        if entry is not None and not self._holds(key, entry):  # its storage was freed via .data
            self._drop(key, entry)
            entry = None
        if entry is None:
            entry = self._live[key] = [storage.nbytes(), []]
            self.current_bytes += entry[0]
            if self.breakdown:
                self._labels[key] = (_call_chain(2), tuple(t.shape), str(t.dtype))
        entry[1].append(weakref.ref(t))
        weakref.finalize(t, self._release, key, entry)
        if self.current_bytes > self.peak_bytes:
            # The collector may run inside this scan, and the finalizers of what it frees drop
            # entries (_release): scan a copy, and drop only what is still the same entry.
            stale = [(k, e) for k, e in list(self._live.items()) if not self._holds(k, e)]
            for k, e in stale:
                self._drop(k, e)
            if self.current_bytes > self.peak_bytes:
                if self.breakdown:
                    self._snapshot()
                self.peak_bytes = self.current_bytes

    def _snapshot(self):
        groups = {}
        for key, entry in list(self._live.items()):
            label = self._labels.get(key, ("?", (), "?"))
            g = groups.setdefault(label, [0, 0])
            g[0] += entry[0]
            g[1] += 1
        self.live_at_peak = [
            {"site": site, "shape": list(shape), "dtype": dtype, "bytes": b, "count": n}
            for (site, shape, dtype), (b, n) in sorted(groups.items(), key=lambda kv: -kv[1][0])
        ]
        self.peak_site = _call_chain(6)

    def _release(self, key, entry):
        if self._live.get(key) is not entry:  # dropped as stale, or its address reused since
            return
        entry[1] = [r for r in entry[1] if r() is not None]
        if not self._holds(key, entry):
            self._drop(key, entry)


_OWN = (os.sep + "megatron" + os.sep, os.sep + "megatron_oases" + os.sep)


def _call_chain(depth):
    """The ``depth`` innermost Megatron / megatron-oases functions on the stack, innermost first,
    as ``module.function`` (this module and PyTorch skipped): where a tensor is created."""
    names, frame = [], sys._getframe(1)
    while frame is not None and len(names) < depth:
        path = frame.f_code.co_filename
        if any(p in path for p in _OWN) and frame.f_globals.get("__name__") != __name__:
            mod = frame.f_globals.get("__name__", "?").rsplit(".", 1)[-1]
            names.append(f"{mod}.{frame.f_code.co_name}")
        frame = frame.f_back
    return " < ".join(names) if names else "?"
