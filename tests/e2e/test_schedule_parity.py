"""Every Oases schedule against stock Megatron in Megatron-LM's own loop: loss and every gradient.

Configurations cover TP=2/4, PP=1/2 (1F1B, 4 micro-batches), GPT and LLaMA-style layers (SwiGLU,
RMSNorm, GQA, RoPE, no bias) and micro-batch sizes 2 and 3 (uneven split 2+1), fp32, dropout 0,
with full/uniform recomputation on the stock side. Each configuration runs stock and the three
schedules through ``pretrain()`` in one set of processes; two iterations, so the second loss also
checks the first optimizer step.
"""

import pytest
from helpers import BLOCK, DROP, GPT, LLAMA, NO_DROP, RECOMPUTE, SELECTIVE_LN, variants_worker
from helpers.runs import assert_matches, assert_schedules_match_stock, max_rel_diff
from helpers.variants import ITERS
from helpers.variants import SCHEDULE_VARIANTS as VARIANTS
from helpers.variants import SPLIT_SCHEDULES, layout

from megatron_oases.launch import run_distributed

CONFIGS = {
    "gpt-tp2-pp1-mbs2": layout(GPT, 2, tp=2, mbs=2, gbs=4),
    "llama-tp2-pp1-mbs3": layout(LLAMA, 2, tp=2, mbs=3, gbs=6),
    "gpt-tp4-pp1-mbs3": layout(GPT, 2, tp=4, mbs=3, gbs=3),
    "llama-tp2-pp2-mbs2": layout(LLAMA, 4, tp=2, pp=2, mbs=2, gbs=8),
    "gpt-tp2-pp2-mbs3": layout(GPT, 4, tp=2, pp=2, mbs=3, gbs=12),
}


#: the configuration that also runs Megatron's fused functions compiled (``torch.compile``), as
#: on a user's machine; the suite runs them eagerly elsewhere (``tests/conftest.py``)
COMPILED = "gpt-tp2-pp1-mbs2"


@pytest.mark.timeout(600)
@pytest.mark.parametrize("config", list(CONFIGS))
def test_schedules_match_stock(config, request):
    if config == COMPILED:
        request.getfixturevalue("torch_compile")
    world, base = CONFIGS[config]
    results = run_distributed(
        variants_worker, world, base + " " + ITERS + NO_DROP + RECOMPUTE, VARIANTS, timeout=560
    )
    assert_schedules_match_stock(results, config)
    if config == COMPILED:  # Megatron's fused bias-dropout-add went through torch.compile
        assert all(res["stock"]["compiled_graphs"] > 0 for res in results), results[0].keys()


#: ``overlap`` at the memory settings other than full recomputation, each against stock Megatron
#: at the same setting: all activations kept, and Megatron's selective recomputation (core
#: attention recomputed inside Megatron's own ``SelfAttention`` in backward; with ``layernorm``
#: also the norms' outputs, freed in forward and recomputed before main_j's backward).
MEMORY_VARIANTS = [
    ("stock-keep", "--oases-schedule off"),
    ("overlap-keep", "--oases-schedule overlap"),
    ("stock-selective", "--oases-schedule off --recompute-granularity selective"),
    ("overlap-selective", "--oases-schedule overlap --recompute-granularity selective"),
    ("stock-selective-ln", SELECTIVE_LN + "--oases-schedule off"),
    ("overlap-selective-ln", SELECTIVE_LN + "--oases-schedule overlap"),
]


