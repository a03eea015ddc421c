"""The adapter's deferring column linear (``schedule/megatron/linears.py``) without a process
group: Megatron's linear with its input-gradient reduction handed to the schedule."""

import pytest
import torch

from megatron_oases.schedule.megatron.linears import linear_with_early_dgrad


class _Early:
    """Records what a column linear's backward hands over (EarlyReductions' interface)."""

    def __init__(self):
        self.started = []

    def start(self, tensor, group, scatter=False):
        self.started.append((tensor, group, scatter))


@pytest.mark.parametrize("bias", [False, True])
def test_linear_with_early_dgrad_is_the_linear_and_hands_over_its_input_gradient(bias):
    """Megatron's column linear with its input-gradient reduction handed to the schedule: the
    gradients of a plain linear, and the very input-gradient tensor it returns started on the
    linear's group, once."""
    torch.manual_seed(0)
    x = torch.randn(3, 2, 4, requires_grad=True)
    w = torch.randn(5, 4, requires_grad=True)
    b = torch.randn(5, requires_grad=True) if bias else None
    ref = [t.detach().clone().requires_grad_() for t in (x, w)]
    ref_b = b.detach().clone().requires_grad_() if bias else None
    early, seen = _Early(), []
    x.register_hook(lambda g: seen.append(g))
    out = linear_with_early_dgrad(x, w, b, False, early, "tp", scatter=True)
    expected = torch.nn.functional.linear(ref[0], ref[1], ref_b)
    torch.testing.assert_close(out, expected)
    grad = torch.randn_like(out)
    out.backward(grad)
    expected.backward(grad)
    torch.testing.assert_close(x.grad, ref[0].grad)
    torch.testing.assert_close(w.grad, ref[1].grad)
    if bias:
        torch.testing.assert_close(b.grad, ref_b.grad)
    ((started, group, scatter),) = early.started
    assert started is seen[0] and group == "tp" and scatter
