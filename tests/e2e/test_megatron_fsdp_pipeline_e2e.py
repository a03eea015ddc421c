"""Issue 61.1 and 61.3 with pipeline stages: Megatron-FSDP (``--use-megatron-fsdp``) at PP=2 x
DP=2 on 4 gloo ranks, in Megatron-LM's own ``pretrain()`` (1F1B over four micro-batches a rank),
through the ``megatron-fsdp-pipeline`` patch (``platform/megatron_fsdp_pipeline.py``: its mesh
from the groups, each stage's output handed to the pipeline as no view).

* stock: each strategy against stock DDP with the same flags (fp32, dropout off; tied embeddings,
  so the first and last stages' embedding gradients are summed across the stages);
* the split schedules (overlap, cross-pass, oases, full recomputation) under ``optim_grads_params``
  against stock Megatron-FSDP: fp32 dropout off; with dropout against overlap; bf16 against stock
  bf16;
* each stage's output is freed after its send: the patch hands the pipeline no view.

Tolerances as ``test_megatron_fsdp_e2e.py`` and ``test_megatron_fsdp_split_e2e.py``.
"""

import pytest
import torch
from helpers import DROP, GPT, NO_DROP, RECOMPUTE
from helpers.runs import (
    assert_matches,
    assert_split_schedules_agree_with_dropout,
    split_bf16_worst,
    variants_worker,
)
from helpers.variants import layout

from megatron_oases.launch import run_distributed
from megatron_oases.validation import SPLIT_SCHEDULES

pytestmark = pytest.mark.slow

MFSDP = "--use-megatron-fsdp --ckpt-format fsdp_dtensor --data-parallel-sharding-strategy "
OGP = MFSDP + "optim_grads_params "
STRATEGIES = ("optim_grads_params", "optim_grads", "optim", "no_shard")
PP2_DP2 = layout(GPT, 2, tp=1, pp=2, mbs=2, gbs=16)[1] + " --train-iters 2 "
#: fp32 stock against DDP: one rounding of the reduction; split against stock: the sub-batches'
#: two partial sums where stock has one.
FP32_STOCK, FP32_SPLIT = 1e-6, 1e-5
U = 2.0**-8
BF16_GRADS, BF16_LOSS = 9 * U, 2.0**-10
INSTALLED = ["megatron-fsdp-cpu", "megatron-fsdp-pipeline", "distopt-resume"]

VARIANTS = (
    [("ddp", NO_DROP)]
    + [(s, NO_DROP + MFSDP + s) for s in STRATEGIES]
    + [("stock-recompute", NO_DROP + RECOMPUTE + OGP)]
    + [(s, NO_DROP + RECOMPUTE + OGP + f"--oases-schedule {s}") for s in SPLIT_SCHEDULES]
    + [(f"{s}-drop", DROP + RECOMPUTE + OGP + f"--oases-schedule {s}") for s in SPLIT_SCHEDULES]
    + [("stock-bf16", NO_DROP + RECOMPUTE + OGP + "--bf16")]
    + [
        (f"{s}-bf16", NO_DROP + RECOMPUTE + OGP + f"--bf16 --oases-schedule {s}")
        for s in SPLIT_SCHEDULES
    ]
)


#: The last stage's copy of the tied embedding: Megatron-FSDP names it after the output layer,
#: DDP after the embedding (one tensor, the same gradient).
TIED = {"output_layer.weight": "embedding.word_embeddings.weight"}


def _named_as_ddp(run):
    """``run`` with its tied weight's gradient under DDP's name."""
    return {**run, "grads": {TIED.get(n, n): g for n, g in run["grads"].items()}}


def _freed_outputs(base, variants):
    """The variants, with a record of each tensor Megatron's pipeline deallocates: whether it
    was a view and whether its storage is gone after (its data one element)."""
    from megatron.core.pipeline_parallel import schedules

    from megatron_oases.patching import Patch

    original, freed = schedules.deallocate_output_tensor, []

    def recording(out, deallocate_pipeline_outputs=False):
        original(out, deallocate_pipeline_outputs)
        if deallocate_pipeline_outputs and out is not None and hasattr(out, "_base"):
            freed.append((out._base is None, out.numel() == 1))

    patch = Patch("test-freed-outputs", [(schedules, "deallocate_output_tensor", recording)])
    patch.install()
    try:
        results = variants_worker(base, variants)
    finally:
        patch.uninstall()
    results["freed"] = freed
    return results


