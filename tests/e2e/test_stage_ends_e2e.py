"""The stage ends in the schedule (:mod:`megatron_oases.schedule.megatron.stage_ends`), op by op on one rank.

The embedding's backward re-runs Megatron's embedding forward from the forward's RNG snapshot
instead of keeping its graph: with dropout on, its value and every gradient must equal autograd
through the stock module drawing the same masks, per sub-batch and in the programs' order.
The end-to-end checks (parity with stock Megatron, overlap in the trace) are in
test_schedule_parity.py and test_schedule_behaviour.py.
"""

import pytest
import torch
from helpers.runs import max_rel_diff

B, S, H, V = 3, 8, 16, 50


def _embedding(dropout, sequence_parallel=False, positions="learned_absolute"):
    from megatron.core.models.common.embeddings.language_model_embedding import (
        LanguageModelEmbedding,
    )
    from megatron.core.transformer.transformer_config import TransformerConfig

    config = TransformerConfig(
        num_layers=1,
        hidden_size=H,
        num_attention_heads=2,
        hidden_dropout=dropout,
        use_cpu_initialization=True,
        tensor_model_parallel_size=2 if sequence_parallel else 1,
        sequence_parallel=sequence_parallel,
    )
    return LanguageModelEmbedding(
        config, vocab_size=V, max_sequence_length=S, position_embedding_type=positions
    )


def _run(program, deferral):
    """Run one sub-batch's ops in order, each collective to completion (TP=1: its result is its
    input), compute as the executor runs it (TMP communication deferred to ``deferral``)."""
    import torch.distributed as dist

    from megatron_oases.schedule.engine.comm import start_collective
    from megatron_oases.schedule.engine.executor import Comm

    for op in program:
        if isinstance(op, Comm):
            tensor = op.get()
            if dist.get_world_size(op.group) == 1:
                op.done(tensor)
                continue
            reduce_op = dist.ReduceOp.SUM if op.reduce_op is None else op.reduce_op
            work, result = start_collective(op.kind, tensor, op.group, reduce_op)
            work.wait()
            op.done(result())
        else:
            with deferral.deferring():
                op.fn()


def _grads(module):
    grads = {n: p.grad.clone() for n, p in module.named_parameters() if p.grad is not None}
    module.zero_grad(set_to_none=True)
    return grads


@pytest.mark.parametrize("kind,sizes", [("batch", [3]), ("batch", [2, 1]), ("sequence", [4, 4])])
@pytest.mark.parametrize("dropout", [0.0, 0.5])
def test_embedding_end_matches_autograd(model_parallel_1, kind, sizes, dropout):
    _check_embedding_end(_embedding(dropout), sizes, dropout, kind)


def _sequence_parallel_worker(positions, dropout):
    """One TP=2 rank: the end's programs under SP (the lookup reduce-scattered, the gradient's
    all-gather issued by the program) against autograd through the stock module."""
    from megatron.core import parallel_state, tensor_parallel

    from megatron_oases import platform
    from megatron_oases.patching import Patch
    from megatron_oases.schedule.engine.deferral import make_scatter

    platform.install_cpu_shims()
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=2)
    tensor_parallel.model_parallel_cuda_manual_seed(1234)
    split = tensor_parallel.scatter_to_sequence_parallel_region
    patch = Patch(  # what the oases-schedule patch replaces for the embedding
        "embedding-end",
        [(tensor_parallel, "scatter_to_sequence_parallel_region", make_scatter(split))],
    )
    torch.manual_seed(0)
    emb = _embedding(dropout, sequence_parallel=True, positions=positions)
    assert emb.reduce_scatter_embeddings == (positions == "rope")
    patch.install()
    try:
        _check_embedding_end(emb, [2, 1], dropout)
    finally:
        patch.uninstall()
    return True


@pytest.mark.timeout(120)
@pytest.mark.parametrize("positions", ["learned_absolute", "rope"])
@pytest.mark.parametrize("dropout", [0.0, 0.5])
def test_embedding_end_matches_autograd_with_sequence_parallel(positions, dropout):
    from megatron_oases.launch import run_distributed

    assert run_distributed(_sequence_parallel_worker, 2, positions, dropout, timeout=100)


