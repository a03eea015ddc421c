"""``--oases-cuda-graphs eager`` in Megatron-LM's own loop: every schedule through the graphs'
bookkeeping (static buffers, one copy per busy forward, a pipeline's micro-batches in flight)
against stock Megatron, loss and every gradient. The CUDA capture is the same code with the
replays in place of the eager calls: ``benchmarks/gpu/check.sh`` (step ``graphs``) checks it on a
GPU."""

import pytest
from helpers import DROP, GPT, LLAMA, NO_DROP, RECOMPUTE, variants_worker
from helpers.runs import assert_matches
from helpers.variants import ITERS, layout

from megatron_oases.launch import run_distributed

GRAPHS = "--oases-cuda-graphs eager "
VARIANTS = [
    ("stock", RECOMPUTE + "--oases-schedule off"),
    ("oases", RECOMPUTE + GRAPHS + "--oases-schedule oases"),
    ("cross-pass", RECOMPUTE + GRAPHS + "--oases-schedule cross-pass"),
    ("overlap", RECOMPUTE + GRAPHS + "--oases-schedule overlap"),
    ("stock-keep", "--oases-schedule off"),
    ("overlap-keep", GRAPHS + "--oases-schedule overlap"),
]
CONFIGS = {
    "gpt-tp2-pp1-mbs2": layout(GPT, 2, tp=2, mbs=2, gbs=4),
    # 1F1B keeps two micro-batches in flight on the first stage: two copies per kept block
    "llama-tp2-pp2-mbs2": layout(LLAMA, 4, tp=2, pp=2, mbs=2, gbs=8),
}


def counting_worker(base, variants):
    """``variants_worker`` counting the main ops that went through the graphs, per variant."""
    from megatron_oases.schedule.megatron import graphs

    original, calls = graphs.BlockGraphs.run, []

    def run(self, owner, fn, args, deferral=None):
        calls.append(owner)
        return original(self, owner, fn, args, deferral)

    graphs.BlockGraphs.run = run
    try:
        out = {}
        for name, flags in variants:
            del calls[:]
            out[name] = variants_worker(base, [(name, flags)])[name]
            out[name]["graphed_calls"] = len(calls)
        return out
    finally:
        graphs.BlockGraphs.run = original


@pytest.mark.timeout(600)
@pytest.mark.parametrize("config", list(CONFIGS))
def test_graphed_schedules_match_stock(config):
    world, base = CONFIGS[config]
    results = run_distributed(
        counting_worker, world, base + " " + ITERS + NO_DROP, VARIANTS, timeout=560
    )
    for rank, res in enumerate(results):
        assert res["stock"]["graphed_calls"] == res["stock-keep"]["graphed_calls"] == 0
        for name, ref in [
            ("oases", "stock"),
            ("cross-pass", "stock"),
            ("overlap", "stock"),
            ("overlap-keep", "stock-keep"),
        ]:
            assert res[name]["graphed_calls"] > 0, name  # the blocks went through the graphs
            assert_matches(res[name], res[ref], f"{config} {name} rank {rank}")


@pytest.mark.timeout(300)
def test_graphed_schedules_replay_dropout_exactly():
    """With dropout the schedules draw masks per sub-batch (so not stock's): graphed, every
    schedule matches the ungraphed ``overlap`` that recomputes nothing (``eager`` keeps the
    dropout a capture cannot)."""
    world, base = CONFIGS["gpt-tp2-pp1-mbs2"]
    variants = [("ref", "--oases-schedule overlap")] + [
        (name, flags) for name, flags in VARIANTS if not name.startswith("stock")
    ]
    for rank, res in enumerate(
        run_distributed(counting_worker, world, base + " " + ITERS + DROP, variants, timeout=280)
    ):
        assert res["ref"]["graphed_calls"] == 0
        for name, _ in variants[1:]:
            assert res[name]["graphed_calls"] > 0, name
            assert_matches(res[name], res["ref"], f"dropout {name} rank {rank}", tol=1e-6)
