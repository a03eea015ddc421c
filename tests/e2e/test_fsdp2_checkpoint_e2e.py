"""Checkpoints under torch FSDP2 (``--use-torch-fsdp2``), in Megatron-LM's loop: saved at iteration
2 (``--exit-interval``) in ``torch_dist`` and ``torch_dcp``, resumed to 5, against the
uninterrupted run, under stock Megatron and a split schedule (``overlap``) and across the two.

megatron-core 0.19.2 alone saves no ``torch_dist`` checkpoint under FSDP2 on torch >= 2.14, drops
the optimizer's step at its in-place ``torch_dist`` load and cannot load ``torch_dcp``: the
``fsdp2-checkpoint`` patch (``megatron_oases/platform/fsdp2_checkpoint.py``). Three iterations
follow each load: the first depends only on the loaded parameters, the next two on the loaded
Adam state (``exp_avg``, ``exp_avg_sq``) and step too; and the optimizer state itself, read
before the first iteration after the load (every parameter's local shard, its two moments and its
step), is compared with the uninterrupted run's at the same point, bit for bit. Tiny GPT with an
untied output layer (as FSDP2 requires), DP=2 on 2 ranks, fp32, dropout off.
"""

import os

import pytest
from helpers import GPT, NO_DROP, RECOMPUTE
from helpers.runs import max_rel_diff

from megatron_oases.launch import run_distributed

pytestmark = pytest.mark.slow

BASE = (
    GPT.format(layers=2)
    + "--micro-batch-size 2 --global-batch-size 4 --tensor-model-parallel-size 1 "
    + "--use-torch-fsdp2 --untie-embeddings-and-output-weights --train-iters 5 "
    + NO_DROP
    + RECOMPUTE
)
#: (format, the schedule that saves it, the schedules that load it): each format loaded by the
#: schedule that saved it and by the other one.
ROUND_TRIPS = (
    ("torch_dist", "off", ("off", "overlap")),
    ("torch_dcp", "overlap", ("overlap", "off")),
)


def _optimizer_state(optimizer):
    """Every parameter's local shard, its Adam moments and step, in the optimizer's order (digests
    of the bytes: equal iff bit-equal)."""
    import hashlib

    from torch.distributed.tensor import DTensor

    def digest(t):
        t = t._local_tensor if isinstance(t, DTensor) else t
        return hashlib.sha1(t.detach().contiguous().numpy().tobytes()).hexdigest()

    out = []
    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        adam = opt.optimizer
        for group in adam.param_groups:
            for p in group["params"]:
                state = adam.state.get(p, {})
                step = state.get("step")
                out.append(
                    (
                        digest(p),
                        {k: digest(v) for k, v in state.items() if k != "step"},
                        None if step is None else float(step),
                    )
                )
    return out


def _run(argv):
    """One in-process job: its losses, and the optimizer state before each iteration."""
    import torch
    from megatron.training import training

    from megatron_oases.patching import Patch
    from megatron_oases.training.inprocess import prepared
    from megatron_oases.training.pretrain import run_in_process

    record = {"losses": [], "states": []}
    original = training.train_step

    def train_step(forward_step_func, data_iterator, model, optimizer, *rest, **kwargs):
        record["states"].append(_optimizer_state(optimizer))
        out = original(forward_step_func, data_iterator, model, optimizer, *rest, **kwargs)
        loss = out[0].get("lm loss") if out[0] else None
        record["losses"].append(None if loss is None else torch.as_tensor(loss).item())
        return out

    patch = Patch("test-fsdp2-state", [(training, "train_step", train_step)])
    record.update(run_in_process(prepared(argv), extra_patches=[patch]))
    return record


def _worker(base, ckpt):
    out = {f"full-{s}": _run(f"{base} --oases-schedule {s}") for s in ("off", "overlap")}
    for fmt, saver, loaders in ROUND_TRIPS:
        path = os.path.join(ckpt, fmt)
        flags = f"--ckpt-format {fmt}"
        out[f"{fmt}-save"] = _run(
            f"{base} {flags} --exit-interval 2 --save {path} --oases-schedule {saver}"
        )
        for loader in loaders:
            out[f"{fmt}:{saver}->{loader}"] = _run(
                f"{base} {flags} --load {path} --oases-schedule {loader}"
            )
    # --bf16: Megatron's Float16Optimizer, whose own torch_dcp request has no Adam step
    bf16, path = f"{base} --bf16 --ckpt-format torch_dcp --oases-schedule off", f"{ckpt}/bf16"
    out["bf16-full"] = _run(bf16)
    out["bf16-save"] = _run(f"{bf16} --exit-interval 2 --save {path}")
    out["bf16-load"] = _run(f"{bf16} --load {path}")
    return out


