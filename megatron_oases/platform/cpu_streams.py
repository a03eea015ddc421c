"""CUDA streams and events on CPU ranks: the host thread is the default stream, and work put on a
side stream completes when that stream is waited on.

On CPU ranks every op runs on the issuing thread, so streams and events have nothing to order:
these stand-ins for ``torch.cuda.Stream``, ``Event``, ``stream``, ``current_stream``,
``default_stream`` and ``synchronize`` are inert unless something is deferred. One thing is: the
link emulator (:mod:`megatron_oases.testbed`) gives each collective a modelled completion time,
and a collective issued synchronously while a side stream is current (Megatron-FSDP's gradient
reduce-scatters under ``torch.cuda.stream(rs_stream)``) does not block a GPU's host, only that
stream. :func:`defer` hands such a completion to the current side stream; it is waited where CUDA
would make the host wait for it: an event recorded on that stream waited (``Event.wait`` with the
host stream current, ``Event.synchronize``), ``Stream.synchronize``, ``wait_stream`` of the host
stream on it, ``torch.cuda.synchronize``. A side stream made to wait on another takes over its
pending completions.

A completion is anything with ``wait()`` (idempotent) and ``is_completed()``.
"""

import threading
import weakref

_local = threading.local()


class CpuStream:
    """Stand-in for ``torch.cuda.Stream``: the completions deferred to it (:func:`defer`)."""

    def __init__(self, *args, **kwargs):
        self.pending = []
        _ALL.add(self)

    def _take(self, completions):
        self.pending = [c for c in self.pending if not c.is_completed()]
        self.pending.extend(c for c in completions if c not in self.pending)

    def _drain(self):
        pending, self.pending = self.pending, []
        for c in pending:
            c.wait()

    def synchronize(self):
        self._drain()

    def wait_stream(self, other):
        if other is self:
            return
        if self is _HOST:
            other._drain()
        else:
            self._take(other.pending)

    def wait_event(self, event):
        event.wait(self)

    def record_event(self, event=None):
        event = event or CpuEvent()
        event.record(self)
        return event

    def query(self):
        return all(c.is_completed() for c in self.pending)


class CpuEvent:
    """Stand-in for ``torch.cuda.Event``: the completions pending on a stream when recorded."""

    def __init__(self, *args, **kwargs):
        self.pending = []

    def record(self, stream=None):
        self.pending = list((stream or current_stream()).pending)

    def wait(self, stream=None):
        stream = stream or current_stream()
        if stream is _HOST:
            self.synchronize()
        else:
            stream._take(self.pending)

    def synchronize(self):
        pending, self.pending = self.pending, []
        for c in pending:
            c.wait()

    def query(self):
        return all(c.is_completed() for c in self.pending)

    def elapsed_time(self, other):
        return 0.0


_ALL = weakref.WeakSet()
_HOST = CpuStream()
_ALL.discard(_HOST)


def current_stream(*args, **kwargs):
    """The stream ``torch.cuda.stream(...)`` made current on this thread; the host's otherwise."""
    return getattr(_local, "stream", None) or _HOST


def default_stream(*args, **kwargs):
    return _HOST


class stream:  # noqa: N801 - torch.cuda.stream's name
    """``torch.cuda.stream(s)``: ``s`` (None: unchanged) is current on this thread meanwhile."""

    def __init__(self, s=None):
        self.s = s
        self.saved = None

    def __enter__(self):
        self.saved = getattr(_local, "stream", None)
        if self.s is not None:
            _local.stream = self.s
        return self.s

    def __exit__(self, *exc):
        _local.stream = self.saved
        return False


def synchronize(*args, **kwargs):
    """``torch.cuda.synchronize()``: every stream's deferred completions waited."""
    for s in list(_ALL):
        s._drain()


def defer(completion):
    """Put ``completion`` on the current side stream and return True; False (the caller waits
    now) when the host stream is current."""
    s = current_stream()
    if s is _HOST:
        return False
    s._take([completion])
    return True