@pytest.fixture(scope="module")
def runs():
    return run_distributed(_freed_outputs, 4, PP2_DP2, VARIANTS, timeout=900)


@pytest.mark.timeout(960)
def test_each_strategy_matches_ddp_pp2_dp2(runs):
    worst = {}
    for rank, res in enumerate(runs):
        ref = res["ddp"]
        assert ref["installed"] == [] and len(ref["losses"]) == 2 and ref["grads"]
        for strategy in STRATEGIES:
            got, what = res[strategy], f"{strategy} rank {rank}"
            assert got["installed"] == INSTALLED, what
            assert len(got["losses"]) == 2, what
            matched = assert_matches(_named_as_ddp(got), ref, what, FP32_STOCK)
            worst[strategy] = max(worst.get(strategy, 0.0), matched)
        if ref["losses"][0] is not None:  # the last stage: the tied copy's summed gradient
            assert "embedding.word_embeddings.weight" in ref["grads"]
    print("Megatron-FSDP vs DDP, PP=2 x DP=2, fp32, worst relative difference:", worst)


@pytest.mark.timeout(960)
def test_split_schedules_match_stock_megatron_fsdp_pp2_dp2(runs):
    worst = {}
    for rank, res in enumerate(runs):
        stock = res["stock-recompute"]
        for name in SPLIT_SCHEDULES:
            got = res[name]
            assert got["installed"][-1] == "oases-schedule", name
            assert len(got["losses"]) == 2, name
            worst[name] = max(
                worst.get(name, 0.0),
                assert_matches(got, stock, f"{name} rank {rank}", FP32_SPLIT),
            )
    print("split schedules vs stock Megatron-FSDP, PP2 x DP2, fp32, worst difference:", worst)


@pytest.mark.timeout(960)
def test_split_schedules_agree_with_dropout_pp2_dp2(runs):
    assert_split_schedules_agree_with_dropout(runs, "overlap", FP32_SPLIT)


@pytest.mark.timeout(960)
def test_split_schedules_bf16_match_stock_pp2_dp2(runs):
    worst = split_bf16_worst(runs, SPLIT_SCHEDULES, BF16_LOSS, BF16_GRADS)
    print(
        f"split schedules vs stock Megatron-FSDP, PP2, bf16: worst gradient difference {worst:.2e}"
    )


def test_stage_outputs_are_freed(runs):
    """Ranks of the first stage send their outputs; each one Megatron deallocates was no view and
    its data is gone after (what stock DDP's pipeline gets)."""
    first_stage = [res["freed"] for res in runs if res["freed"]]
    assert first_stage, "no stage output was deallocated"
    for freed in first_stage:
        assert all(no_view and gone for no_view, gone in freed), freed


def _sum_misaligned(_argv):
    """Two 2-rank "stages" (ranks 0-1, 2-3) each holding an 8 x 3 gradient row-sharded over
    their data-parallel pair, the first stage as rows 0-2 / 3-7, the second as 0-4 / 5-7; the
    embedding groups pair rank i of one stage with rank i of the other. Returns this rank's local
    rows after :func:`sum_sharded_grad` and the expected ones."""
    from types import SimpleNamespace

    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import DTensor, Shard

    from megatron_oases.platform.megatron_fsdp_pipeline import sum_sharded_grad

    rank = dist.get_rank()
    stage, index = divmod(rank, 2)
    dp_groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    embd_groups = [dist.new_group([0, 2]), dist.new_group([1, 3])]
    mesh = DeviceMesh.from_group(dp_groups[stage], "cpu", mesh=[2 * stage, 2 * stage + 1])
    whole = [torch.arange(24.0).reshape(8, 3) * (s + 1) for s in (0, 1)]
    cut = (3, 5)[stage]
    rows = slice(0, cut) if index == 0 else slice(cut, 8)
    local = whole[stage][rows].clone()
    grad = DTensor.from_local(local, mesh, [Shard(0)], run_check=False, shape=(8, 3), stride=(3, 1))
    sum_sharded_grad(SimpleNamespace(grad=grad), embd_groups[index])
    return local, (whole[0] + whole[1])[rows]


@pytest.mark.timeout(300)
def test_tied_gradient_sum_where_the_stages_shard_it_differently():
    """The tied embedding's gradient summed over the embedding group where each stage's shards
    cover other rows (the whole gradient gathered, summed, this rank's rows kept); in the runs
    above the stages' shards coincide and the shards are summed as they are."""
    for got, expected in run_distributed(_sum_misaligned, 4, "", timeout=240):
        assert torch.equal(got, expected)