@pytest.mark.timeout(600)
@pytest.mark.parametrize("config", ["gpt-tp2-pp1-mbs2", "llama-tp2-pp2-mbs2"])
def test_overlap_matches_stock_without_full_recompute(config):
    world, base = CONFIGS[config]
    results = run_distributed(
        variants_worker, world, base + " " + ITERS + NO_DROP, MEMORY_VARIANTS, timeout=560
    )
    for rank, res in enumerate(results):
        for setting in ("keep", "selective", "selective-ln"):
            stock, got = res[f"stock-{setting}"], res[f"overlap-{setting}"]
            # no Transformer Engine here: Megatron's norm checkpoint needs its fix on both sides
            fix = ["norm-recompute-without-te"] if setting == "selective-ln" else []
            assert stock["installed"] == fix and got["installed"] == fix + ["oases-schedule"]
            assert_matches(got, stock, f"{config} {setting} rank {rank}")


#: ``--recompute-method block``: a stage's first N layers recomputed, the rest keep their graphs
#: (stock and schedules alike), so the kept and the recomputed layers meet inside one program.
BLOCK_CONFIGS = {
    # 3 layers, the first 2 recomputed; an uneven split (2+1)
    "gpt-tp2-pp1-l3-mbs3": (2, layout(GPT, 3, tp=2, mbs=3, gbs=3)[1] + " " + BLOCK.format(n=2)),
    # 2 layers per stage, the first of each recomputed: the first stage ends in a kept layer,
    # the last stage's kept layer feeds the output layer
    "llama-tp2-pp2-mbs2": (4, CONFIGS["llama-tp2-pp2-mbs2"][1] + " " + BLOCK.format(n=1)),
}


@pytest.mark.timeout(600)
@pytest.mark.parametrize("config", list(BLOCK_CONFIGS))
def test_block_recompute_matches_stock(config):
    world, base = BLOCK_CONFIGS[config]
    results = run_distributed(
        variants_worker, world, base + " " + ITERS + NO_DROP, VARIANTS, timeout=560
    )
    for rank, res in enumerate(results):
        stock = res["stock"]
        for name in SPLIT_SCHEDULES:
            assert res[name]["installed"] == ["oases-schedule"]
            assert_matches(res[name], stock, f"{config} {name} rank {rank}")


@pytest.mark.timeout(600)
@pytest.mark.parametrize(
    "model,mbs", [(GPT, 4), (LLAMA, 3)], ids=["gpt-tp2-mbs4", "llama-tp2-mbs3"]
)
def test_three_sub_batches_match_stock(model, mbs):
    """``--oases-sub-batches 3`` (uneven 2+1+1, and 1+1+1): every schedule against stock."""
    base = model.format(layers=2) + (
        f"--tensor-model-parallel-size 2 --micro-batch-size {mbs} --global-batch-size {mbs} "
    )
    variants = [VARIANTS[0]] + [(n, f + " --oases-sub-batches 3") for n, f in VARIANTS[1:]]
    # dropout on: recomputation replays each of the three sub-batches' masks exactly
    drop = "--oases-sub-batches 3 " + DROP
    variants += [
        ("overlap-drop", drop + "--oases-schedule overlap"),
        ("oases-drop", drop + "--oases-schedule oases"),
    ]
    results = run_distributed(
        variants_worker, 2, base + ITERS + NO_DROP + RECOMPUTE, variants, timeout=560
    )
    for rank, res in enumerate(results):
        stock = res["stock"]
        for name in SPLIT_SCHEDULES:
            assert_matches(res[name], stock, f"{name} mbs {mbs} rank {rank}")
        ref, got = res["overlap-drop"], res["oases-drop"]
        assert ref["losses"] != stock["losses"]  # the dropout is on
        assert max_rel_diff(got["losses"], ref["losses"]) < 1e-6
        for pname, g in ref["grads"].items():
            assert max_rel_diff(got["grads"][pname], g) < 1e-6, pname


