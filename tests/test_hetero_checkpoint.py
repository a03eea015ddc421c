"""Checkpoints are layout independent: hetero plan ⇄ uniform TP=T ⇄ another plan."""

import json

import pytest
import torch

from megatron_oases.testing import run_distributed
from megatron_oases.testing.runs import max_rel_diff

BASE = (
    "--num-layers 4 --hidden-size 64 --num-attention-heads 8 --seq-length 16 --vocab-size 500 "
    "--mock-data --hidden-dropout 0 --attention-dropout 0 --lr 1e-2 "
    "--tensor-model-parallel-size 2 --micro-batch-size 4 --global-batch-size 8 "
)


def _worker(ckpt, plan_a, plan_b):
    import torch.distributed as dist

    from megatron_oases import patches
    from megatron_oases.testing.runs import parse
    from megatron_oases.training.checkpointing import read_checkpoint
    from megatron_oases.training.initialize import initialize_distributed
    from megatron_oases.training.loop import Trainer
    from megatron_oases.training.model import full_tensor, global_param_names

    def trainer_for(extra):
        args = parse(BASE + extra, world_size=dist.get_world_size())
        initialize_distributed(args)
        patches.install_from_args(args)
        return Trainer(args)

    out = {}
    # save under plan A after 2 iterations, then continue to get the reference 3rd loss
    tr = trainer_for(f"--oases-plan {plan_a} --oases-schedule oases --recompute-granularity full")
    tr.train_step(), tr.train_step()
    tr.save(ckpt)
    out["plan_a_next"] = tr.train_step()
    patches.uninstall_all()
    _, saved = read_checkpoint(ckpt)
    for name, extra in (
        ("uniform", ""),
        ("plan_b", f"--oases-plan {plan_b}"),
        ("plan_a", f"--oases-plan {plan_a} --oases-schedule oases " "--recompute-granularity full"),
    ):
        tr = trainer_for(extra)
        assert tr.load(ckpt) == 2
        identical = all(
            torch.equal(full_tensor(p.detach(), p, n), saved[n]["param"])
            for n, p in global_param_names(tr.module)
        )
        out[name] = {"identical": identical, "next": tr.train_step()}
        if name == "uniform":  # and back: save under uniform, load under plan B
            tr.save(ckpt + "-u")
        patches.uninstall_all()
    tr = trainer_for(f"--oases-plan {plan_b}")
    tr.load(ckpt + "-u")
    _, saved_u = read_checkpoint(ckpt + "-u")
    out["u_to_b_identical"] = all(
        torch.equal(full_tensor(p.detach(), p, n), saved_u[n]["param"])
        for n, p in global_param_names(tr.module)
    )
    patches.uninstall_all()
    return out


@pytest.mark.timeout(400)
def test_checkpoint_round_trip_hetero_uniform(tmp_path):
    plans = []
    for i, degrees in enumerate(([1, 2, 1, 2], [1, 1, 2, 2])):
        path = tmp_path / f"plan{i}.json"
        path.write_text(
            json.dumps({"version": 1, "tensor_model_parallel_size": 2, "degrees": degrees})
        )
        plans.append(str(path))
    res = run_distributed(_worker, 2, str(tmp_path / "ckpt"), *plans, timeout=380)[-1]
    ref = res["plan_a_next"]
    for name in ("uniform", "plan_b", "plan_a"):
        assert res[name]["identical"], name
        assert max_rel_diff([res[name]["next"]], [ref]) < 1e-5, (name, res[name]["next"], ref)
    assert res["plan_a"]["next"] == ref  # same layout: exact resume
    assert res["u_to_b_identical"]
