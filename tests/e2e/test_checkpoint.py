"""Megatron's own checkpoints (``--save/--load``, torch_dist) under the Oases schedules, in
Megatron-LM's loop: exact resume across schedules and TP layouts, the distributed optimizer's
resume bit for bit at the right Adam step, a different model refused with one line, an interrupted
save that leaves the previous checkpoint loadable, NaN stopping the run. Every resume is compared
over two iterations after the load: the first depends only on the loaded parameters, the second on
the loaded optimizer state too."""

import os
import re

import pytest
from helpers import GPT, NO_DROP, RECOMPUTE
from helpers.runs import max_rel_diff, pretrain_and_capture

from megatron_oases.launch import run_distributed

BASE = GPT.format(layers=2) + "--micro-batch-size 2 --global-batch-size 4 " + NO_DROP + RECOMPUTE
TP2 = "--tensor-model-parallel-size 2 "


def _round_trip_worker(base, ckpt):
    """Iterations 1-2 under one schedule (saved at 2 by --exit-interval), 3-4 after loading (the
    second of them depends on the loaded optimizer state too)."""
    out = {"reference": pretrain_and_capture(f"{base} {TP2} --train-iters 4 --oases-schedule off")}
    for saver, loader, layout in (
        ("oases", "off", TP2),  # saved by a schedule, loaded by stock Megatron
        ("off", "cross-pass", TP2),  # saved by stock, loaded by a schedule
        ("overlap", "oases", "--tensor-model-parallel-size 1"),  # another TP layout (DP=2)
    ):
        path = os.path.join(ckpt, f"{saver}-{loader}")
        save = pretrain_and_capture(
            f"{base} {TP2} --train-iters 4 --exit-interval 2 --save {path} "
            f"--oases-schedule {saver}"
        )
        load = pretrain_and_capture(
            f"{base} {layout} --train-iters 4 --load {path} --oases-schedule {loader}"
        )
        out[f"{saver}->{loader}"] = {"save": save, "load": load, "files": sorted(os.listdir(path))}
    return out


@pytest.mark.timeout(600)
def test_resume_across_schedules_and_layouts(tmp_path):
    res = run_distributed(_round_trip_worker, 2, BASE, str(tmp_path), timeout=560)[-1]
    ref = res.pop("reference")["losses"]
    assert len(ref) == 4
    for name, r in res.items():
        assert r["save"]["exit_code"] == 0 and r["save"]["losses"] == ref[:2], name
        assert "latest_checkpointed_iteration.txt" in r["files"] and "iter_0000002" in r["files"]
        assert len(r["load"]["losses"]) == 2, name  # resumed at iteration 3, then 4
        err = max_rel_diff(r["load"]["losses"], ref[2:])
        print(f"{name}: losses 3-4 {r['load']['losses']} vs {ref[2:]} (rel {err:.1e})")
        assert err < 1e-5, name


def _distributed_optimizer_worker(base, ckpt):
    """``--use-distributed-optimizer`` (torch's Adam here: no Apex, no TE): uninterrupted to
    iteration 4, and saved at 2 by ``--exit-interval`` then resumed to 4; both save iteration 4
    (``--save`` saves at the end)."""
    run = f"{base} --use-distributed-optimizer --train-iters 4"
    full, resumed = os.path.join(ckpt, "full"), os.path.join(ckpt, "resumed")
    return {
        "full": pretrain_and_capture(f"{run} --save {full}"),
        "save": pretrain_and_capture(f"{run} --exit-interval 2 --save {resumed}"),
        "load": pretrain_and_capture(f"{run} --load {resumed} --save {resumed}"),
    }


def _saved_adam_steps(iteration_dir):
    """Every Adam ``step`` that a torch_dist checkpoint of the distributed optimizer holds: the
    param groups of its ``optimizer.distributed.dp_group_idx_<i>.optimizer`` objects (one per
    data-parallel group), read with torch's own checkpoint reader."""
    import io

    import torch.distributed.checkpoint as dcp

    reader = dcp.FileSystemReader(str(iteration_dir))
    names = list(reader.read_metadata().state_dict_metadata)
    keys = [
        k
        for k in names
        if re.fullmatch(r"optimizer\.distributed\.dp_group_idx_\d+\.optimizer/.+", k)
    ]
    assert keys, names
    objects = {k: io.BytesIO() for k in keys}
    dcp.load(objects, storage_reader=reader, no_dist=True)
    steps = []
    for value in objects.values():
        for state in value if isinstance(value, list) else [value]:
            steps += [group["step"] for group in state["param_groups"]]
    return steps


