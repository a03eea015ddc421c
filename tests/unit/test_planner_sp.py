"""Planner under sequence parallelism: SP collectives in the profile, per-pass/schedule block
communication, SP activation memory, ``oases plan --sequence-parallel`` (uniform T)."""

import copy
import json

import pytest
from helpers.variants import MODELS

from megatron_oases.cli import main as oases
from megatron_oases.errors import OasesConfigError
from megatron_oases.formats.profile import Profile, tp_ranks
from megatron_oases.planner.build import build_problem
from megatron_oases.planner.settings import PlanSettings
from megatron_oases.profiler.analytic import analytic_profile
from megatron_oases.profiler.model_config import model_args, read_model_file

GBS, MBS = 64, 8


def _profile_data(sequence_parallel):
    flat = read_model_file(f"{MODELS}:h2048")
    if sequence_parallel:
        flat["sequence_parallel"] = True
    return analytic_profile(model_args(flat), "rtx3090-nvlink")


@pytest.fixture(scope="module")
def sp_data():
    return _profile_data(True)


@pytest.fixture(scope="module")
def plain_data():
    return _profile_data(False)


def test_analytic_sp_collectives_are_half_the_all_reduce(sp_data):
    prof = Profile(sp_data)
    assert prof.sequence_parallel
    for d in (2, 4):
        for nbytes in (12345, 7_000_000, 3e9):
            ar = prof.all_reduce_time(tp_ranks(d), nbytes)
            assert ar > 0
            assert prof.all_gather_time(tp_ranks(d), nbytes) == pytest.approx(ar / 2, rel=1e-9)
            assert prof.reduce_scatter_time(tp_ranks(d), nbytes) == pytest.approx(ar / 2, rel=1e-9)


# (all-gathers, reduce-scatters) per block by pass, written out from the runtime's schedules
EXPECTED = {
    ("off", True): {"F": (1, 1), "R": (1, 1), "B": (2, 1)},
    ("overlap", True): {"F": (1, 1), "R": (1, 1), "B": (1, 1)},
    ("overlap", False): {"F": (1, 1), "B": (1, 1)},
    ("cross-pass", True): {"F": (1, 1), "R": (1, 1), "B": (1, 1)},
    ("oases", True): {"F": (1, 1), "R+B": (2, 1)},  # recompute re-gathers (1, 0); backward (1, 1)
}


