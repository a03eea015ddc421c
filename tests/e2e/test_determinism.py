"""Determinism: the same seed gives bit-identical losses run to run, on every schedule and under a
per-layer plan, with dropout on (the schedules replay dropout masks in recomputation from saved RNG
states: a slip there shows up here as a different loss).

One spawned 2-rank job runs every variant twice, one after another, in Megatron-LM's own loop;
losses are compared with ``==``. A run with another seed must differ, which shows that dropout (and
so the RNG) is really in play.
"""

import json

import pytest
from helpers import GPT, RECOMPUTE
from helpers.runs import pretrain_and_capture

from megatron_oases.launch import run_distributed

BASE = (
    GPT.format(layers=2) + "--tensor-model-parallel-size 2 --micro-batch-size 4 "
    "--global-batch-size 8 --train-iters 3 --hidden-dropout 0.1 --attention-dropout 0.1 "
)


def _variants(plan):
    return [
        ("off", "--oases-schedule off"),
        ("overlap", "--oases-schedule overlap"),
        ("cross-pass", f"--oases-schedule cross-pass {RECOMPUTE}"),
        ("oases", f"--oases-schedule oases {RECOMPUTE}"),
        ("plan-oases", f"--oases-schedule oases {RECOMPUTE} --oases-plan {plan}"),
    ]


def _twice_worker(base, variants):
    out = {}
    for name, extra in variants:
        out[name] = [pretrain_and_capture(f"{base} {extra}")["losses"] for _ in range(2)]
    out["other-seed"] = pretrain_and_capture(f"{base} --oases-schedule off --seed 4321")["losses"]
    return out


@pytest.mark.timeout(600)
def test_same_seed_gives_bit_identical_losses(tmp_path):
    plan = tmp_path / "plan.json"
    plan.write_text(json.dumps({"version": 1, "tensor_model_parallel_size": 2, "degrees": [1, 2]}))
    res = run_distributed(_twice_worker, 2, BASE, _variants(plan), timeout=560)[-1]
    other = res.pop("other-seed")
    for name, (first, second) in res.items():
        assert len(first) == 3 and None not in first, (name, first)
        print(f"{name}: {first} / {second}")
        assert first == second, f"{name}: run to run {first} != {second}"
    assert other != res["off"][0], "another seed gave the same losses: is dropout on?"