#: (ranks, flags): stock TP1 x DP2, and a split schedule at TP2 x DP2.
DISTOPT_RUNS = {
    "off": (2, "--tensor-model-parallel-size 1 --oases-schedule off"),
    "oases": (4, TP2 + "--oases-schedule oases"),
}


@pytest.mark.timeout(600)
@pytest.mark.parametrize("schedule", list(DISTOPT_RUNS))
def test_distributed_optimizer_resumes_bit_for_bit_at_the_right_adam_step(tmp_path, schedule):
    """Without Apex/TE the load stopped on a bare ``AssertionError`` per rank after the model
    build (Megatron's ``DistributedOptimizer.state_dict``), then in fp32 on an in-place copy into
    a leaf; once it ran, every parameter's state shared one Adam ``step``, reset to 0 and counted
    once per parameter (the checkpoint of iteration 4 stored 36): iteration 3 equal, 4 not. The
    ``distopt-resume`` patch (megatron_oases/platform/distopt_resume.py) fixes the three; two
    iterations after the load are compared, bit for bit, and the saved steps."""
    world, flags = DISTOPT_RUNS[schedule]
    results = run_distributed(
        _distributed_optimizer_worker, world, f"{BASE} {flags}", str(tmp_path), timeout=560
    )
    for rank, r in enumerate(results):
        full, save, load = r["full"]["losses"], r["save"]["losses"], r["load"]["losses"]
        assert "distopt-resume" in r["load"]["installed"], r["load"]["installed"]
        assert ("oases-schedule" in r["load"]["installed"]) == (schedule != "off")
        assert len(full) == 4 and save == full[:2], (rank, save, full)
        # iterations 3 and 4 after the load: the second depends on Adam's state and step
        assert len(load) == 2 and load == full[2:], (rank, load, full)
    for run, iteration in (("full", 4), ("resumed", 2), ("resumed", 4)):
        steps = _saved_adam_steps(tmp_path / run / f"iter_{iteration:07d}")
        assert steps and set(steps) == {float(iteration)}, (run, iteration, steps)


def _refuse_worker(base, ckpt):
    from megatron_oases.errors import OasesConfigError

    pretrain_and_capture(f"{base} {TP2} --train-iters 2 --save {ckpt} --oases-schedule oases")
    other = base.replace("--num-layers 2", "--num-layers 4")
    try:
        pretrain_and_capture(f"{other} {TP2} --train-iters 3 --load {ckpt}")
    except (OasesConfigError, AssertionError) as exc:
        return str(exc)
    return None


@pytest.mark.timeout(300)
def test_checkpoint_of_another_model_is_refused(tmp_path):
    msg = run_distributed(_refuse_worker, 2, BASE, str(tmp_path / "ck"), timeout=280)[0]
    assert msg and "num_layers" in msg and "another model" in msg, msg


def _interrupted_save_worker(base, ckpt):
    """A save that dies half-way (after writing some files) leaves the tracker on the old one; the
    run stops with one line naming it (``TrainingStopped``)."""
    from megatron.core import dist_checkpointing
    from megatron.training import checkpointing

    from megatron_oases.errors import TrainingStopped

    first = pretrain_and_capture(
        f"{base} {TP2} --train-iters 3 --exit-interval 1 --save {ckpt} --oases-schedule oases"
    )
    real_save = dist_checkpointing.save

    def dying_save(sharded_state_dict, checkpoint_dir, *args, **kwargs):
        os.makedirs(checkpoint_dir, exist_ok=True)
        with open(os.path.join(checkpoint_dir, "partial"), "w") as f:
            f.write("half a checkpoint")
        raise OSError("No space left on device")

    checkpointing.dist_checkpointing.save = dying_save
    try:
        try:
            pretrain_and_capture(
                f"{base} {TP2} --train-iters 3 --exit-interval 2 --save {ckpt} --load {ckpt} "
                "--oases-schedule oases"
            )
            died = None
        except TrainingStopped as exc:
            died = str(exc)
    finally:
        checkpointing.dist_checkpointing.save = real_save
    with open(os.path.join(ckpt, "latest_checkpointed_iteration.txt")) as f:
        tracker = f.read().strip()
    died = (died, sorted(os.listdir(ckpt)))
    resumed = pretrain_and_capture(f"{base} {TP2} --train-iters 3 --load {ckpt}")
    full = pretrain_and_capture(f"{base} {TP2} --train-iters 3")
    return {"first": first, "died": died, "tracker": tracker, "resumed": resumed, "full": full}


