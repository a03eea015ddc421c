"""Per-layer TMP degrees: plans against uniform TP=T (loss and full gradients), with
``--oases-schedule off`` and ``oases``, PP=1 and PP=2."""

import pytest
from helpers import BLOCK, GPT, NO_DROP, RECOMPUTE, SHAPE
from helpers.plans import write_plan
from helpers.runs import max_rel_diff, pretrain_and_capture
from helpers.variants import LAYER_DEGREES_BASE as BASE

from megatron_oases.launch import run_distributed


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
    """``--recompute-method block --recompute-num-layers 3`` with degree spans [0, 1] and [2, 3]:
    the first span recomputes both its layers, the second its first only (layer 3 keeps its
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


def _plan_reads_worker(base, plan):
    """One job with a plan and a schedule: how many times this rank opened the plan file."""
    from megatron_oases.formats import plan as plan_format

    real, reads = plan_format.read_json, []

    def counting(path, *args, **kwargs):
        reads.append(str(path))
        return real(path, *args, **kwargs)

    plan_format.read_json = counting
    try:
        pretrain_and_capture(f"{base} --oases-plan {plan} --oases-schedule oases")
    finally:
        plan_format.read_json = real
    return reads


@pytest.mark.timeout(300)
def test_the_plan_file_is_read_once_per_run(tmp_path):
    """Parsed once into the run's OasesConfig; the patches and the per-layer runtime take it
    from there (they used to open the file again, three times in all)."""
    plan = tmp_path / "plan.json"
    plan.write_text('{"version": 1, "tensor_model_parallel_size": 2, "degrees": [1, 2]}')
    base = (
        GPT.format(layers=2) + "--tensor-model-parallel-size 2 --micro-batch-size 4 "
        "--global-batch-size 8 --train-iters 1 " + RECOMPUTE
    )
    for reads in run_distributed(_plan_reads_worker, 2, base, str(plan), timeout=280):
        assert reads == [str(plan)], reads
