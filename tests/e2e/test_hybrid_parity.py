"""``HybridModel`` (Megatron's ``--hybrid-layer-pattern`` stack, the migration target of
``GPTModel``) under every schedule against stock ``HybridModel`` in Megatron-LM's own loop: loss
and every gradient, fp32, dropout 0, full/uniform recomputation on the stock side.

Each ``*`` (attention) or ``-`` (MLP) layer is one schedule block; ``*-*-`` is the GPT layout,
``*--*`` is not (two MLP layers in a row, the stage ending on attention).
"""

import pytest
from helpers import DROP, LLAMA, NO_DROP, RECOMPUTE, SHAPE, variants_worker
from helpers.runs import assert_schedules_match_stock, max_rel_diff
from helpers.variants import ITERS
from helpers.variants import SCHEDULE_VARIANTS as VARIANTS

from megatron_oases.launch import run_distributed

LLAMA_FLAGS = LLAMA.replace("--num-layers {layers} " + SHAPE, "")
#: (world size, flags): pattern, model family, TP × PP, micro- and global batch
CONFIGS = {
    "gpt-*-*--tp2-pp1-mbs2": (2, "'*-*-'", "", "--tensor-model-parallel-size 2", 2, 4),
    "llama-*--*-tp4-pp1-mbs3": (4, "'*--*'", LLAMA_FLAGS, "--tensor-model-parallel-size 4", 3, 3),
    "llama-*-*-|*-*--tp2-pp2-mbs2": (
        4,
        "'*-*-|*-*-'",
        LLAMA_FLAGS,
        "--tensor-model-parallel-size 2 --pipeline-model-parallel-size 2",
        2,
        8,
    ),
}


def _base(pattern, family, parallel, mbs, gbs):
    return (
        f"--hybrid-layer-pattern {pattern} {SHAPE}{family}{parallel} "
        f"--micro-batch-size {mbs} --global-batch-size {gbs} "
    )


@pytest.mark.timeout(600)
@pytest.mark.parametrize("config", list(CONFIGS))
def test_hybrid_schedules_match_stock(config):
    world, *layout = CONFIGS[config]
    base = _base(*layout) + ITERS + NO_DROP + RECOMPUTE
    results = run_distributed(variants_worker, world, base, VARIANTS, timeout=560)
    assert_schedules_match_stock(results, config, nonzero=False)


@pytest.mark.timeout(600)
def test_hybrid_dropout_replayed_exactly():
    """Dropout on: ``oases`` recomputes each block from its RNG snapshot, so it matches
    ``overlap`` (which keeps its masks from forward) to rounding, and both differ from stock
    (the sub-batches draw their own masks)."""
    base = _base(*CONFIGS["gpt-*-*--tp2-pp1-mbs2"][1:]) + ITERS + DROP
    variants = [
        ("stock", "--oases-schedule off"),
        ("overlap", "--oases-schedule overlap"),
        ("oases", "--oases-schedule oases " + RECOMPUTE),
    ]
    for rank, res in enumerate(run_distributed(variants_worker, 2, base, variants, timeout=560)):
        ref, got = res["overlap"], res["oases"]
        assert ref["losses"] != res["stock"]["losses"]  # the dropout is on
        assert max_rel_diff(got["losses"], ref["losses"]) < 1e-6
        for pname, g in ref["grads"].items():
            assert max_rel_diff(got["grads"][pname], g) < 1e-6, (rank, pname)
