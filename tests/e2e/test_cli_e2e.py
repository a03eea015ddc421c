"""``oases train`` / ``oases run`` end to end under torchrun, on Megatron-LM's own ``pretrain()`` loop.

``oases train`` fills in a tiny demo model and mock data; ``oases run`` (= ``oases-pretrain-gpt``)
takes exactly Megatron-LM's flags. ``tests/e2e/test_megatron_lm_integration_e2e.py`` covers
``oases-pretrain-gpt`` itself (schedules compared, ``--data-path``, ``--help``, bad flags on 2
ranks).
"""

import json

import pytest
from helpers import RECOMPUTE

from megatron_oases.launch import run_torchrun


@pytest.mark.timeout(400)
def test_oases_train_schedule_plan_trace_pp2(tmp_path):
    plan = tmp_path / "plan.json"
    plan.write_text(
        json.dumps({"version": 1, "tensor_model_parallel_size": 2, "degrees": [1, 2, 2, 1]})
    )
    log, trace = tmp_path / "golden.json", tmp_path / "trace.json"
    argv = (
        "train --num-layers 4 --hidden-size 64 --num-attention-heads 8 --seq-length 16 "
        "--max-position-embeddings 16 --vocab-size 500 --micro-batch-size 4 "
        "--global-batch-size 16 --train-iters 2 --mock-data --tensor-model-parallel-size 2 "
        f"--pipeline-model-parallel-size 2 {RECOMPUTE} --oases-schedule oases "
        f"--oases-plan {plan} --oases-trace {trace} --log-json {log}"
    ).split()
    proc = run_torchrun(argv, nproc=4, timeout=380)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "iteration        2/       2 |" in proc.stdout, proc.stdout[-3000:]
    golden = json.loads(log.read_text())
    assert golden["lm loss"]["end_step"] == 2 and len(golden["throughput"]["values"]) == 2
    for rank in range(4):
        events = json.loads((tmp_path / f"trace.rank{rank}.json").read_text())["traceEvents"]
        comms = [e for e in events if e["cat"] == "comm" and e["args"]["sub_batch"] >= 0]
        assert comms and {e["args"]["pass"] for e in comms} == {"forward", "backward"}
        # degree-1 layers communicate on a group of one: no all-reduce issued for them
        assert {e["args"]["group_size"] for e in comms} == {2}


@pytest.mark.timeout(120)
def test_oases_run_unsplittable_micro_batch_is_one_line():
    """``oases run`` takes Megatron-LM's flags as given (no demo model): one line, before any
    process group starts."""
    proc = run_torchrun(
        (
            "run --num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 32 "
            "--max-position-embeddings 32 --micro-batch-size 1 --train-iters 2 --lr 1e-3 "
            "--mock-data --oases-schedule overlap"
        ).split(),
        nproc=1,
        timeout=100,
    )
    assert proc.returncode != 0
    errors = [ln for ln in proc.stderr.splitlines() if ": error:" in ln]
    assert errors == [
        "oases run: error: micro-batch 1 cannot be split; use --micro-batch-size ≥ 2, "
        "--oases-split sequence (sub-batches of sequence chunks) or --oases-schedule off"
    ], proc.stderr[-3000:]
