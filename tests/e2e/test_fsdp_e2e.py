"""Megatron's sharded data parallelism in the test bed: torch FSDP2 (``--use-torch-fsdp2``) on gloo
ranks against stock Megatron's DDP with the same flags, in Megatron-LM's own ``pretrain()``.

FSDP2 shards every parameter, gradient and optimizer state over the data-parallel ranks; the
arithmetic of a step is DDP's (the gradient reduce-scatter is the all-reduce's average, split), so
losses and every gradient (gathered to its full tensor) agree to fp32 rounding. Runs on the CPU
through one shim (``platform/cpu.py``: the data-parallel group's device mesh on ``cpu``).

Matrix (tiny GPT with an untied output layer, as FSDP2 requires; 2 iterations):

* DP=2 (2 ranks): fp32 with dropout off and on (same seed: the same masks), full recomputation,
  and ``--bf16``;
* TP=2 × DP=2 (4 ranks), fp32: FSDP2 shards each tensor-parallel shard over DP.

And: the emulated link (``--emulate-link``) dilates FSDP2's all-gathers and reduce-scatters on the
data-parallel group.
"""

import pytest
from helpers import DROP, GPT, NO_DROP, RECOMPUTE
from helpers.runs import assert_matches, variants_worker
from helpers.variants import layout

from megatron_oases.launch import run_distributed

pytestmark = pytest.mark.slow

FSDP2 = "--use-torch-fsdp2 "
UNTIED = "--untie-embeddings-and-output-weights --train-iters 2 "
DP2 = layout(GPT, 2, tp=1, mbs=2, gbs=8)[1] + " " + UNTIED
TP2_DP2 = layout(GPT, 2, tp=2, mbs=2, gbs=8)[1] + " " + UNTIED + NO_DROP

DP2_VARIANTS = [
    ("ddp", NO_DROP),
    ("fsdp2", NO_DROP + FSDP2),
    ("ddp-dropout", DROP),
    ("fsdp2-dropout", DROP + FSDP2),
    ("ddp-recompute", NO_DROP + RECOMPUTE),
    ("fsdp2-recompute", NO_DROP + RECOMPUTE + FSDP2),
    ("ddp-bf16", NO_DROP + "--bf16"),
    ("fsdp2-bf16", NO_DROP + "--bf16 " + FSDP2),
]
#: bf16 keeps fp32 gradients under DDP but reduces them in bf16 under FSDP2: a few bf16 ulps.
TOL = {"": 1e-5, "-dropout": 1e-5, "-recompute": 1e-5, "-bf16": 2e-2}


def _pairs(results, suffixes):
    worst = {}
    for rank, res in enumerate(results):
        for suffix in suffixes:
            ref, got = res[f"ddp{suffix}"], res[f"fsdp2{suffix}"]
            assert got["installed"] == [] and len(got["losses"]) == 2
            what = f"fsdp2{suffix} rank {rank}"
            worst[suffix] = max(worst.get(suffix, 0.0), assert_matches(got, ref, what, TOL[suffix]))
    return worst


def test_torch_fsdp2_matches_ddp_dp2():
    results = run_distributed(variants_worker, 2, DP2, DP2_VARIANTS, timeout=600)
    worst = _pairs(results, TOL)
    print("FSDP2 vs DDP, DP=2, worst relative difference:", worst)


def test_torch_fsdp2_matches_ddp_tp2_dp2():
    variants = [("ddp", ""), ("fsdp2", FSDP2)]
    results = run_distributed(variants_worker, 4, TP2_DP2, variants, timeout=600)
    worst = _pairs(results, [""])
    print("FSDP2 vs DDP, TP=2 x DP=2, worst relative difference:", worst)


def _emulated_fsdp2_ops(argv):
    """One FSDP2 job under ``--emulate-link``: the emulator's records of its first step."""
    from helpers.runs import prepared
    from megatron.training import training

    from megatron_oases.patching import REGISTRY, Patch
    from megatron_oases.training.pretrain import run_in_process

    original, seen = training.train_step, []

    def train_step(*args, **kwargs):
        out = original(*args, **kwargs)
        if not seen:
            seen.extend(dict(r) for r in REGISTRY.get("emulate-link").emulator.records)
        return out

    run_in_process(
        prepared(argv),
        extra_patches=[Patch("test-records", [(training, "train_step", train_step)])],
    )
    return seen


def test_emulated_link_dilates_fsdp2_collectives(monkeypatch):
    """Every all-gather FSDP2 issues before a layer's forward and backward and every gradient
    reduce-scatter after it goes through the emulated link of the data-parallel group (ranks 0
    and 1: one node, the intra-node link of the cluster profile) and completes no earlier than
    D x its modelled time."""
    monkeypatch.setenv("OASES_EMULATE_DILATION", "50")
    argv = DP2 + NO_DROP + FSDP2 + "--emulate-link rtx3090-pcie --train-iters 1"
    ranks = run_distributed(_emulated_fsdp2_ops, 2, argv, timeout=600)
    for records in ranks:
        by_op = {}
        for r in records:
            by_op.setdefault(r["op"], []).append(r)
        gathers = by_op.get("all_gather_single", [])
        scatters = by_op.get("reduce_scatter_single", [])
        # 2 layers + the embedding and output layer, gathered in forward and again in backward
        assert len(gathers) >= 4 and len(scatters) >= 2, sorted(by_op)
        for r in gathers + scatters:
            assert r["ranks"] == [0, 1] and r["emulated_s"] == pytest.approx(50 * r["model_s"])
            assert r["done_at"] - r["start"] == pytest.approx(r["emulated_s"], rel=1e-6)
            if r["returned"] is not None:  # a synchronous op: blocked until its emulated end
                assert r["returned"] >= r["done_at"]
