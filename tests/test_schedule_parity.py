"""Every Oases schedule against stock Megatron: loss and every parameter gradient (fp32).

Configurations cover TP=2/4, PP=1/2 (1F1B, 4 micro-batches), GPT and LLaMA-style layers (SwiGLU,
RMSNorm, GQA, RoPE, no bias) and micro-batch sizes 2 and 3 (uneven split 2+1), with full/uniform
recomputation on the stock side. Each configuration runs stock and the three schedules in one set
of processes.
"""

import pytest
import torch
from schedule_helpers import GPT, LLAMA, schedules_worker

from megatron_oases.testing import run_distributed
from megatron_oases.testing.runs import max_rel_diff

RECOMPUTE = "--recompute-granularity full --recompute-method uniform --recompute-num-layers 1 "
NO_DROP = "--hidden-dropout 0 --attention-dropout 0 "
VARIANTS = [
    ("stock", "--oases-schedule off"),
    ("overlap", "--oases-schedule overlap"),
    ("cross-pass", "--oases-schedule cross-pass"),
    ("oases", "--oases-schedule oases"),
]

CONFIGS = {
    "gpt-tp2-pp1-mbs2": (
        2,
        GPT.format(layers=2) + "--tensor-model-parallel-size 2 "
        "--micro-batch-size 2 --global-batch-size 4",
    ),
    "llama-tp2-pp1-mbs3": (
        2,
        LLAMA.format(layers=2) + "--tensor-model-parallel-size 2 "
        "--micro-batch-size 3 --global-batch-size 6",
    ),
    "gpt-tp4-pp1-mbs3": (
        4,
        GPT.format(layers=2) + "--tensor-model-parallel-size 4 "
        "--micro-batch-size 3 --global-batch-size 3",
    ),
    "llama-tp2-pp2-mbs2": (
        4,
        LLAMA.format(layers=4) + "--tensor-model-parallel-size 2 "
        "--pipeline-model-parallel-size 2 --micro-batch-size 2 "
        "--global-batch-size 8",
    ),
    "gpt-tp2-pp2-mbs3": (
        4,
        GPT.format(layers=4) + "--tensor-model-parallel-size 2 "
        "--pipeline-model-parallel-size 2 --micro-batch-size 3 "
        "--global-batch-size 12",
    ),
}


@pytest.mark.timeout(400)
@pytest.mark.parametrize("config", list(CONFIGS))
def test_schedules_match_stock(config):
    world, base = CONFIGS[config]
    results = run_distributed(
        schedules_worker, world, base + " " + NO_DROP + RECOMPUTE, VARIANTS, timeout=360
    )
    for rank, res in enumerate(results):
        stock = res["stock"]
        assert stock["installed"] == []
        for name in ("overlap", "cross-pass", "oases"):
            got = res[name]
            assert got["installed"] == ["oases-schedule"]
            if stock["losses"][0] is not None:  # last pipeline stage
                assert max_rel_diff(got["losses"], stock["losses"]) < 1e-5, (name, rank)
            assert set(got["grads"]) == set(stock["grads"]) and stock["grads"]
            for pname, g in stock["grads"].items():
                assert torch.count_nonzero(g) > 0 or "bias" in pname, pname
                err = max_rel_diff(got["grads"][pname], g)
                assert err < 1e-5, f"{config} {name} rank {rank} {pname}: rel err {err:.2e}"
