"""Issue 61.2: checkpoints under Megatron-FSDP (``--use-megatron-fsdp``, ``fsdp_dtensor``), in
Megatron-LM's loop: saved at iteration 2 (``--exit-interval``), resumed to 6, against the
uninterrupted run, under stock Megatron and a split schedule (``overlap``) and across the two.

megatron-core 0.19.2 alone hangs in the save: a rank whose local shard of a parameter is empty
holds no optimizer state for it, and the per-DTensor collectives of its ``fsdp_dtensor``
preprocessing stop pairing up across ranks (the ``megatron-fsdp-checkpoint`` patch,
``megatron_oases/platform/megatron_fsdp_checkpoint.py``; every run here is bounded by
``run_distributed``'s timeout). Four iterations follow each load: the first depends only on the
loaded parameters, the next two on the loaded Adam state too; and the optimizer state itself, read
before the first iteration after the load (every parameter's local shard, its two moments and its
step), is compared with the uninterrupted run's at the same point, bit for bit.

Tiny GPT (2 layers), fp32, dropout off: DP=2 (2 ranks) under ``optim_grads_params`` (stock,
overlap, stock -> overlap) and ``optim`` (stock); TP=2 x DP=2 (4 ranks) under
``optim_grads_params`` (stock); PP=2 x DP=2 (4 ranks, the ``megatron-fsdp-pipeline`` patch) under
``optim_grads_params`` (stock, overlap, stock -> overlap; the losses on the last stage).
"""

import os

import pytest
from helpers import GPT, NO_DROP, RECOMPUTE
from helpers.runs import max_rel_diff
from helpers.variants import layout

from megatron_oases.launch import run_distributed

pytestmark = pytest.mark.slow

MFSDP = "--use-megatron-fsdp --ckpt-format fsdp_dtensor --data-parallel-sharding-strategy "
ITERS = " --train-iters 6 " + NO_DROP + RECOMPUTE
DP2 = layout(GPT, 2, tp=1, mbs=2, gbs=4)[1] + ITERS
TP2_DP2 = layout(GPT, 2, tp=2, mbs=2, gbs=4)[1] + ITERS
#: (name, flags, the schedule that saves, the schedules that load): each checkpoint loaded by the
#: schedule that saved it, and stock's by overlap too.
DP2_ROUND_TRIPS = (
    ("ogp", MFSDP + "optim_grads_params", "off", ("off", "overlap")),
    ("ogp", MFSDP + "optim_grads_params", "overlap", ("overlap",)),
    ("optim", MFSDP + "optim", "off", ("off",)),
)
TP2_DP2_ROUND_TRIPS = (("ogp", MFSDP + "optim_grads_params", "off", ("off",)),)
PP2_DP2 = layout(GPT, 2, tp=1, pp=2, mbs=2, gbs=8)[1] + ITERS
PP2_DP2_ROUND_TRIPS = DP2_ROUND_TRIPS[:2]


def _optimizer_state(optimizer):
    """Per parameter of the optimizer, in its order: digests (equal iff bit-equal) of its local
    shard and Adam moments, and its step; ``"empty"`` where this rank's shard is empty (no state
    in an uninterrupted run, a loaded mock after a resume: it never steps on this rank)."""
    import hashlib

    from torch.distributed.tensor import DTensor

    def local(t):
        return t._local_tensor if isinstance(t, DTensor) else t

    def digest(t):
        return hashlib.sha1(local(t).detach().contiguous().numpy().tobytes()).hexdigest()

    out = []
    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        adam = opt.optimizer
        for group in adam.param_groups:
            for p in group["params"]:
                if local(p).numel() == 0:
                    out.append("empty")
                    continue
                state = adam.state.get(p, {})
                step = state.get("step")
                moments = {k: digest(v) for k, v in state.items() if k != "step"}
                out.append((digest(p), moments, None if step is None else float(step)))
    return out


