"""Megatron's interleaved 1F1B pipeline (virtual pipeline stages: several model chunks per rank)
under every schedule, against stock Megatron with the same virtual-stage flags: loss and every
gradient, fp32, dropout 0.

One 4-rank job (PP=2 × TP=2, micro-batch 4, four micro-batches, two iterations), its variants one
after another:

* GPT, 4 layers, ``--num-layers-per-virtual-pipeline-stage 1`` (two chunks per rank, one layer
  each: rank 0's chunks hold the embedding + layer 0 and layer 2, rank 1's layer 1 and layer 3 +
  the output layer and loss, so each end of the model sits in one chunk of a rank that also has a
  middle chunk): stock, then ``overlap``, ``cross-pass``, ``oases`` with full recomputation;
* a per-layer plan with differing degrees (``[1, 2, 1, 2]``) under ``off`` and ``oases``, against
  the same stock run (gradients all-gathered to full tensors, so layouts compare);
* ``HybridModel`` with four ``|`` segments (Megatron derives two virtual stages per rank from the
  pattern): stock and ``oases``.

Before the fix the stock variant died in iteration 1 on rank 0's middle chunk (``forward_step``
read ``vp_stage`` on the DDP wrapper, got None and took the chunk for a first stage that reads
data), and a plan under interleaving trained a different model (rebuilding a chunk's layers
shifted Megatron's RNG for the chunks built after it).
"""

import pytest
from helpers import GPT, LLAMA, NO_DROP, RECOMPUTE, SHAPE, variants_worker
from helpers.plans import write_plan
from helpers.runs import assert_matches, assert_schedules_match_stock
from helpers.variants import ITERS, SCHEDULE_VARIANTS

from megatron_oases.launch import run_distributed

WORLD = 4
#: What every variant shares: TP=2 × PP=2, four micro-batches of 4 (a degree-1 layer of the plan
#: takes 2 samples, split again into two sub-batches), two iterations.
BASE = (
    "--tensor-model-parallel-size 2 --pipeline-model-parallel-size 2 --micro-batch-size 4 "
    "--global-batch-size 16 " + ITERS + NO_DROP + RECOMPUTE
)
GPT_VP = GPT.format(layers=4) + "--num-layers-per-virtual-pipeline-stage 1 "
#: Four pipeline segments on two stages: Megatron makes them two virtual stages per rank.
HYBRID_VP = (
    "--hybrid-layer-pattern '*-|*-|*-|*-' "
    + SHAPE
    + LLAMA.replace("--num-layers {layers} " + SHAPE, "")
)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    plan = write_plan(str(tmp_path_factory.mktemp("plan") / "plan.json"), 2, [1, 2, 1, 2])
    variants = [(name, GPT_VP + flags) for name, flags in SCHEDULE_VARIANTS]
    variants += [
        (f"plan-{s}", GPT_VP + f"--oases-plan {plan} --oases-schedule {s}")
        for s in ("off", "oases")
    ]
    variants += [
        ("hybrid-stock", HYBRID_VP + "--oases-schedule off"),
        ("hybrid-oases", HYBRID_VP + "--oases-schedule oases"),
    ]
    # gradients all-gathered to full tensors: a plan's degree-1 layers hold them unsharded
    return run_distributed(variants_worker, WORLD, BASE, variants, "full", timeout=540)


@pytest.mark.timeout(600)
def test_interleaved_schedules_match_stock(runs):
    for rank, res in enumerate(runs):
        layers = {name.split(".")[2] for name in res["stock"]["grads"] if ".layers." in name}
        assert layers == ({"0", "2"} if rank < 2 else {"1", "3"}), layers  # two chunks a rank
        if rank >= 2:  # the last stage: the loss went down
            assert res["stock"]["losses"][1] < res["stock"]["losses"][0]
    assert_schedules_match_stock(runs, "interleaved GPT PP2xTP2")


@pytest.mark.timeout(600)
def test_interleaved_per_layer_plan_matches_stock(runs):
    for rank, res in enumerate(runs):
        for name in ("plan-off", "plan-oases"):
            assert res[name]["installed"] == ["oases-schedule"]
            assert_matches(res[name], res["stock"], f"interleaved {name} rank {rank}")


@pytest.mark.timeout(600)
def test_interleaved_hybrid_model_matches_stock(runs):
    for rank, res in enumerate(runs):
        stock, got = res["hybrid-stock"], res["hybrid-oases"]
        layers = {name.split(".")[2] for name in stock["grads"] if ".layers." in name}
        assert layers == ({"0", "1", "4", "5"} if rank < 2 else {"2", "3", "6", "7"}), layers
        assert stock["installed"] == [] and got["installed"] == ["oases-schedule"]
        assert_matches(got, stock, f"interleaved hybrid rank {rank}")
