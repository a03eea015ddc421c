"""The schedule's graph cuts (``schedule/engine/cuts.py``): what reaches the sink, what is not traversed,
and what each costs in aten calls (docs/host-cost.md counts them per layer)."""

import torch
from torch.profiler import profile

from megatron_oases.schedule.engine.cuts import grad_sink, joined_reduction


def _aten_calls(fn):
    with profile() as prof:
        out = fn()
    return out, {e.key: e.count for e in prof.key_averages() if e.key.startswith("aten::")}


def test_grad_sink_cuts_the_graph_and_costs_one_detach():
    anchor = torch.zeros((), requires_grad=True)
    w = torch.randn(3, requires_grad=True)
    x = w * 2  # has a graph: the sink must not lead backward into it
    got = []
    y, calls = _aten_calls(lambda: grad_sink(anchor, x, got.append))
    assert calls == {"aten::detach": 1}
    assert y is not x and y.data_ptr() == x.data_ptr() and not y._is_view()
    (y * torch.arange(3.0)).sum().backward()
    torch.testing.assert_close(got[0], torch.arange(3.0))
    assert w.grad is None and anchor.grad is None  # stopped at the sink


def test_grad_sink_on_a_tensor_without_graph():
    anchor = torch.zeros((), requires_grad=True)
    got = []
    y = grad_sink(anchor, torch.ones(2), got.append)
    assert y.requires_grad
    (3 * y).sum().backward()
    torch.testing.assert_close(got[0], torch.full((2,), 3.0))


def test_joined_reduction_passes_the_gradient_to_the_partial_sum_without_a_call():
    w = torch.randn(4, requires_grad=True)
    partial = w * 3
    reduced = partial.data.clone() * 2  # stands in for the all-reduce's result
    r, calls = _aten_calls(lambda: joined_reduction(partial, reduced))
    assert calls == {}
    assert r is reduced and r.grad_fn is not None  # the node owns the result, no view of it
    (r * torch.arange(4.0)).sum().backward()
    torch.testing.assert_close(w.grad, 3 * torch.arange(4.0))  # the identity, then partial's graph
