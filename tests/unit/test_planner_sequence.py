"""The planner's sequence chunks (``--split sequence``, the runtime's ``--oases-split sequence``):
costs against the batch split, the micro-batch of one sample, refusals and the plan file."""

import json

import numpy as np
import pytest
from helpers.variants import MODELS, h2048_profile

from megatron_oases.cli import main as oases
from megatron_oases.config import OasesConfig
from megatron_oases.errors import OasesConfigError
from megatron_oases.formats.plan import validate_plan
from megatron_oases.planner.build import build_problem
from megatron_oases.planner.choose import alternatives_table, choose_plan
from megatron_oases.planner.settings import PlanSettings
from megatron_oases.planner.time_model import evaluate

GBS = 128  # h2048: DP 8, T 4: 16 samples per TMP domain


@pytest.fixture(scope="module")
def h2048():
    return h2048_profile("rtx3090-pcie")


def _problem(profile, schedule, recompute, split, micro_batch):
    return build_problem(
        profile,
        PlanSettings(
            global_batch_size=GBS,
            micro_batch_size=micro_batch,
            schedule=schedule,
            recompute=recompute,
            split=split,
            degrees=[4],
        ),
    )


def _blocks(problem, name):
    return [b for seg in problem.forward + problem.backward for b in seg if b.name == name]


@pytest.mark.parametrize("recompute", ["none", "full"])
def test_chunk_costs_against_the_batch_split(h2048, recompute):
    """A chunk of n samples × s/2 tokens costs what n/2 samples do, except core attention: the
    earlier chunk computes a quarter of the s×s square per sample (half a half-sample's), the
    later one half (a half-sample's); its backward costs twice its forward."""
    m = 4
    seq = _problem(h2048, "overlap", recompute, "sequence", m)
    bat = _problem(h2048, "overlap", recompute, "batch", m)
    assert seq.subs == bat.subs == 2
    core_half = h2048.core_attention_time(4, m / 2)
    for name in ("mlp.F", "mlp.B") + (("mlp.R",) if recompute == "full" else ()):
        np.testing.assert_allclose(_blocks(seq, name)[0].comp, _blocks(bat, name)[0].comp)
    for name, factor in (("attention.F", 1), ("attention.B", 2)):
        s, b = _blocks(seq, name)[0].comp, _blocks(bat, name)[0].comp
        assert s[0, 0] == pytest.approx(b[0, 0] - factor * core_half / 2)
        assert s[1, 0] == pytest.approx(b[1, 0])
    # the collectives carry the same bytes (half the tokens of all samples, or all of half)
    for name in ("attention.F", "mlp.B"):
        np.testing.assert_allclose(_blocks(seq, name)[0].comm, _blocks(bat, name)[0].comm)
    L = seq.num_layers
    t_seq = evaluate(seq, [0] * L)["iteration_time_s"]
    t_bat = evaluate(bat, [0] * L)["iteration_time_s"]
    assert t_seq < t_bat
    if recompute == "none":
        # every layer saves a quarter of the core-attention square less
        parts_s, parts_b = seq.meta["memory_parts"], bat.meta["memory_parts"]
        core = h2048.core_attention_activation(4, m)
        np.testing.assert_allclose(parts_b["saved"] - parts_s["saved"], core / 4)


def test_a_micro_batch_of_one_sample_is_split_by_sequence_only(h2048):
    """Micro-batch 1: no overlapped schedule can split it by samples; with sequence chunks every
    one runs, and ``--schedule auto`` picks one of them, with flags the runtime accepts. On device
    time alone: with the host term (12 µs per call, measured on an H100 machine's host and assumed
    for RTX 3090 hosts) a micro-batch of one sample split in two is host-bound and stock wins."""
    from helpers.runs import parse

    plan = choose_plan(
        h2048,
        PlanSettings(
            schedule="auto",
            global_batch_size=GBS,
            memory_gb=24,
            micro_batch_size=1,
            host_us_per_call=0,
        ),
    )[0]
    hosted = choose_plan(
        h2048,
        PlanSettings(schedule="auto", global_batch_size=GBS, memory_gb=24, micro_batch_size=1),
    )[0]
    assert hosted["schedule"] == "off" and hosted["predicted"]["host"]["host_bound"]
    assert plan["split"] == "sequence" and plan["schedule"] != "off"
    assert plan["degrees"] == [4] * 24
    assert plan["launch_flags"].startswith(f"--oases-schedule {plan['schedule']}")
    assert plan["launch_flags"].endswith("--oases-split sequence")
    by_split = {"batch": [], "sequence": []}
    for t in plan["alternatives"]:
        if t["schedule"] != "off":
            by_split[t.get("split", "batch")].append(t)
    assert by_split["batch"] and not any(t["fits"] for t in by_split["batch"])
    assert all("needs ≥ 2 to split" in t["why"] for t in by_split["batch"])
    assert len(by_split["sequence"]) >= 6 and all(t["fits"] for t in by_split["sequence"])
    stock = min(
        t["iteration_time_s"] for t in plan["alternatives"] if t["schedule"] == "off" and t["fits"]
    )
    assert plan["predicted"]["iteration_time_s"] < stock
    assert any(
        line.endswith("[4]") and "sequence chunks" in line for line in alternatives_table(plan)
    )
    flags = f"{plan['launch_flags']} --tensor-model-parallel-size 2 --micro-batch-size 1"
    args = parse(flags + " --global-batch-size 2", world_size=2)
    assert args.oases_split == "sequence" and args.oases_schedule == plan["schedule"]
    assert OasesConfig.from_args(args).split == "sequence"  # every rule passes