def _run(argv):
    """One in-process job: its losses, the optimizer state before each iteration, and at each
    save or load the optimizer's DTensor state keys and the mocks the patch added."""
    import torch
    from megatron.training import training
    from torch.distributed.tensor import DTensor

    from megatron_oases.patching import Patch
    from megatron_oases.platform import megatron_fsdp_checkpoint as mfc
    from megatron_oases.training.inprocess import prepared
    from megatron_oases.training.pretrain import run_in_process

    record = {"losses": [], "states": [], "packed": []}
    original, fill = training.train_step, mfc.fill_missing

    def fill_missing(optimizer, packed, is_loading=False):
        added = fill(optimizer, packed, is_loading)
        keys = [
            f"{name}.{k}"
            for name, state in packed.items()
            for k, v in state.items()
            if isinstance(v, DTensor)
        ]
        record["packed"].append((sorted(keys), len(added)))
        return added

    def train_step(forward_step_func, data_iterator, model, optimizer, *rest, **kwargs):
        record["states"].append(_optimizer_state(optimizer))
        out = original(forward_step_func, data_iterator, model, optimizer, *rest, **kwargs)
        loss = out[0].get("lm loss") if out[0] else None
        record["losses"].append(None if loss is None else torch.as_tensor(loss).item())
        return out

    patch = Patch(
        "test-mfsdp-state",
        [(training, "train_step", train_step), (mfc, "fill_missing", fill_missing)],
    )
    record.update(run_in_process(prepared(argv), extra_patches=[patch]))
    return record


def _worker(base, round_trips, ckpt):
    out = {}
    for name, flags, saver, loaders in round_trips:
        for schedule in (saver, *loaders):
            key = f"full-{name}-{schedule}"
            if key not in out:
                out[key] = _run(f"{base} {flags} --oases-schedule {schedule}")
        path = os.path.join(ckpt, f"{name}-{saver}")
        out[f"{name}-{saver}-save"] = _run(
            f"{base} {flags} --exit-interval 2 --save {path} --oases-schedule {saver}"
        )
        for loader in loaders:
            out[f"{name}:{saver}->{loader}"] = _run(
                f"{base} {flags} --load {path} --oases-schedule {loader}"
            )
        if (name, saver) == ("ogp", "off"):  # a resumed run saves again (at 4), resumed to 6
            again = f"{path}-again"
            out["again-save"] = _run(
                f"{base} {flags} --load {path} --save {again} --exit-interval 4 --oases-schedule off"
            )
            out["again-load"] = _run(f"{base} {flags} --load {again} --oases-schedule off")
    return out


@pytest.fixture(scope="module")
def dp2(tmp_path_factory):
    ckpt = str(tmp_path_factory.mktemp("mfsdp-ckpt-dp2"))
    return run_distributed(_worker, 2, DP2, DP2_ROUND_TRIPS, ckpt, timeout=300)


@pytest.fixture(scope="module")
def tp2_dp2(tmp_path_factory):
    ckpt = str(tmp_path_factory.mktemp("mfsdp-ckpt-tp2"))
    return run_distributed(_worker, 4, TP2_DP2, TP2_DP2_ROUND_TRIPS, ckpt, timeout=300)


@pytest.fixture(scope="module")
def pp2_dp2(tmp_path_factory):
    ckpt = str(tmp_path_factory.mktemp("mfsdp-ckpt-pp2"))
    return run_distributed(_worker, 4, PP2_DP2, PP2_DP2_ROUND_TRIPS, ckpt, timeout=500)


def _cases(fixture, round_trips):
    return [(fixture, *trip) for trip in round_trips]


CASES = (
    _cases("dp2", DP2_ROUND_TRIPS)
    + _cases("tp2_dp2", TP2_DP2_ROUND_TRIPS)
    + _cases("pp2_dp2", PP2_DP2_ROUND_TRIPS)
)
IDS = [f"{f}-{n}-{s}" for f, n, _, s, _ in CASES]


@pytest.mark.timeout(600)
def test_uninterrupted_runs_install_nothing_for_checkpoints(dp2):
    """The patch is installed where a run saves or loads, nowhere else; a rank holds an empty
    shard of some parameter (what hung the save)."""
    for r in dp2:
        assert "megatron-fsdp-checkpoint" not in r["full-ogp-off"]["installed"]
        assert len(r["full-ogp-off"]["losses"]) == 6
    assert any("empty" in r["full-ogp-off"]["states"][2] for r in dp2)


@pytest.mark.timeout(600)
@pytest.mark.parametrize("fixture,name,flags,saver,loaders", CASES, ids=IDS)
def test_every_rank_saves_and_loads_the_same_dtensor_keys(
    request, fixture, name, flags, saver, loaders
):
    """What hung the save: some rank lacks the optimizer state of a parameter whose local shard
    is empty there. With the patch's mocks, every rank's DTensor keys are the same at the save
    and at each load (the per-key collectives pair up), and some rank needed mocks."""
    runs = request.getfixturevalue(fixture)
    stages = 2 if fixture == "pp2_dp2" else 1  # at PP=2 ranks 0-1 hold stage 0, 2-3 stage 1
    per_stage = len(runs) // stages
    for key in [f"{name}-{saver}-save"] + [f"{name}:{saver}->{x}" for x in loaders]:
        for stage in range(stages):
            (keys, _), *rest = [
                r[key]["packed"][0] for r in runs[stage * per_stage : (stage + 1) * per_stage]
            ]
            assert keys and all(other == keys for other, _ in rest), (key, stage)
        assert all(len(r[key]["packed"]) == 1 for r in runs), key
        assert any(r[key]["packed"][0][1] > 0 for r in runs), key
        print(f"{fixture} {key}: {len(keys)} DTensor keys a rank, mocks", end=" ")
        print([r[key]["packed"][0][1] for r in runs])


