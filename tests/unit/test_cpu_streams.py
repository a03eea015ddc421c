"""CPU ranks' streams (:mod:`megatron_oases.platform.cpu_streams`) and the link emulator's
completions on them: a synchronous collective issued on a side stream (Megatron-FSDP's
reduce-scatters) is waited where CUDA would make the host wait, and a ``_coalescing_manager``'s
batch completes as one collective (its handles, or its exit)."""

import pytest
from helpers.emulation import DILATION as D

from megatron_oases.platform import cpu_streams
from megatron_oases.testbed.clusters import load_cluster
from megatron_oases.testbed.link_model import EmulatedWork, LinkEmulator


class _Completion:
    def __init__(self, log, name):
        self.log, self.name, self.done = log, name, False

    def wait(self):
        if not self.done:
            self.log.append(self.name)
        self.done = True

    def is_completed(self):
        return self.done


def test_the_host_stream_defers_nothing():
    assert cpu_streams.current_stream() is cpu_streams.default_stream()
    assert not cpu_streams.defer(_Completion([], "a"))
    with cpu_streams.stream(None):  # torch.cuda.stream(None): unchanged
        assert not cpu_streams.defer(_Completion([], "a"))


def test_work_on_a_side_stream_is_waited_where_the_host_waits_for_that_stream():
    log = []
    side = cpu_streams.CpuStream()
    with cpu_streams.stream(side):
        assert cpu_streams.current_stream() is side
        assert cpu_streams.defer(_Completion(log, "a"))
        event = side.record_event()
        assert cpu_streams.defer(_Completion(log, "b"))  # after the event: not in it
        event.wait()  # the side stream waits on its own event: nothing for the host
    assert log == [] and not event.query()
    assert cpu_streams.current_stream() is cpu_streams.default_stream()
    event.wait()  # the host stream waits: the host blocks on what the event recorded
    assert log == ["a"] and event.query()
    cpu_streams.current_stream().wait_stream(side)
    assert log == ["a", "b"]


def test_a_side_stream_waiting_on_another_takes_over_its_completions():
    log = []
    one, two = cpu_streams.CpuStream(), cpu_streams.CpuStream()
    with cpu_streams.stream(one):
        cpu_streams.defer(_Completion(log, "a"))
    two.wait_stream(one)
    event = cpu_streams.CpuEvent()
    event.record(two)
    two.wait_event(event)  # its own event: nothing moves
    assert log == []
    event.synchronize()
    assert log == ["a"]
    with cpu_streams.stream(one):
        cpu_streams.defer(_Completion(log, "c"))
    cpu_streams.synchronize()  # torch.cuda.synchronize(): every stream
    assert log == ["a", "c"] and one.query()


def _emulator():
    now = [10.0]
    emu = LinkEmulator(load_cluster("rtx3090-pcie"), D, clock=lambda: now[0])
    emu._sleep = lambda s: now.__setitem__(0, now[0] + s)
    return emu, now


def _issue(emu, nbytes=1 << 20):
    return emu.issue("reduce_scatter_tensor", "reduce_scatter", nbytes, [0, 1], ("coll", (0, 1)))


def test_a_synchronous_collective_on_a_side_stream_does_not_block_the_host():
    emu, now = _emulator()
    done, info = _issue(emu)
    side = cpu_streams.CpuStream()
    with cpu_streams.stream(side):
        assert emu.finish_sync("result", done, info) == "result"
        event = side.record_event()
    assert now[0] == 10.0 and emu.blocked_s == 0.0  # issued, not waited
    (rec,) = emu.records
    assert rec["async"] and rec["returned"] is None
    event.wait()
    assert now[0] == pytest.approx(done) and rec["returned"] == pytest.approx(done)
    assert emu.blocked_s == pytest.approx(done - 10.0)
    # on the host stream the same op blocks at once, as before
    done2, info2 = _issue(emu)
    emu.finish_sync(None, done2, info2)
    assert now[0] == pytest.approx(done2) and not emu.records[-1]["async"]


class _Manager:
    """torch's ``_CoalescingManager``: the coalesced op's handles."""

    def __init__(self, works):
        self.works = works


class _RealWork:
    waited = False

    def wait(self, timeout=None):
        self.waited = True
        return True


def test_an_async_coalesced_batch_completes_through_the_managers_handles():
    """Megatron-FSDP waits on its parameter gathers through the manager (its handles), never on
    the ops' own handles: those must complete with the batch's last op."""
    emu, now = _emulator()
    batch = [_issue(emu), _issue(emu, 4 << 20)]
    real = _RealWork()
    manager = _Manager([real])
    emu.finish_coalesced(manager, batch, async_ops=True)
    (work,) = manager.works
    assert isinstance(work, EmulatedWork) and now[0] == 10.0
    last = max(d for d, _ in batch)
    assert last == batch[1][0]  # one channel: queued behind the first
    work.wait()
    assert real.waited and now[0] == pytest.approx(last)
    assert all(r["async"] and r["returned"] == pytest.approx(last) for r in emu.records)


def test_a_synchronous_coalesced_batch_completes_at_the_managers_exit_or_on_its_stream():
    emu, now = _emulator()
    batch = [_issue(emu), _issue(emu)]
    emu.finish_coalesced(_Manager([]), batch, async_ops=False)
    assert now[0] == pytest.approx(batch[1][0])
    assert [r["async"] for r in emu.records] == [False, False]
    # Megatron-FSDP's gradient reduce-scatters: synchronous, under torch.cuda.stream(rs_stream)
    start = now[0]
    batch = [_issue(emu), _issue(emu)]
    side = cpu_streams.CpuStream()
    with cpu_streams.stream(side):
        emu.finish_coalesced(_Manager([]), batch, async_ops=False)
        event = side.record_event()
    assert now[0] == start
    event.wait()
    assert now[0] == pytest.approx(batch[1][0])