@pytest.mark.timeout(400)
def test_interrupted_save_keeps_the_previous_checkpoint(tmp_path):
    r = run_distributed(_interrupted_save_worker, 2, BASE, str(tmp_path / "ck"), timeout=380)[-1]
    message, files = r["died"]
    assert "saving iter_0000002" in message and "No space left on device" in message, message
    assert "the previous checkpoint (iteration 1) is intact" in message
    assert r["tracker"] == "1" and "iter_0000001" in files
    assert len(r["resumed"]["losses"]) == 2  # iterations 2 and 3 from the iteration-1 checkpoint
    assert max_rel_diff(r["resumed"]["losses"], r["full"]["losses"][1:]) < 1e-5


def _nan_worker(base):
    try:
        pretrain_and_capture(f"{base} {TP2} --train-iters 8 --lr 1e6")
    except RuntimeError as exc:
        return str(exc)
    return None


@pytest.mark.timeout(300)
def test_nan_loss_stops_the_run(tmp_path):
    msg = run_distributed(_nan_worker, 2, BASE, timeout=280)[0]
    assert msg and "found NaN in local forward loss calculation" in msg, msg


def _plan_worker(base, ckpt, plan_a, plan_b):
    """A plan's checkpoint is a stock checkpoint: stock, TP=1 and another plan resume from it;
    a stock checkpoint resumes under a plan. Saved at 2, two iterations after each load."""
    tp2 = f"{base} {TP2} --train-iters 4"
    out = {"reference": pretrain_and_capture(f"{tp2} --oases-schedule off")["losses"]}
    saved = os.path.join(ckpt, "plan")
    out["save"] = pretrain_and_capture(
        f"{tp2} --exit-interval 2 --save {saved} --oases-schedule oases --oases-plan {plan_a}"
    )["losses"]
    for name, flags in (
        ("stock", f"{tp2} --oases-schedule off"),
        ("tp1", f"{base} --tensor-model-parallel-size 1 --train-iters 4"),
        ("other-plan", f"{tp2} --oases-schedule overlap --oases-plan {plan_b}"),
    ):
        out[f"plan->{name}"] = pretrain_and_capture(f"{flags} --load {saved}")["losses"]
    stock = os.path.join(ckpt, "stock")
    pretrain_and_capture(f"{tp2} --exit-interval 2 --save {stock}")
    out["stock->plan"] = pretrain_and_capture(
        f"{tp2} --load {stock} --oases-schedule oases --oases-plan {plan_a}"
    )["losses"]
    return out


@pytest.mark.timeout(600)
def test_per_layer_plan_checkpoints_are_stock_checkpoints(tmp_path):
    import json

    from helpers import LLAMA

    plans = []
    for name, degrees in (("a", [1, 2, 1, 2]), ("b", [2, 1, 1, 2])):
        path = tmp_path / f"plan_{name}.json"
        path.write_text(
            json.dumps({"version": 1, "tensor_model_parallel_size": 2, "degrees": degrees})
        )
        plans.append(str(path))
    base = (
        LLAMA.format(layers=4) + "--micro-batch-size 4 --global-batch-size 8 " + NO_DROP + RECOMPUTE
    )
    res = run_distributed(_plan_worker, 2, base, str(tmp_path), *plans, timeout=560)[-1]
    ref = res.pop("reference")
    assert max_rel_diff(res.pop("save"), ref[:2]) < 1e-5
    assert len(ref) == 4
    for name, losses in res.items():
        err = max_rel_diff(losses, ref[2:])
        print(f"{name}: losses 3-4 {losses} vs {ref[2:]} (rel {err:.1e})")
        assert len(losses) == 2 and err < 1e-5, name
