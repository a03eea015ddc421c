"""The link emulator's CUDA path, driven on the CPU through a recording stand-in for
``torch.cuda`` (this machine has no GPU; the real path is checked by ``benchmarks/gpu/check.sh``):
an op on a CUDA tensor is a spin on its channel's stream after the caller's work, waiting on it is
a stream wait, and the host never sleeps."""

import pytest
import torch
from helpers.recording_cuda import recording_cuda, replace_torch_cuda

from megatron_oases.testbed.clusters import load_cluster
from megatron_oases.testbed.link_model import CudaEmulatedWork, CudaLink, LinkEmulator


@pytest.fixture
def cuda(monkeypatch):
    log = []
    replace_torch_cuda(monkeypatch, recording_cuda(log))
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
