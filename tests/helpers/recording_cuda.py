"""A recording stand-in for ``torch.cuda`` (streams, events, the current stream, ``stream`` and
``device`` contexts, ``_sleep``) so that tests on a machine without a GPU can check the order of
the stream and event calls the CUDA paths issue. Every call of interest appends a tuple to a log:

* ``("wait_stream", stream, other stream)``, ``("wait_event", stream, event tag)``;
* ``("record", event tag, stream)``;
* ``("spin", stream, spin tag)`` for ``torch.cuda._sleep(cycles)``.

Streams are named ``"compute"`` (the one current at first) and ``s1``, ``s2``...; events ``e1``,
``e2``... The stand-ins extend the CPU shims' ones (:mod:`megatron_oases.platform.cpu_streams`),
so they also serve installed over them."""

import itertools
import types

import torch

from megatron_oases.patching import Patch
from megatron_oases.platform.cpu_streams import CpuEvent, CpuStream


def recording_cuda(
    log, *, event_tag=lambda event: event.name, elapsed_ms=2.0, spin_tag=None, compute_spins=True
):
    """A :class:`Patch` on ``torch.cuda`` whose stand-ins append to ``log``.

    ``event_tag(event)``: what the log calls an event. ``elapsed_ms``: what
    ``Event.elapsed_time`` returns (the link's calibration spin is 2,000,000 cycles, so 2.0 makes
    a cycle 1 ns). ``spin_tag(cycles)``: what a spin entry carries (default: the cycles).
    ``compute_spins``: whether spins on the compute stream (the link's calibration) are logged."""
    streams, events = itertools.count(1), itertools.count(1)

    def name_of(stream):
        return getattr(stream, "name", "?")  # a stream made before the stand-ins went in

    class Stream(CpuStream):
        def __init__(self, *args, name=None, **kwargs):
            super().__init__()
            self.name = name or f"s{next(streams)}"

        def wait_stream(self, other):
            log.append(("wait_stream", self.name, name_of(other)))

        def wait_event(self, event):
            log.append(("wait_event", self.name, event_tag(event)))

    class Event(CpuEvent):
        def __init__(self, *args, **kwargs):
            super().__init__()
            self.name = f"e{next(events)}"

        def record(self, stream=None):
            log.append(("record", event_tag(self), name_of(stream or state["stream"])))

        def elapsed_time(self, other):
            return elapsed_ms

    compute = Stream(name="compute")
    state = {"stream": compute}

    class StreamContext:
        def __init__(self, stream):
            self.stream = stream

        def __enter__(self):
            self.prev, state["stream"] = state["stream"], self.stream

        def __exit__(self, *exc):
            state["stream"] = self.prev

    class DeviceContext:
        def __init__(self, device):
            pass

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

    def _sleep(cycles):
        if compute_spins or state["stream"] is not compute:
            tag = cycles if spin_tag is None else spin_tag(cycles)
            log.append(("spin", state["stream"].name, tag))

    cuda = torch.cuda
    return Patch(
        "record-cuda",
        [
            (cuda, "Stream", Stream),
            (cuda, "Event", Event),
            (cuda, "current_stream", lambda device=None: state["stream"]),
            (cuda, "stream", StreamContext),
            (cuda, "device", DeviceContext),
            (cuda, "_sleep", _sleep),
        ],
    )


def replace_torch_cuda(monkeypatch, patch):
    """For one test, ``torch.cuda`` is ``patch``'s stand-ins and nothing else (a call to any other
    part of it fails), rather than the real module with them installed over it."""
    stand_ins = {attr: new for _, attr, new in patch.replacements}
    monkeypatch.setattr(torch, "cuda", types.SimpleNamespace(**stand_ins))