#: ``--oases-split sequence``: sub-batches of consecutive positions; a later chunk's attention
#: reads the earlier chunks' keys and values, whose gradients reach them before their own
#: attention backward (the engine runs backward last chunk first).
SEQ = "--oases-split sequence "
SEQ_CONFIGS = {
    # one sample per micro-batch, which only a sequence split can split; every memory setting
    "gpt-tp2-pp1-mbs1": (
        2,
        layout(GPT, 2, tp=2, mbs=1, gbs=2)[1] + " ",
        [
            ("stock", RECOMPUTE + "--oases-schedule off"),
            *[(n, RECOMPUTE + SEQ + f) for n, f in VARIANTS[1:]],
            ("stock-keep", "--oases-schedule off"),
            ("overlap-keep", SEQ + "--oases-schedule overlap"),
            ("stock-selective-ln", SELECTIVE_LN + "--oases-schedule off"),
            ("overlap-selective-ln", SELECTIVE_LN + SEQ + "--oases-schedule overlap"),
        ],
    ),
    # RoPE, GQA, PP=2; three chunks of 6+5+5 positions, two samples each; block recompute
    "llama-tp2-pp2-mbs2-3chunks": (
        4,
        layout(LLAMA, 4, tp=2, pp=2, mbs=2, gbs=4)[1] + " " + BLOCK.format(n=1),
        [("stock", "--oases-schedule off")]
        + [(n, SEQ + "--oases-sub-batches 3 " + f) for n, f in VARIANTS[1:]],
    ),
}


@pytest.mark.timeout(600)
@pytest.mark.parametrize("config", list(SEQ_CONFIGS))
def test_sequence_split_matches_stock(config):
    world, base, variants = SEQ_CONFIGS[config]
    results = run_distributed(variants_worker, world, base + ITERS + NO_DROP, variants, timeout=560)
    for rank, res in enumerate(results):
        for name, _ in variants:
            if name.startswith("stock"):
                continue
            setting = name.partition("-")[2] if name.startswith("overlap-") else ""
            stock = res["stock-" + setting if setting else "stock"]
            assert "oases-schedule" in res[name]["installed"]
            assert_matches(res[name], stock, f"{config} {name} rank {rank}")


@pytest.mark.timeout(600)
def test_fused_cross_entropy_runs_as_megatron_in_one_step(torch_compile):
    """``--cross-entropy-loss-fusion`` (native): the loss is not the unfused vocab-parallel
    cross-entropy the schedule cuts at its collectives (``schedule/megatron/loss.py``), so it runs as
    Megatron's ``compute_language_model_loss`` in one op; loss and gradients still match stock's
    (fused as well)."""
    world, base = CONFIGS["gpt-tp2-pp1-mbs2"]
    fused = "--cross-entropy-loss-fusion --cross-entropy-fusion-impl native "
    variants = [
        ("stock", fused + "--oases-schedule off"),
        ("oases", fused + "--oases-schedule oases"),
    ]
    results = run_distributed(
        variants_worker, world, base + " " + ITERS + NO_DROP + RECOMPUTE, variants, timeout=560
    )
    for rank, res in enumerate(results):
        assert_matches(res["oases"], res["stock"], f"fused cross-entropy rank {rank}")
        assert res["stock"]["compiled_graphs"] > 0  # compiled, as Megatron runs it


@pytest.mark.timeout(300)
def test_uneven_stage_split_matches_stock():
    """Megatron's ``--decoder-first-pipeline-num-layers`` (what ``oases plan --gpus`` may
    choose): stages of 1 and 2 layers, each schedule against stock."""
    base = GPT.format(layers=3) + (
        "--pipeline-model-parallel-size 2 --decoder-first-pipeline-num-layers 1 "
        "--micro-batch-size 2 --global-batch-size 8 "
    )
    results = run_distributed(
        variants_worker, 2, base + ITERS + NO_DROP + RECOMPUTE, VARIANTS, timeout=280
    )
    for rank, res in enumerate(results):
        layers = {name.split(".")[2] for name in res["stock"]["grads"] if ".layers." in name}
        assert len(layers) == rank + 1  # 1 layer on the first stage, 2 on the last
        for name in SPLIT_SCHEDULES:
            assert_matches(res[name], res["stock"], f"uneven {name} rank {rank}")