@pytest.mark.parametrize("schedule,recompute", list(EXPECTED))
def test_sp_block_communication_per_pass_and_schedule(sp_data, schedule, recompute):
    data = copy.deepcopy(sp_data)
    for fit in data["comm"]["reduce_scatter"].values():  # tell AG and RS apart in the sums
        fit["beta_s_per_byte"] *= 3
        fit["alpha_s"] *= 5
    prof = Profile(data)
    problem = build_problem(
        prof,
        PlanSettings(
            schedule=schedule,
            recompute=recompute,
            global_batch_size=GBS,
            micro_batch_size=MBS,
            sequence_parallel=True,
        ),
    )
    T = prof.tp
    assert problem.degrees == [T]
    hid = prof.shape["seq_length"] * prof.shape["hidden_size"] * prof.dtype_bytes
    n = MBS  # the group at T gets the domain's whole micro-batch
    subs = [n - n // 2, n // 2] if schedule != "off" else [n]
    seen = set()
    for block in [b for seg in problem.forward + problem.backward for b in seg]:
        kind = block.name.split(".", 1)[1]
        ag, rs = EXPECTED[schedule, recompute][kind]
        seen.add(kind)
        for s, ns in enumerate(subs):
            want = ag * prof.all_gather_time(tp_ranks(T), ns * hid) + rs * prof.reduce_scatter_time(
                tp_ranks(T), ns * hid
            )
            assert block.comm[s, 0] == pytest.approx(want, rel=1e-12), (block.name, s)
    assert seen == set(EXPECTED[schedule, recompute])


def test_non_sp_oases_recompute_issues_no_collective(plain_data):
    prof = Profile(plain_data)
    problem = build_problem(
        prof, PlanSettings(schedule="oases", global_batch_size=GBS, micro_batch_size=MBS)
    )
    hid = prof.shape["seq_length"] * prof.shape["hidden_size"] * prof.dtype_bytes
    k = problem.degrees.index(4)
    rb = [b for seg in problem.backward for b in seg if b.name.endswith("R+B")][0]
    assert rb.comm[0, k] == pytest.approx(prof.all_reduce_time(tp_ranks(4), MBS // 2 * hid))


def _memory(data, sequence_parallel, schedule, recompute):
    problem = build_problem(
        Profile(data),
        PlanSettings(
            schedule=schedule,
            recompute=recompute,
            global_batch_size=GBS,
            micro_batch_size=MBS,
            degrees=[4],
            sequence_parallel=sequence_parallel,
        ),
    )
    return problem.meta["memory_parts"], problem


def test_sp_activation_memory_follows_korthikanti(sp_data, plain_data):
    shape = sp_data["model"]
    assert shape["hidden_dropout"] > 0 and shape["attention_dropout"] > 0  # the paper's formula
    s, h, a, t = shape["seq_length"], shape["hidden_size"], shape["num_attention_heads"], 4
    attn = 5 * a * s / (h * t)
    # no recompute, stock: sbh·(34/t + 5as/(ht)) with SP vs sbh·(10 + 24/t + 5as/(ht)) without
    sp, _ = _memory(sp_data, True, "off", False)
    plain, _ = _memory(plain_data, False, "off", False)
    ratio = sp["saved"][0, 0] / plain["saved"][0, 0]
    assert ratio == pytest.approx((34 / t + attn) / (10 + 24 / t + attn), rel=1e-9)
    assert 0.5 < ratio < 0.8  # the attention scores (already /t) dominate at s=1024
    # full recompute saves only the layer input: s/t of it under SP
    sp, _ = _memory(sp_data, True, "off", True)
    plain, _ = _memory(plain_data, False, "off", True)
    assert sp["saved"][0, 0] == pytest.approx(plain["saved"][0, 0] / t, rel=1e-12)
    assert sp["runtime"][0, 0] < plain["runtime"][0, 0]
    # the overlapped schedules keep the recomputed layer's two gathered column inputs on top
    gathered = s * h * 2 * (1 - 1 / t) * MBS
    sp_cp, _ = _memory(sp_data, True, "cross-pass", True)
    sp_off_split = sp["runtime"][0, 0] + 2 * gathered
    assert sp_cp["runtime"][0, 0] >= sp_off_split - 1e-6
    # and so does overlap's forward graph without recompute, in the saved activations
    sp_ov, _ = _memory(sp_data, True, "overlap", False)
    sp_off, _ = _memory(sp_data, True, "off", False)
    assert sp_ov["saved"][0, 0] == pytest.approx(sp_off["saved"][0, 0] + 2 * gathered, rel=1e-12)


def test_sp_peak_memory_below_non_sp_per_schedule(sp_data, plain_data):
    for schedule in ("off", "overlap", "cross-pass", "oases"):
        _, sp = _memory(sp_data, True, schedule, True)
        _, plain = _memory(plain_data, False, schedule, True)
        assert sp.peak_memory_bytes([0] * sp.num_layers) < plain.peak_memory_bytes(
            [0] * plain.num_layers
        ), schedule


def _profile_file(tmp_path, name, *extra):
    out = str(tmp_path / name)
    argv = ["profile", "--model", f"{MODELS}:h2048", "--analytic", "--cluster", "rtx3090-nvlink"]
    assert oases(argv + list(extra) + ["--out", out]) == 0
    return out


def test_plan_cli_sequence_parallel_is_uniform_prediction(tmp_path, capsys):
    prof = _profile_file(tmp_path, "sp.json", "--sequence-parallel")
    assert json.load(open(prof))["sequence_parallel"] is True
    capsys.readouterr()
    out = str(tmp_path / "plan.json")
    base = ["plan", "--profile", prof, "--global-batch-size", str(GBS)]
    base += ["--micro-batch-size", str(MBS), "--sequence-parallel"]
    assert oases(base + ["--schedule", "oases", "--out", out]) == 0
    text = capsys.readouterr().out
    assert "sequence parallelism: every layer at T=4" in text
    plan = json.load(open(out))
    assert plan["sequence_parallel"] is True
    assert plan["degrees"] == [4] * 24
    assert plan["uniform"].keys() == {"4"}
    pred = plan["predicted"]
    assert pred["iteration_time_s"] > 0 and pred["peak_memory_bytes_per_rank"] > 0
    assert plan["uniform"]["4"]["fits"] is True
    # a per-layer search is refused rather than planned
    assert oases(base + ["--degrees", "2,4"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "every layer at T=4" in err[0]


def test_old_profile_with_sequence_parallel_is_one_clear_line(tmp_path, capsys, plain_data):
    old = tmp_path / "old.json"
    data = copy.deepcopy(plain_data)
    data.pop("sequence_parallel")  # as written before SP was profiled
    old.write_text(json.dumps(data))
    argv = ["plan", "--profile", str(old), "--global-batch-size", str(GBS), "--sequence-parallel"]
    assert oases(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1
    assert "no sequence-parallel data" in err[0] and "oases profile" in err[0]
    assert "--sequence-parallel" in err[0]
    with pytest.raises(OasesConfigError, match="no sequence-parallel data"):
        build_problem(Profile(data), PlanSettings(global_batch_size=GBS, sequence_parallel=True))
    # without SP the old profile still plans
    assert oases(argv[:-1] + ["--quiet"]) == 0