@pytest.mark.timeout(600)
@pytest.mark.parametrize("fixture,name,flags,saver,loaders", CASES, ids=IDS)
def test_save_is_the_uninterrupted_run(request, fixture, name, flags, saver, loaders):
    for r in request.getfixturevalue(fixture):
        save, full = r[f"{name}-{saver}-save"], r[f"full-{name}-{saver}"]
        assert "megatron-fsdp-checkpoint" in save["installed"], save["installed"]
        assert save["exit_code"] == 0 and save["losses"] == full["losses"][:2], save


@pytest.mark.timeout(600)
@pytest.mark.parametrize("fixture,name,flags,saver,loaders", CASES, ids=IDS)
def test_resume_restores_the_optimizer_state_bit_for_bit(
    request, fixture, name, flags, saver, loaders
):
    """Before iteration 3, the loaded state (parameters, Adam's moments and step) is the saving
    schedule's uninterrupted run's, under each loading schedule."""
    for rank, r in enumerate(request.getfixturevalue(fixture)):
        expected = r[f"full-{name}-{saver}"]["states"][2]
        held = [s for s in expected if s != "empty"]
        assert held and all(step == 2.0 for _, _, step in held), expected[:2]
        assert all(set(moments) == {"exp_avg", "exp_avg_sq"} for _, moments, _ in held)
        for loader in loaders:
            got = r[f"{name}:{saver}->{loader}"]["states"][0]
            assert got == expected, (name, saver, loader, rank)


@pytest.mark.timeout(600)
@pytest.mark.parametrize("fixture,name,flags,saver,loaders", CASES, ids=IDS)
def test_resume_under_the_saving_schedule_is_bit_exact(
    request, fixture, name, flags, saver, loaders
):
    """Iterations 3-6 after the load equal the uninterrupted run's bit for bit (4-6 depend on
    the loaded Adam state and step)."""
    for r in request.getfixturevalue(fixture):
        loaded, full = r[f"{name}:{saver}->{saver}"], r[f"full-{name}-{saver}"]
        assert "megatron-fsdp-checkpoint" in loaded["installed"], loaded["installed"]
        assert loaded["losses"] == full["losses"][2:], (name, loaded["losses"], full["losses"])
        assert len(loaded["losses"]) == 4
        print(f"{fixture} {name} {saver}->{saver}: losses 3-6 {loaded['losses']}")


@pytest.mark.timeout(600)
@pytest.mark.parametrize("fixture", ["dp2", "pp2_dp2"])
def test_resume_under_the_other_schedule(request, fixture):
    """Saved by stock, resumed by overlap: iterations 3-6 as overlap's uninterrupted run (at
    PP=2 on the last stage, which has the losses)."""
    for r in request.getfixturevalue(fixture):
        if r["full-ogp-overlap"]["losses"][0] is None:  # a first pipeline stage
            continue
        loaded, full = r["ogp:off->overlap"], r["full-ogp-overlap"]
        assert "oases-schedule" in loaded["installed"]
        err = max_rel_diff(loaded["losses"], full["losses"][2:])
        print(f"ogp off->overlap: losses 3-6 {loaded['losses']} vs {full['losses'][2:]}: {err}")
        assert len(loaded["losses"]) == 4 and err < 1e-5, err


@pytest.mark.timeout(600)
def test_a_resumed_run_saves_and_resumes_again_bit_exact(dp2):
    """A run resumed at 2 saves at 4 (its optimizer now holds the loaded mocks of the parameters
    whose shard is empty on this rank, whose step never advances there); resumed from 4, the
    state before iteration 5 (every held parameter's step 4) and iterations 5-6 are the
    uninterrupted run's bit for bit."""
    for r in dp2:
        full, save, load = r["full-ogp-off"], r["again-save"], r["again-load"]
        assert save["exit_code"] == 0 and save["losses"] == full["losses"][2:4], save["losses"]
        assert load["states"][0] == full["states"][4]
        assert load["losses"] == full["losses"][4:], (load["losses"], full["losses"])
