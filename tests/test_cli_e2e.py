"""`oases train` end to end under torchrun: schedule + per-layer plan + trace, TP=2 × PP=2."""

import json
import os

import pytest

from megatron_oases.testing import run_torchrun


@pytest.mark.timeout(400)
def test_oases_train_schedule_plan_trace_pp2(tmp_path):
    plan = tmp_path / "plan.json"
    plan.write_text(
        json.dumps({"version": 1, "tensor_model_parallel_size": 2, "degrees": [1, 2, 2, 1]})
    )
    log, trace = tmp_path / "golden.json", tmp_path / "trace.json"
    argv = (
        "train --num-layers 4 --hidden-size 64 --num-attention-heads 8 --seq-length 16 "
        "--vocab-size 500 --micro-batch-size 4 --global-batch-size 16 --train-iters 2 "
        "--mock-data --tensor-model-parallel-size 2 --pipeline-model-parallel-size 2 "
        "--recompute-granularity full --oases-schedule oases "
        f"--oases-plan {plan} --oases-trace {trace} --log-json {log}"
    ).split()
    proc = run_torchrun(argv, nproc=4, timeout=380)
    assert proc.returncode == 0, proc.stderr[-3000:]
    golden = json.loads(log.read_text())
    assert golden["lm loss"]["end_step"] == 2 and len(golden["throughput"]["values"]) == 2
    for rank in range(4):
        events = json.loads((tmp_path / f"trace.rank{rank}.json").read_text())["traceEvents"]
        comms = [e for e in events if e["cat"] == "comm" and e["args"]["sub_batch"] >= 0]
        assert comms and {e["args"]["pass"] for e in comms} == {"forward", "backward"}
        # degree-1 layers communicate on a group of one: no all-reduce issued for them
        assert {e["args"]["group_size"] for e in comms} == {2}


@pytest.mark.timeout(120)
def test_oases_train_unsplittable_micro_batch_is_one_line():
    proc = run_torchrun(
        "train --micro-batch-size 1 --oases-schedule overlap --mock-data".split(),
        nproc=1,
        timeout=100,
    )
    assert proc.returncode != 0
    assert (
        "micro-batch 1 cannot be split; use --micro-batch-size ≥ 2 or --oases-schedule off"
        in proc.stderr
    )