def _cross_entropy_worker(vocab):
    """One TP=2 rank: the loss's ops (:mod:`megatron_oases.schedule.megatron.loss`), run in program order
    with each collective to completion, against Megatron's ``vocab_parallel_cross_entropy``:
    the same per-token loss and logits gradient, bit for bit, with targets in both vocab shards."""
    from megatron.core import parallel_state, tensor_parallel

    from megatron_oases import platform
    from megatron_oases.schedule.megatron.loss import cross_entropy_ops

    platform.install_cpu_shims()
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=2)
    group = parallel_state.get_tensor_model_parallel_group()
    rank, shard = group.rank(), vocab // 2
    torch.manual_seed(3)  # the same full logits, targets and loss gradient on every rank
    full = torch.randn(S, B, vocab) * 4
    labels = torch.randint(0, vocab, (B, S))
    grad = torch.randn(B, S)
    local = full[..., rank * shard : (rank + 1) * shard].contiguous()
    assert (labels < shard).any() and (labels >= shard).any()

    ref_logits = local.clone().requires_grad_()
    ref = tensor_parallel.vocab_parallel_cross_entropy(
        ref_logits * 1.0, labels.transpose(0, 1).contiguous(), tp_group=group
    ).transpose(0, 1)
    ref.backward(grad)

    logits = local.clone().requires_grad_()
    got = []
    ops = cross_entropy_ops(group, lambda: logits * 1.0, labels, got.append, block="output")
    assert [type(op).__name__ for op in ops] == ["Compute", "Comm", "Compute", "Comm", "Compute"]
    from megatron_oases.schedule.engine.deferral import Deferral

    _run(ops, Deferral())
    (loss,) = got
    assert loss.shape == (B, S) and torch.equal(loss, ref.detach()), max_rel_diff(loss, ref)
    loss.backward(grad)
    assert torch.equal(logits.grad, ref_logits.grad), max_rel_diff(logits.grad, ref_logits.grad)
    return True


@pytest.mark.timeout(120)
@pytest.mark.parametrize("vocab", [50, 64])
def test_loss_ops_match_megatron_cross_entropy(vocab):
    from megatron_oases.launch import run_distributed

    assert run_distributed(_cross_entropy_worker, 2, vocab, timeout=100)


def _check_embedding_end(emb, sizes, dropout, kind="batch"):
    from megatron.core.models.common.embeddings.language_model_embedding import (
        LanguageModelEmbedding,
    )

    from megatron_oases.schedule.engine.deferral import Deferral
    from megatron_oases.schedule.megatron.linears import DeferringEmbedding, defer_linears
    from megatron_oases.schedule.megatron.rng import replay, snapshot
    from megatron_oases.schedule.megatron.split import make_split
    from megatron_oases.schedule.megatron.stage_ends import EmbeddingEnd
    from megatron_oases.schedule.engine.state import SubBatch

    tp = emb.config.tensor_model_parallel_size if emb.config.sequence_parallel else 1
    torch.manual_seed(1)  # the same ids and gradients on every rank
    ids = torch.randint(0, V, (B, S))
    pos = torch.arange(S).unsqueeze(0).expand(B, S)
    sequence = kind == "sequence"  # sub-batches of positions, [n, B, H] each
    grads_out = [torch.randn(n, B, H) if sequence else torch.randn(S // tp, n, H) for n in sizes]
    start = snapshot()

    # reference: autograd through the stock module, sub-batch after sub-batch
    outs, lo = [], 0
    for n, g in zip(sizes, grads_out):
        cut = (slice(None), slice(lo, lo + n)) if sequence else slice(lo, lo + n)
        out = emb(ids[cut], pos[cut])
        out.backward(g)
        outs.append(out.detach())
        lo += n
    ref = _grads(emb)

    # the end's ops: all forward programs first (as the executor interleaves them), then backward
    deferral = Deferral()  # the lookup defers to it, as prepare_model re-classes it
    assert defer_linears([emb], deferral) == 1
    assert isinstance(emb.word_embeddings, DeferringEmbedding)
    end = EmbeddingEnd(emb, LanguageModelEmbedding.forward, ids, pos, deferral)
    split = make_split(kind, torch.empty(S // tp, B, H), parts=len(sizes))
    assert split.sizes == sizes
    end.split(split)
    sbs = [SubBatch(i, None, None, None, n, num_blocks=0) for i, n in enumerate(sizes)]
    with replay(start):
        for sb in sbs:
            _run(end.forward_ops(sb, lambda h, sb=sb: setattr(sb, "input", h)), deferral)
        for sb, out in zip(sbs, outs):
            assert torch.equal(sb.input, out)  # same masks, same values
        for sb, g in zip(sbs, grads_out):
            sb[0].input_grad = g
            _run(end.backward_ops(sb), deferral)
    got = _grads(emb)
    assert set(got) == set(ref) and ref
    for name, g in ref.items():
        assert max_rel_diff(got[name], g) < 1e-6, name
    if dropout:  # the masks really dropped something
        assert any(torch.count_nonzero(out) < out.numel() * 0.75 for out in outs)
