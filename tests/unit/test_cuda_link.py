"""The link emulator's CUDA path, driven on the CPU through a recording stand-in for
``torch.cuda`` (this machine has no GPU; the real path is checked by ``benchmarks/gpu/check.sh``):
an op on a CUDA tensor is a spin on its channel's stream after the caller's work, waiting on it is
a stream wait, and the host never sleeps."""

import types

import pytest
import torch

from megatron_oases.testbed.clusters import load_cluster
from megatron_oases.testbed.link_model import CudaEmulatedWork, CudaLink, LinkEmulator


class _Log(list):
    pass


def _fake_cuda(log, ms_per_cycle=1e-6):
    class Stream:
        n = 0

        def __init__(self, device=None):
            Stream.n += 1
            self.name = f"s{Stream.n}"

        def wait_stream(self, other):
            log.append(("wait_stream", self.name, other.name))

        def wait_event(self, event):
            log.append(("wait_event", self.name, event.name))

    class Event:
        n = 0

        def __init__(self, enable_timing=False):
            Event.n += 1
            self.name = f"e{Event.n}"

        def record(self, stream=None):
            log.append(("record", self.name, (stream or current).name))

        def synchronize(self):
            pass

        def elapsed_time(self, other):
            return 2_000_000 * ms_per_cycle  # ms for the calibration spin

        def query(self):
            return True

    current = Stream()
    current.name = "compute"
    state = {"stream": current}

    class _StreamCtx:
        def __init__(self, s):
            self.s = s

        def __enter__(self):
            self.prev, state["stream"] = state["stream"], self.s

        def __exit__(self, *exc):
            state["stream"] = self.prev

    class _DeviceCtx:
        def __init__(self, d):
            pass

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

    def _sleep(cycles):
        log.append(("spin", state["stream"].name, cycles))

    return types.SimpleNamespace(
        Stream=Stream,
        Event=Event,
        current_stream=lambda device=None: current if device is not None else state["stream"],
        stream=_StreamCtx,
        device=_DeviceCtx,
        _sleep=_sleep,
    )


@pytest.fixture
def cuda(monkeypatch):
    log = _Log()
    fake = _fake_cuda(log)
    monkeypatch.setattr(torch, "cuda", fake)
    import megatron_oases.testbed.spin as spin_mod

    def no_triton(*a, **k):  # Triton cannot build here: the fallback spin must take over
        raise RuntimeError("no GPU")

    monkeypatch.setattr(spin_mod, "spin", no_triton)
    return log


def test_a_cuda_op_is_a_spin_on_its_channel_stream_and_never_sleeps_the_host(cuda):
    slept = []
    emu = LinkEmulator(load_cluster("rtx3090-pcie"), dilation=10.0, sleep=slept.append)
    dev = torch.device("cuda", 0)
    seconds = emu.model_seconds("all_reduce", 1 << 20, [0, 1])
    done, info = emu.issue("all_reduce", "all_reduce", 1 << 20, [0, 1], ("coll", (0, 1)), dev)
    # the channel's stream waits for the compute issued before, then spins D x t_model
    spins = [e for e in cuda if e[0] == "spin"]
    # two calibration spins on the caller's stream (once), then the op's on the channel's
    assert [e[1] for e in spins[:2]] == ["compute", "compute"] and len(spins) == 3
    assert spins[2][2] == int(10.0 * seconds * 1e9)  # the fake clock: 1 ns per cycle
    channel = spins[2][1]
    assert channel != "compute"
    assert ("wait_stream", channel, "compute") in cuda
    assert ("record", done.name, channel) in cuda
    work = emu.wrap_async(None, done, info)
    assert isinstance(work, CudaEmulatedWork) and work.done_at is None
    work.wait()
    assert cuda[-1] == ("wait_event", "compute", done.name)
    # a second op on the same channel queues on the same stream; a synchronous one makes the
    # compute stream wait at once
    done2, info2 = emu.issue("all_reduce", "all_reduce", 1 << 20, [0, 1], ("coll", (0, 1)), dev)
    assert [e for e in cuda if e[0] == "spin"][-1][1] == channel
    emu.finish_sync(None, done2, info2)
    assert cuda[-1] == ("wait_event", "compute", done2.name)
    assert slept == [] and emu.blocked_s == 0.0
    assert CudaLink.last_kernel == "torch.cuda._sleep" and "no GPU" in CudaLink.fallback_reason


def test_a_cpu_op_still_waits_on_the_host_clock():
    clock = [0.0]
    emu = LinkEmulator(
        load_cluster("rtx3090-pcie"), 10.0, clock=lambda: clock[0], sleep=lambda s: None
    )
    done, _ = emu.issue("all_reduce", "all_reduce", 1 << 20, [0, 1], "c", torch.device("cpu"))
    assert isinstance(done, float) and done > 0
