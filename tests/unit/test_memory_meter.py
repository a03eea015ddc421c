"""LiveTensorMeter: storages count while a tensor on them is alive, including after Megatron's
``deallocate_output_tensor`` swaps a kept output's ``.data`` (no op reports that)."""

import gc

import torch

from megatron_oases.instrument.memory import LiveTensorMeter

N = 1 << 20  # floats: 4 MiB per tensor
MB4 = 4 * N


def _free_data(t):
    """What Megatron's ``deallocate_output_tensor`` does to a pipeline/kept-graph output."""
    t.data = torch.empty((1,), dtype=t.dtype)


def test_counts_while_alive_and_releases_on_del():
    with LiveTensorMeter() as meter:
        a = torch.randn(N)
        b = a * 2
        assert meter.current_bytes == 2 * MB4
        del a
        gc.collect()
        assert meter.current_bytes == MB4
        del b
        gc.collect()
    assert meter.current_bytes == 0 and meter.peak_bytes == 2 * MB4


def test_storage_freed_by_data_swap_stops_counting():
    """The swapped tensor stays alive (its grad_fn is what backward needs); its old storage does
    not. Later outputs of the same size must not add up in the peak."""
    with LiveTensorMeter() as meter:
        w = torch.randn(N, requires_grad=True)
        outs = []
        for _ in range(3):
            out = w * 3
            _free_data(out)
            outs.append(out)  # kept, like the engine's P_j
        torch.randn(N)  # may reuse a freed output's address
    assert all(o.grad_fn is not None for o in outs)
    assert meter.peak_bytes < 2 * MB4 + MB4 // 2, meter.peak_bytes  # w + one 4 MiB tensor


def test_an_alias_keeps_a_swapped_storage_counted():
    """The engine hands ``P.detach()`` to the all-reduce before freeing P's data: that storage
    is in use until the reduced tensor dies, and free after."""
    with LiveTensorMeter() as meter:
        p = torch.randn(N) * 1.0
        buf = p.detach()
        _free_data(p)
        q = torch.randn(N)
        assert meter.peak_bytes >= 2 * MB4, meter.peak_bytes  # buf + q
        del buf, q
        gc.collect()
        assert meter.current_bytes < MB4 // 2, meter.current_bytes
        x, y = torch.randn(N), torch.randn(N)
    assert meter.peak_bytes < 2 * MB4 + MB4 // 2, meter.peak_bytes
    assert p.grad_fn is None and x.numel() == y.numel() == N


def _in_package(source, name="megatron_oases.fake_model"):
    """Functions compiled as if they lived in a megatron_oases module (the meter names the
    innermost Megatron / megatron-oases functions on the stack as where a tensor was created)."""
    scope = {"__name__": name, "torch": torch}
    exec(compile(source, f"/site/megatron_oases/{name.rsplit('.', 1)[-1]}.py", "exec"), scope)
    return scope


def test_breakdown_says_what_is_live_at_the_peak():
    """At the peak: one 4 MiB activation and two 1 MiB ones, each group named by the function
    that created it; what is allocated after the peak and freed does not change the snapshot."""
    fake = _in_package(
        "def layer(n):\n"
        "    return torch.randn(n)\n"
        "def block(n, k):\n"
        "    return [layer(n) for _ in range(k)]\n"
    )
    with LiveTensorMeter(breakdown=True) as meter:
        big = fake["block"](N, 1)
        small = fake["layer"](N // 4), fake["layer"](N // 4)
        peak = meter.current_bytes
        del big
        gc.collect()
        fake["layer"](N // 2)  # below the peak: freed at once, not in the snapshot
    assert meter.peak_bytes == peak == MB4 + 2 * (MB4 // 4)
    groups = {(g["site"], tuple(g["shape"])): (g["bytes"], g["count"]) for g in meter.live_at_peak}
    assert groups == {
        ("fake_model.layer < fake_model.block", (N,)): (MB4, 1),
        ("fake_model.layer", (N // 4,)): (MB4 // 2, 2),
    }, meter.live_at_peak
    assert meter.live_at_peak[0]["bytes"] == MB4  # largest first
    assert meter.peak_site == "fake_model.layer"
    assert len(small) == 2


def test_no_breakdown_unless_asked():
    with LiveTensorMeter() as meter:
        a = torch.randn(N)
    assert meter.peak_bytes == MB4 and meter.live_at_peak == [] and a.numel() == N


class _Cycle:
    """A tensor reachable only through a reference cycle: freed when the collector runs."""

    def __init__(self, t):
        self.t, self.me = t, self


def test_a_collection_during_the_stale_scan_changes_nothing_it_reads(monkeypatch):
    """The collector may run at any point of the meter's scan for stale storages, and the
    finalizers of the tensors it frees drop entries from the live table (a CI failure:
    "dictionary changed size during iteration"). The scan must survive it and count nothing
    twice."""
    holds = LiveTensorMeter._holds
    armed = []

    def holds_then_collect(key, entry):
        if armed:
            armed.clear()
            gc.collect()  # what Python's collector did inside the scan
        return holds(key, entry)

    monkeypatch.setattr(LiveTensorMeter, "_holds", staticmethod(holds_then_collect))
    was_enabled = gc.isenabled()
    gc.collect()
    gc.disable()
    try:
        with LiveTensorMeter() as meter:
            garbage = [_Cycle(torch.randn(N // 4) * 1.0) for _ in range(8)]
            held = torch.randn(N) * 1.0
            assert meter.current_bytes == 3 * MB4
            del garbage  # unreachable now, but only the collector frees it
            armed.append(True)
            big = torch.randn(2 * N) * 1.0  # a new peak: the scan runs, the collector inside it
            assert not armed, "the scan did not run"
            assert meter.current_bytes == MB4 + 2 * MB4, meter.current_bytes  # held + big
        assert meter.peak_bytes >= meter.current_bytes
        del held, big
    finally:
        if was_enabled:
            gc.enable()
