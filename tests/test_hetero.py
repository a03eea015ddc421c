"""Per-layer heterogeneous TMP: plans against uniform TP=T (loss and full gradients), with
``--oases-schedule off`` and ``oases``, PP=1 and PP=2; invalid plans."""

import json

import pytest
from helpers import BLOCK, NO_DROP, RECOMPUTE, SHAPE
from helpers.runs import max_rel_diff, parse, pretrain_and_capture

from megatron_oases.errors import OasesConfigError
from megatron_oases.launch import run_distributed

BASE = SHAPE + NO_DROP + "--train-iters 2 " + RECOMPUTE


def write_plan(path, T, degrees):
    with open(path, "w") as f:
        json.dump({"version": 1, "tensor_model_parallel_size": T, "degrees": degrees}, f)
    return path


def _worker(base, variants):
    out = {}
    for name, extra in variants:
        r = pretrain_and_capture(base + " " + extra, grads="full")
        out[name] = {"losses": r["losses"], "grads": r["grads"]}
    return out


CASES = {
    "T2-pp1": (
        2,
        4,
        "--tensor-model-parallel-size 2 --micro-batch-size 4 --global-batch-size 8",
        [[1, 2, 1, 2], [1, 1, 2, 2]],
    ),
    "T2-pp2": (
        4,
        4,
        "--tensor-model-parallel-size 2 --pipeline-model-parallel-size 2 "
        "--micro-batch-size 4 --global-batch-size 16",
        [[1, 2, 1, 2], [1, 1, 2, 2]],
    ),
    "T4-pp1": (
        4,
        4,
        "--tensor-model-parallel-size 4 --micro-batch-size 4 --global-batch-size 4",
        [[2, 4, 4, 2]],
    ),
}


@pytest.mark.timeout(500)
@pytest.mark.parametrize("case", list(CASES))
def test_plans_match_uniform(case, tmp_path):
    world, layers, flags, plans = CASES[case]
    T = int(flags.split()[1])
    base = BASE + f"--num-layers {layers} " + flags
    variants = [("uniform", "--oases-schedule off")]
    for i, degrees in enumerate(plans):
        path = write_plan(str(tmp_path / f"plan{i}.json"), T, degrees)
        for sched in ("off", "oases"):
            variants.append((f"{degrees}-{sched}", f"--oases-plan {path} --oases-schedule {sched}"))
    results = run_distributed(_worker, world, base, variants, timeout=460)
    for rank, res in enumerate(results):
        ref = res["uniform"]
        for name, got in res.items():
            if ref["losses"][0] is not None:
                assert max_rel_diff(got["losses"], ref["losses"]) < 1e-5, (name, rank)
            assert set(got["grads"]) == set(ref["grads"])
            for p, g in ref["grads"].items():
                err = max_rel_diff(got["grads"][p], g)
                assert err < 1e-5, f"{case} {name} rank {rank} {p}: {err:.2e}"


@pytest.mark.timeout(500)
def test_plans_with_block_recompute_match_uniform(tmp_path):
    """``--recompute-method block --recompute-num-layers 3`` with degree runs [0, 1] and [2, 3]:
    the first run recomputes both its layers, the second its first only (layer 3 keeps its
    graph), stock (``off``) and ``oases`` alike."""
    base = SHAPE + NO_DROP + "--train-iters 2 " + BLOCK.format(n=3) + "--num-layers 4 "
    base += "--tensor-model-parallel-size 2 --micro-batch-size 4 --global-batch-size 8"
    path = write_plan(str(tmp_path / "plan.json"), 2, [1, 1, 2, 2])
    variants = [("uniform", "--oases-schedule off")]
    variants += [(s, f"--oases-plan {path} --oases-schedule {s}") for s in ("off", "oases")]
    for rank, res in enumerate(run_distributed(_worker, 2, base, variants, timeout=460)):
        ref = res["uniform"]
        for name, got in res.items():
            assert max_rel_diff(got["losses"], ref["losses"]) < 1e-5, (name, rank)
            for p, g in ref["grads"].items():
                err = max_rel_diff(got["grads"][p], g)
                assert err < 1e-5, f"block {name} rank {rank} {p}: {err:.2e}"


@pytest.mark.parametrize(
    "degrees,T,flags,match",
    [
        ([1, 2], 2, "", "degrees has 2 entries but the model has 4 layers"),
        ([1, 2, 3, 2], 2, "", "degree 3 is not a power of two"),
        ([1, 2, 4, 2], 2, "", "degree 4 exceeds tensor_model_parallel_size 2"),
        ([1, 2, 1, 2], 4, "", "plan is for a TMP domain of 4"),
        ([1, 1, 1, 1], 2, "--micro-batch-size 3 --global-batch-size 6", "not divisible by 2"),
        (
            [1, 1, 1, 1],
            2,
            "--micro-batch-size 2 --global-batch-size 4 --oases-schedule overlap",
            "cannot be split into two sub-batches",
        ),
    ],
)
def test_invalid_plans_are_rejected(tmp_path, degrees, T, flags, match):
    path = write_plan(str(tmp_path / "p.json"), T, degrees)
    argv = (
        BASE + "--num-layers 4 --tensor-model-parallel-size 2 --micro-batch-size 4 "
        f"--global-batch-size 8 {flags} --oases-plan {path}"
    )
    with pytest.raises(OasesConfigError, match=match):
        parse(argv, world_size=2)


def test_replica_grad_runs_are_in_place_views():
    """The replica gradient sync reduces views of the gradient buffer, never a flattened copy."""
    import torch

    from megatron_oases.hetero.model import _contiguous_runs

    buf = torch.arange(12.0)
    grads = [buf[3:5].view(1, 2), buf[0:3], buf[6:10].view(2, 2), buf[10:12]]
    runs = _contiguous_runs(grads)
    assert [(r.storage_offset(), r.numel()) for r in runs] == [(0, 5), (6, 6)]
    assert all(r.untyped_storage().data_ptr() == buf.untyped_storage().data_ptr() for r in runs)
    runs[1].mul_(2)
    assert buf[6:12].tolist() == [12.0, 14.0, 16.0, 18.0, 20.0, 22.0] and buf[5] == 5
    other = torch.zeros(4)[::2]  # not contiguous: reduced on its own
    assert _contiguous_runs([other])[0] is other
