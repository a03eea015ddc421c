"""``--oases-cuda-graphs``' bookkeeping (:mod:`megatron_oases.schedule.megatron.graphs`) in its ``eager``
mode: the static buffers, the copies a forward keeps busy until its backward, the forward without
grad that keeps none. The capture itself needs a GPU: ``benchmarks/gpu/check.sh`` (step
``graphs``) runs the schedules' parity and host floor with it."""

import argparse
import gc

import pytest
import torch

from megatron_oases.errors import OasesConfigError
from megatron_oases.schedule.megatron.graphs import MAX_COPIES, BlockGraphs
from megatron_oases.validation import check_cuda_graphs


class Block(torch.nn.Module):
    """A stand-in main op: (partial output, skip-add bias) as Megatron's row linear returns."""

    def __init__(self, with_bias=True):
        super().__init__()
        self.fc1 = torch.nn.Linear(8, 16, bias=False)
        self.fc2 = torch.nn.Linear(16, 8, bias=False)
        self.bias = torch.nn.Parameter(torch.randn(8)) if with_bias else None

    def forward(self, x, scale=None):
        h = torch.nn.functional.gelu(self.fc1(x))
        if scale is not None:
            h = h * scale
        return self.fc2(h), self.bias


def _grads(module):
    return {n: p.grad.clone() for n, p in module.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("with_bias", [True, False])
def test_replays_match_eager_calls_for_two_sub_batches(with_bias):
    torch.manual_seed(0)
    block = Block(with_bias)
    graphs = BlockGraphs("eager")
    xs = [torch.randn(3, 8, requires_grad=True) for _ in range(2)]
    scale = torch.rand(16)
    gs = [torch.randn(3, 8) for _ in range(2)]

    # reference: plain calls, both forwards before both backwards (the schedule's order)
    ref_outs = [block(x, scale) for x in xs]
    for (out, bias), g in zip(ref_outs, gs):
        torch.autograd.backward([out] + ([bias] if bias is not None else []),
                                [g] + ([g.sum(0)] if bias is not None else []))  # fmt: skip
    ref_x = [x.grad.clone() for x in xs]
    ref_p = _grads(block)
    block.zero_grad()
    for x in xs:
        x.grad = None

    outs = [graphs.run(block, block, (x, scale)) for x in xs]
    # the first sub-batch's copy is busy until its backward: the second took another copy
    assert len(next(iter(graphs.copies.values()))) == 2
    for (out, bias), (ref, ref_bias) in zip(outs, ref_outs):
        torch.testing.assert_close(out, ref)
        assert bias is block.bias  # a parameter output is handed back, not copied
    for (out, bias), g in zip(reversed(outs), reversed(gs)):
        torch.autograd.backward([out] + ([bias] if bias is not None else []),
                                [g] + ([g.sum(0)] if bias is not None else []))  # fmt: skip
    for x, ref in zip(xs, ref_x):
        torch.testing.assert_close(x.grad, ref)
    got = _grads(block)
    assert set(got) == set(ref_p)
    for name, ref in ref_p.items():
        torch.testing.assert_close(got[name], ref)
    # both copies free again: the next micro-batch reuses them, capturing nothing
    assert not any(c.busy for c in next(iter(graphs.copies.values())))
    graphs.run(block, block, (xs[0], scale))
    assert graphs.captures == 2


def test_a_forward_without_grad_returns_clones_and_keeps_no_copy_busy():
    block = Block()
    graphs = BlockGraphs("eager")
    x = torch.randn(3, 8)
    with torch.no_grad():
        a, _ = graphs.run(block, block, (x,))
        b, _ = graphs.run(block, block, (x * 2,))
        expected_a, _ = block(x)
    assert graphs.captures == 1  # one copy served both
    torch.testing.assert_close(a, expected_a)  # not overwritten by the second call
    assert not a.requires_grad and a.data_ptr() != b.data_ptr()
    # with grad, the same shapes are another copy (it keeps what backward needs)
    out, _ = graphs.run(block, block, (x.requires_grad_(),))
    assert graphs.captures == 2 and out.requires_grad


def test_a_graph_dropped_without_backward_frees_its_copy():
    block = Block()
    graphs = BlockGraphs("eager")
    x = torch.randn(3, 8, requires_grad=True)
    out, _ = graphs.run(block, block, (x,))
    (call,) = next(iter(graphs.copies.values()))
    assert call.busy
    del out
    gc.collect()
    assert not call.busy


def test_too_many_busy_copies_is_one_clear_error():
    block = Block()
    graphs = BlockGraphs("eager")
    x = torch.randn(3, 8, requires_grad=True)
    kept = [graphs.run(block, block, (x,)) for _ in range(MAX_COPIES)]
    with pytest.raises(RuntimeError, match="backward never ran"):
        graphs.run(block, block, (x,))
    assert len(kept) == MAX_COPIES


def _args(**kw):
    base = dict(
        oases_cuda_graphs="capture",
        oases_schedule="oases",
        sequence_parallel=False,
        oases_split="batch",
        attention_dropout=0.0,
        gradient_accumulation_fusion=False,
        recompute_granularity="full",
        recompute_modules=None,
    )
    base.update(kw)
    return argparse.Namespace(**base)


@pytest.mark.parametrize(
    "change, cuda, fix",
    [
        (dict(), False, "needs a CUDA GPU"),
        (dict(attention_dropout=0.1), True, "--attention-dropout 0"),
        (dict(gradient_accumulation_fusion=True), True, "--no-gradient-accumulation-fusion"),
        (dict(sequence_parallel=True), True, "--sequence-parallel"),
        (dict(oases_split="sequence"), True, "--oases-split batch"),
        (dict(recompute_granularity="selective"), True, "--recompute-modules layernorm"),
    ],
)
def test_what_a_capture_cannot_hold_is_refused_in_one_line(change, cuda, fix):
    with pytest.raises(OasesConfigError, match=fix) as err:
        args = _args(**change)
        check_cuda_graphs(args, args.oases_schedule, cuda)
    assert "\n" not in str(err.value)


def test_eager_mode_runs_without_a_gpu_and_keeps_dropout():
    check_cuda_graphs(_args(oases_cuda_graphs="eager", attention_dropout=0.1), "oases", False)
    check_cuda_graphs(
        _args(recompute_granularity="selective", recompute_modules=["layernorm"]), "oases", True
    )
    check_cuda_graphs(_args(oases_cuda_graphs=None), "off", False)


def test_graphed_compare_variants_are_refused_without_a_gpu(monkeypatch):
    from megatron_oases.compare.variants import VARIANTS, parse_variants

    assert "--oases-cuda-graphs" in VARIANTS["oases-graphs"].flags
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(OasesConfigError, match="need a CUDA GPU") as err:
        parse_variants("megatron,oases-graphs")
    assert "\n" not in str(err.value)
