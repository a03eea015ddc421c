"""The testbed must not inflate compute (issue 13): an emulated wait (async ``Work.wait()`` and a
synchronous collective) sleeps, its thread and process using almost no CPU. On 2 gloo ranks and
against a busy process: ``tests/e2e/test_testbed_contention_e2e.py``."""

import pytest
from helpers.emulation import CPU_LIMIT, WAIT_S, cpu_during

from megatron_oases.testbed.clusters import load_cluster
from megatron_oases.testbed.emulator import usage_line
from megatron_oases.testbed.link_model import EmulatedWork, LinkEmulator


def _waits(emu):
    """Wall and CPU of an async wait and of a synchronous op, each until ``WAIT_S`` from now."""
    out = {}
    now = emu.clock()
    info = ("all_reduce", 0, [0, 1], WAIT_S, now, now, now + WAIT_S)
    work = EmulatedWork(None, now + WAIT_S, emu, emu._record(*info, is_async=True))
    out["async"] = cpu_during(work.wait)
    now = emu.clock()
    info = ("all_reduce", 0, [0, 1], WAIT_S, now, now, now + WAIT_S)
    out["sync"] = cpu_during(lambda: emu.finish_sync(None, now + WAIT_S, info))
    return out


@pytest.mark.timeout(30)
def test_emulated_wait_sleeps():
    emu = LinkEmulator(load_cluster("rtx3090-pcie"), 100.0)
    emu.start_usage()
    for kind, (wall, thread_cpu, proc_cpu) in _waits(emu).items():
        assert wall >= WAIT_S * 0.99, (kind, wall)
        assert thread_cpu < CPU_LIMIT * WAIT_S and proc_cpu < CPU_LIMIT * WAIT_S, (
            kind,
            thread_cpu,
            proc_cpu,
        )
    u = emu.usage()
    assert u["blocked_s"] >= 2 * WAIT_S * 0.99 and u["blocked_cpu_s"] < CPU_LIMIT * u["blocked_s"]
    assert "WARNING" not in usage_line(u)
    # Self-check: a waiting loop that polls instead of sleeping is caught by the same measures.
    # On a host loaded far beyond its cores a spinning thread gets less than CPU_LIMIT of a core:
    # it must then get at least half of what a plain busy loop gets over the same time.
    share = _busy_loop_cpu(WAIT_S) / WAIT_S
    spinning = LinkEmulator(load_cluster("rtx3090-pcie"), 100.0, sleep=lambda s: None)
    spinning.start_usage()
    for kind, (wall, thread_cpu, _) in _waits(spinning).items():
        need = min(CPU_LIMIT, share / 2) * WAIT_S
        assert wall >= WAIT_S * 0.99 and thread_cpu > need, (kind, thread_cpu, share)
    u = spinning.usage()
    if share > 2 * CPU_LIMIT:  # the emulator's own warning uses the fixed limit
        assert u["blocked_cpu_s"] > CPU_LIMIT * u["blocked_s"]
        assert "WARNING: its waits used" in usage_line(u)


def _busy_loop_cpu(seconds):
    """Thread CPU a busy loop gets in ``seconds`` of wall time on this host now."""
    import time

    end, start = time.perf_counter() + seconds, time.thread_time()
    while time.perf_counter() < end:
        pass
    return time.thread_time() - start