def test_chunk_memory_at_one_sample_by_hand(h2048):
    """Micro-batch 1, full recomputation: against stock, the chunks save a quarter of the worst
    layer's core-attention square (the earlier chunk's scores are (s/2)×(s/2)) and keep the earlier
    chunk's keys and values in every layer from forward to recompute (2·s·h/T bytes × 1/2)."""
    from megatron_oases.formats.profile import key_value_bytes

    L, s, h, a, T = 24, 1024, 2048, 32, 4
    peak = {}
    for schedule in ("off", "overlap", "cross-pass"):
        split = "batch" if schedule == "off" else "sequence"
        problem = _problem(h2048, schedule, "full", split, 1)
        peak[schedule] = evaluate(problem, [0] * L)["peak_memory_bytes"]
    kv = key_value_bytes(h2048.shape, T, 2)
    assert kv == 2 * s * h / T * 2
    core = h2048.core_attention_activation(T, 1)
    assert core == 5 * a * s * s / T
    assert peak["overlap"] == peak["cross-pass"]
    assert peak["overlap"] - peak["off"] == pytest.approx(L * kv / 2 - core / 4)


def test_what_the_runtime_does_not_run_is_refused(h2048):
    for kwargs, match in (
        (dict(schedule="off", split="sequence"), "--schedule off does not"),
        (dict(schedule="overlap", split="sequence", degrees=[2, 4]), "pass --degrees 4"),
        (dict(schedule="overlap", split="rows"), "choose one of batch, sequence"),
    ):
        with pytest.raises(OasesConfigError, match=match):
            build_problem(h2048, PlanSettings(global_batch_size=GBS, recompute="full", **kwargs))
    with pytest.raises(OasesConfigError, match="choose one of batch, sequence"):
        choose_plan(
            h2048, PlanSettings(schedule="auto", global_batch_size=GBS, memory_gb=24, split="rows")
        )
    with pytest.raises(OasesConfigError, match="split must be one of batch, sequence"):
        validate_plan({"version": 1, "tensor_model_parallel_size": 2, "degrees": [2], "split": 1})


def test_plan_cli_writes_and_evaluates_a_chunked_plan(tmp_path, capsys):
    """``oases plan --split sequence``: the plan records the split, says how to run it (without
    ``--oases-plan``), re-predicts with ``--evaluate``; handed to ``--oases-plan`` it is refused
    with that fix."""
    from helpers.runs import parse

    prof = str(tmp_path / "profile.json")
    argv = ["profile", "--model", f"{MODELS}:h2048", "--analytic", "--cluster", "rtx3090-pcie"]
    assert oases(argv + ["--out", prof]) == 0
    out = str(tmp_path / "plan.json")
    base = ["plan", "--profile", prof, "--global-batch-size", str(GBS), "--micro-batch-size", "1"]
    capsys.readouterr()
    assert oases(base + ["--schedule", "oases", "--split", "sequence", "--out", out]) == 0
    text = capsys.readouterr().out
    assert "--oases-schedule oases --oases-split sequence, without --oases-plan" in text
    plan = json.load(open(out))
    assert plan["split"] == "sequence" and plan["degrees"] == [4] * 24
    assert oases(["plan", "--profile", prof, "--evaluate", out, "--quiet"]) == 0
    evaluated = capsys.readouterr().out
    assert "sequence chunks" in evaluated
    ms = f"{plan['predicted']['iteration_time_s'] * 1e3:.2f} ms"
    assert f"predicted iteration {ms}" in evaluated
    # the same micro-batch without chunks: one line naming the fix
    assert oases(base + ["--schedule", "oases"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "needs ≥ 2 to split" in err[0]
    with pytest.raises(OasesConfigError, match="drop --oases-plan and run with its launch flags"):
        parse(
            f"--oases-schedule oases --oases-plan {out} --recompute-granularity full "
            "--recompute-method uniform --recompute-num-layers 1 --tensor-model-parallel-size 4 "
            "--micro-batch-size 4 --global-batch-size 4 --num-layers 24",
            world_size=4,
        )
