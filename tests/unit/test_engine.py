"""The engine against plain autograd, in seconds: :class:`ScheduledLayers` over a stand-in block
table (``helpers.blocks``: no Megatron layer, no process group), parametrized over schedule ×
what forward keeps × sub-batches × tail pieces (and the hybrid layout and sequence parallelism),
comparing the output and every input and parameter gradient, then checking that the programs
left nothing behind. An op-order bug in ``ops.py``, ``forward.py`` or ``backward.py`` fails here
(a wrong gradient, or an empty slot taken) rather than as a loss mismatch in an e2e run.
"""

import contextlib
import dataclasses

import pytest
import torch
from helpers.blocks import make_blocks, parameters, reference

from megatron_oases.schedule.engine import forward as forward_mod
from megatron_oases.schedule.engine.node import BACKWARD, ScheduledLayers, run_scheduled
from megatron_oases.schedule.engine.ops import RngStates
from megatron_oases.schedule.engine.split import BatchSplit
from megatron_oases.schedule.engine.state import BlockState, EndState
from megatron_oases.validation import SPLIT_SCHEDULES

#: what forward keeps → how many leading layers are recomputed, of ``layers``: none (every
#: block's graph kept); all; the first (Megatron's ``--recompute-method block
#: --recompute-num-layers 1``: the later layers' graphs kept)
KEEPS = {"graphs": lambda layers: 0, "none": lambda layers: layers, "later": lambda layers: 1}


def _saved(schedule, keeps):
    if keeps == "graphs":
        return "graphs"
    return "blocks" if schedule == "oases" else "layers"


@contextlib.contextmanager
def _replay_cpu(state):
    current = torch.get_rng_state()
    torch.set_rng_state(state)
    try:
        yield
    finally:
        torch.set_rng_state(current)


#: RNG snapshots of the CPU generator alone (Megatron's, the adapter's, read the CUDA one too)
CPU_RNG = RngStates(torch.get_rng_state, _replay_cpu)


def _check_left_empty(run, sbs):
    """Every slot of every sub-batch taken (``bias`` is kept for the whole micro-batch), no early
    reduction waiting, and the engine holds no sub-batch."""
    for sb in sbs:
        for j, block in enumerate(sb.blocks):
            for f in dataclasses.fields(BlockState):
                value = getattr(block, f.name)
                if f.name == "bias":
                    continue
                assert value is None or value == {}, f"sub-batch {sb.index} block {j}: {f.name}"
        for f in dataclasses.fields(EndState):
            assert getattr(sb.ends, f.name) is None, f"sub-batch {sb.index}: ends.{f.name}"
    assert not run.early._started
    assert run.sbs == [] and run.ops is None


def _check(schedule, keeps, parts, pieces, monkeypatch, layout="gpt", sp=False):
    monkeypatch.setattr(forward_mod, "TAIL_PIECES", pieces)
    cut = []  # blocks forward ran in runs of tokens: proves the parametrization reaches them
    pieces_of = forward_mod._pieces

    def counted(ops, sb, j, n, layer_checkpoint):
        cut.append(n)
        return pieces_of(ops, sb, j, n, layer_checkpoint)

    monkeypatch.setattr(forward_mod, "_pieces", counted)
    blocks = make_blocks(layout, layers=2 if layout == "gpt" else 4, sequence_parallel=sp)
    params = parameters(blocks)
    x = torch.randn(8, 6, 8, dtype=torch.float64)  # [s, b, h]
    g = torch.randn_like(x)

    x_ref = x.clone().requires_grad_()
    out_ref = reference(blocks, x_ref)
    out_ref.backward(g)
    grads_ref = [p.grad.clone() for p in params]
    for p in params:
        p.grad = None

    recomputed = KEEPS[keeps](len(blocks.layers))
    run = ScheduledLayers(
        blocks,
        schedule,
        split=lambda hidden: BatchSplit(hidden.shape, parts),
        rng=CPU_RNG,
        recomputed_layers=recomputed,
    )
    assert (schedule, run.saved) in BACKWARD
    assert run.saved == _saved(schedule, keeps)
    x_run = x.clone().requires_grad_()
    out = run_scheduled(run, x_run)
    sbs = run.sbs
    assert len(sbs) == parts
    assert cut == ([] if pieces == 1 or sp else [pieces])
    out.backward(g)

    torch.testing.assert_close(out, out_ref, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(x_run.grad, x_ref.grad, rtol=1e-12, atol=1e-12)
    for i, (p, ref) in enumerate(zip(params, grads_ref)):
        assert p.grad is not None, f"parameter {i} got no gradient"
        torch.testing.assert_close(p.grad, ref, rtol=1e-12, atol=1e-12, msg=f"parameter {i}")
    _check_left_empty(run, sbs)


@pytest.mark.parametrize("pieces", [1, 4])
@pytest.mark.parametrize("parts", [2, 3])
@pytest.mark.parametrize("keeps", list(KEEPS))
@pytest.mark.parametrize("schedule", SPLIT_SCHEDULES)
def test_engine_matches_autograd(schedule, keeps, parts, pieces, monkeypatch):
    """GPT layers (attention and MLP blocks), without sequence parallelism: the stage's last MLP
    block runs in ``pieces`` runs of tokens in the last sub-batch."""
    _check(schedule, keeps, parts, pieces, monkeypatch)


@pytest.mark.parametrize("layout,sp", [("gpt", True), ("hybrid", False), ("hybrid", True)])
@pytest.mark.parametrize("keeps", list(KEEPS))
@pytest.mark.parametrize("schedule", SPLIT_SCHEDULES)
def test_engine_matches_autograd_hybrid_and_sp(schedule, keeps, layout, sp, monkeypatch):
    """One-block hybrid layers, and sequence parallelism (all-gather, reduce-scatter, the kept
    input's re-gather and the yield points, on a group of one)."""
    _check(schedule, keeps, 2, 4, monkeypatch, layout, sp)


def test_every_backward_row_is_reached():
    """The parametrization above reaches every row of the engine's backward table."""
    reached = {(s, _saved(s, k)) for s in SPLIT_SCHEDULES for k in KEEPS}
    assert reached == set(BACKWARD)