@pytest.fixture(scope="module")
def round_trips(tmp_path_factory):
    ckpt = str(tmp_path_factory.mktemp("fsdp2-ckpt"))
    return run_distributed(_worker, 2, BASE, ckpt, timeout=560)


@pytest.mark.timeout(600)
def test_uninterrupted_runs_install_nothing_for_checkpoints(round_trips):
    """The patch is installed where a run saves or loads, nowhere else."""
    for r in round_trips:
        assert r["full-off"]["installed"] == [], r["full-off"]["installed"]
        assert r["full-overlap"]["installed"] == ["oases-schedule"]
        assert len(r["full-off"]["losses"]) == 5 and len(r["full-overlap"]["losses"]) == 5


@pytest.mark.timeout(600)
@pytest.mark.parametrize("fmt,saver,loaders", ROUND_TRIPS)
def test_save_is_the_uninterrupted_run(round_trips, fmt, saver, loaders):
    for r in round_trips:
        save, full = r[f"{fmt}-save"], r[f"full-{saver}"]
        assert "fsdp2-checkpoint" in save["installed"], save["installed"]
        assert save["exit_code"] == 0 and save["losses"] == full["losses"][:2], (fmt, save)


@pytest.mark.timeout(600)
@pytest.mark.parametrize("fmt,saver,loaders", ROUND_TRIPS)
def test_resume_restores_the_optimizer_state_bit_for_bit(round_trips, fmt, saver, loaders):
    """Before iteration 3, the loaded state (parameters, Adam's moments and step) is the saving
    schedule's uninterrupted run's, under either loading schedule."""
    for rank, r in enumerate(round_trips):
        expected = r[f"full-{saver}"]["states"][2]
        assert expected and all(step == 2.0 for _, _, step in expected), expected[:2]
        assert all(set(moments) == {"exp_avg", "exp_avg_sq"} for _, moments, _ in expected)
        for loader in loaders:
            got = r[f"{fmt}:{saver}->{loader}"]["states"][0]
            assert got == expected, (fmt, saver, loader, rank)


@pytest.mark.timeout(600)
@pytest.mark.parametrize("fmt,saver,loaders", ROUND_TRIPS)
def test_resume_under_the_saving_schedule_is_bit_exact(round_trips, fmt, saver, loaders):
    """Iterations 3-5 after the load equal the uninterrupted run's bit for bit (4 and 5 depend on
    the loaded Adam state and step)."""
    for r in round_trips:
        loaded, full = r[f"{fmt}:{saver}->{saver}"], r[f"full-{saver}"]
        assert "fsdp2-checkpoint" in loaded["installed"], loaded["installed"]
        assert loaded["losses"] == full["losses"][2:], (fmt, loaded["losses"], full["losses"])
        print(f"{fmt} {saver}->{saver}: losses 3-5 {loaded['losses']} = {full['losses'][2:]}")


@pytest.mark.timeout(600)
@pytest.mark.parametrize("fmt,saver,loaders", ROUND_TRIPS)
def test_resume_under_the_other_schedule(round_trips, fmt, saver, loaders):
    """Stock <-> overlap: iterations 3-5 as the loading schedule's uninterrupted run."""
    (other,) = [s for s in loaders if s != saver]
    for r in round_trips:
        loaded, full = r[f"{fmt}:{saver}->{other}"], r[f"full-{other}"]
        assert ("oases-schedule" in loaded["installed"]) == (other != "off")
        err = max_rel_diff(loaded["losses"], full["losses"][2:])
        print(f"{fmt} {saver}->{other}: losses 3-5 {loaded['losses']} vs {full['losses'][2:]}")
        assert len(loaded["losses"]) == 3 and err < 1e-5, (fmt, other, err)


@pytest.mark.timeout(600)
def test_bf16_torch_dcp_resume_is_bit_exact(round_trips):
    """``--bf16``: Megatron's ``Float16OptimizerWithFloat16Params`` (fp32 main parameters); its
    torch_dcp request made no Adam step to load into (``KeyError: 'step'`` at the next step)."""
    for r in round_trips:
        full, save, load = r["bf16-full"], r["bf16-save"], r["bf16-load"]
        assert save["losses"] == full["losses"][:2] and "fsdp2-checkpoint" in load["installed"]
        assert load["states"][0] == full["states"][2]
        assert load["losses"] == full["losses"][2:], (load["losses"], full["losses"])
        print(f"bf16 torch_dcp: losses 3-5 {load['losses']} = {full['losses'][2:]}")
