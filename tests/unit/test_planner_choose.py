"""``oases plan --schedule auto``: the schedule and recompute setting chosen with the degrees."""

import copy
import json

import pytest
from helpers.variants import h2048_profile

from megatron_oases.cli import main as oases
from megatron_oases.errors import OasesConfigError
from megatron_oases.formats.plan import load_plan, save_plan
from megatron_oases.formats.profile import Profile
from megatron_oases.planner.api import NoPlanFits, make_plan
from megatron_oases.planner.build import build_problem
from megatron_oases.planner.choose import SETTINGS, alternatives_table, choose_plan, launch_flags
from megatron_oases.planner.settings import PlanSettings
from megatron_oases.planner.time_model import evaluate
from megatron_oases.testbed.clusters import load_cluster

SELECTIVE_FLAGS = "--recompute-granularity selective --recompute-modules core_attn"
SELECTIVE_LN_FLAGS = SELECTIVE_FLAGS + " layernorm"
FULL_FLAGS = "--recompute-granularity full --recompute-method uniform --recompute-num-layers 1"


@pytest.fixture(scope="module")
def h2048():
    """The paper's H=2048, L=24 model (Table 4) on the analytic NVLink-3090 cluster."""
    return h2048_profile("rtx3090-nvlink")


def _fits(profile, schedule, recompute, memory_gb):
    try:
        return make_plan(
            profile,
            PlanSettings(
                global_batch_size=128, memory_gb=memory_gb, schedule=schedule, recompute=recompute
            ),
        )[0]
    except NoPlanFits:
        return None


#: The winner per memory limit (GB) on h2048: 16 GB only fits full recompute; 24 GB fits
#: selective recompute without the norms' outputs (peak 21.8 GB + 10 %, degrees 2 and 4), not
#: with them (24.9 GB); 32 GB fits selective (the tie with selective+ln goes to the setting that
#: keeps more) but not all activations (40.4 GB); 80 GB fits all.
WINNERS = {
    16: ("cross-pass", "full"),
    24: ("overlap", "selective+ln"),
    32: ("overlap", "selective"),
    80: ("overlap", "none"),
}


@pytest.mark.parametrize("memory_gb", sorted(WINNERS))
def test_auto_is_the_fastest_setting_that_fits(h2048, memory_gb):
    plan = choose_plan(
        h2048, PlanSettings(schedule="auto", global_batch_size=128, memory_gb=memory_gb)
    )[0]
    direct = {s: _fits(h2048, *s, memory_gb) for s in SETTINGS}
    fitting = {s: p["predicted"]["iteration_time_s"] for s, p in direct.items() if p}
    best = min(fitting, key=fitting.get)
    assert (plan["schedule"], plan["recompute"]) == best == WINNERS[memory_gb]
    assert plan["predicted"]["iteration_time_s"] == pytest.approx(fitting[best])
    assert plan["degrees"] == direct[best]["degrees"]
    batch = [t for t in plan["alternatives"] if "split" not in t]  # sequence chunks: their file
    assert {(t["schedule"], t["recompute"]) for t in batch if t["fits"]} == set(fitting)
    assert plan.get("recompute_num_layers") is None  # every layer or none (block: see below)
    uniform = [t for t in batch if "recompute_num_layers" not in t]
    assert len(uniform) == len(SETTINGS) == 10
    # every overlapped setting is planned with sequence chunks too, every layer at T
    chunks = [t for t in plan["alternatives"] if t.get("split") == "sequence"]
    assert {(t["schedule"], t["recompute"]) for t in chunks} == {
        s for s in SETTINGS if s[0] != "off"
    }
    assert all(set(t["degrees"]) == {4} for t in chunks if t["fits"])
    flags = {
        "none": "",
        "selective": f" {SELECTIVE_FLAGS}",
        "selective+ln": f" {SELECTIVE_LN_FLAGS}",
        "full": f" {FULL_FLAGS}",
    }
    assert plan["launch_flags"] == f"--oases-schedule {plan['schedule']}{flags[plan['recompute']]}"


@pytest.mark.parametrize("mode", ["selective", "selective+ln"])
def test_selective_only_for_schedules_that_support_it(h2048, mode):
    assert {s for s, r in SETTINGS if r == mode} == {"off", "overlap"}
    for schedule in ("cross-pass", "oases"):
        with pytest.raises(OasesConfigError, match=f"--schedule {schedule} recomputes whole"):
            build_problem(
                h2048, PlanSettings(global_batch_size=128, schedule=schedule, recompute=mode)
            )
    with pytest.raises(OasesConfigError, match="unknown recompute setting 'partial'"):
        build_problem(
            h2048, PlanSettings(global_batch_size=128, schedule="off", recompute="partial")
        )


def _problem(profile, schedule, recompute, **kwargs):
    return build_problem(
        profile,
        PlanSettings(global_batch_size=128, schedule=schedule, recompute=recompute, **kwargs),
    )


@pytest.mark.parametrize("schedule", ["off", "overlap"])
@pytest.mark.parametrize(
    "degrees", [[2] * 24, [1] * 8 + [2] * 8 + [4] * 8], ids=["uniform2", "mixed"]
)
def test_selective_lies_between_no_and_full_recompute(h2048, schedule, degrees):
    """Same degrees: selective keeps less than no recompute and more than full recompute, and
    its iteration is slower than no recompute and faster than full recompute."""
    mem, time = {}, {}
    for mode in ("none", "selective", "full"):
        problem = _problem(h2048, schedule, mode, degrees=sorted(set(degrees)))
        ks = problem.index(degrees)
        res = evaluate(problem, ks)
        mem[mode], time[mode] = res["peak_memory_bytes"], res["iteration_time_s"]
    assert mem["full"] < mem["selective"] < mem["none"]
    assert time["none"] < time["selective"] < time["full"]
    # the share is a real one on this model (s = 1024 ≫ h/a): most activations are attention
    # scores, and recomputing them costs a few percent
    assert 0.3 < mem["selective"] / mem["none"] < 0.8
    assert 1.005 < time["selective"] / time["none"] < 1.1


def test_selective_memory_and_time_by_hand(h2048):
    """Uniform degree 2, stock schedule: against Korthikanti et al.'s 5·a·s²·b/t and the
    core-attention FLOP share of the attention forward (its roofline time), computed here from
    the shape."""
    s, h, a, L = 1024, 2048, 32, 24
    assert h2048.shape["attention_dropout"] > 0 and h2048.dtype_bytes == 2
    n = 128 // 8 * 2 // 4  # global batch / DP = micro-batch 16 over T=4: 8 samples at degree 2
    core_bytes = 5 * a * s * s * n / 2  # softmax output, dropout mask and output, fp16, t = 2
    res = {}
    for mode in ("none", "selective"):
        problem = _problem(h2048, "off", mode, degrees=[2])
        res[mode] = evaluate(problem, [0] * L)
    # every layer but the one being back-propagated drops its core-attention intermediates
    drop = res["none"]["peak_memory_bytes"] - res["selective"]["peak_memory_bytes"]
    assert drop == pytest.approx((L - 1) * core_bytes)
    assert (L - 1) * core_bytes == pytest.approx(15.435e9, rel=1e-3)
    # backward: every attention block runs core attention's forward once more (no extra comm)
    # the attention block's forward: its roofline time (analytic profiles, device_model)
    from megatron_oases.device_model import DeviceRates, block_work, roofline_time

    shape = dict(h2048.shape, core_attention=h2048.data["hardware"]["core_attention"])
    rates = DeviceRates.from_profile(load_cluster("rtx3090-nvlink"))
    attention_fwd = roofline_time(block_work(shape, "attention", 2, 2, samples=n), rates).total_s
    gemm = 8 * s * h * h  # QKV (6·s·h²) and projection (2·s·h²) FLOPs per sample
    core, softmax = 4 * s * s * h, 5 * a * s * s
    core_s = attention_fwd * (core + softmax) / (gemm + core + softmax)
    extra = res["selective"]["backward_s"] - res["none"]["backward_s"]
    assert extra == pytest.approx(L * core_s)
    assert res["selective"]["forward_s"] == pytest.approx(res["none"]["forward_s"])
    assert res["selective"]["iteration_time_s"] - res["none"]["iteration_time_s"] == (
        pytest.approx(extra)
    )


@pytest.mark.parametrize("schedule", ["off", "overlap"])
def test_selective_ln_keeps_the_norm_outputs_out_at_the_same_time(h2048, schedule):
    """``selective+ln`` (``--recompute-modules core_attn layernorm``): every layer drops its two
    norms' outputs (each the size of the layer input), the block being back-propagated holds one
    again; the norms' recomputation is not costed (memory-bound, 0.3 % measured)."""
    s, h, L = 1024, 2048, 24
    n = 128 // 8 * 2 // 4  # 8 samples at degree 2 (see the test above)
    norm_bytes = s * h * 2 * n  # one norm output, fp16
    res = {}
    for mode in ("selective", "selective+ln"):
        res[mode] = evaluate(_problem(h2048, schedule, mode, degrees=[2]), [0] * L)
    drop = res["selective"]["peak_memory_bytes"] - res["selective+ln"]["peak_memory_bytes"]
    assert drop == pytest.approx((2 * L - 1) * norm_bytes)
    for key in ("forward_s", "backward_s", "iteration_time_s"):
        assert res["selective+ln"][key] == pytest.approx(res["selective"][key])


def test_selective_wins_where_only_it_fits_fast(h2048):
    """32 GB: no recompute needs more, so the overlapped schedule with selective recompute beats
    every full-recompute setting; its flags are accepted by Megatron-LM and the Oases rules."""
    from helpers.runs import parse

    plan = choose_plan(h2048, PlanSettings(schedule="auto", global_batch_size=128, memory_gb=32))[0]
    assert (plan["schedule"], plan["recompute"]) == ("overlap", "selective")
    assert plan["launch_flags"] == f"--oases-schedule overlap {SELECTIVE_FLAGS}"
    uniform = [t for t in plan["alternatives"] if not {"recompute_num_layers", "split"} & set(t)]
    alt = {(t["schedule"], t["recompute"]): t for t in uniform}
    assert not alt["overlap", "none"]["fits"] and alt["overlap", "none"]["need_gb"] > 32
    assert alt["overlap", "selective"]["peak_memory_bytes_per_rank"] * 1.1 <= 32e9
    full = min(t["iteration_time_s"] for k, t in alt.items() if k[1] == "full" and t["fits"])
    assert alt["overlap", "selective"]["iteration_time_s"] < 0.85 * full
    # recomputing only the first layers (block) is faster than every layer, not than selective
    block = [
        t["iteration_time_s"]
        for t in plan["alternatives"]
        if "recompute_num_layers" in t and "split" not in t
    ]
    assert block and alt["overlap", "selective"]["iteration_time_s"] < min(block) < full
    table = alternatives_table(plan)
    assert table[1].startswith("overlap (selective recompute)")
    assert any(
        line.startswith("overlap (no recompute)") and "does not fit" in line for line in table
    )
    args = parse(f"{plan['launch_flags']} --micro-batch-size 2 --global-batch-size 2")
    assert args.recompute_granularity == "selective" and args.recompute_modules == ["core_attn"]
    assert args.oases_schedule == "overlap"


def test_profile_without_core_attention_fields_still_plans(h2048):
    """Profiles made before selective recomputation was planned lack the core-attention bytes:
    they are counted from the model shape (the same count the analytic profiler writes)."""
    old = copy.deepcopy(h2048.data)
    written = old["memory"].pop("core_attention_activation_bytes_per_sample")
    assert "core_attention_forward_s" not in old["compute"]["attention"]["2"]
    old = Profile(old)
    for d in (1, 2, 4):
        assert old.core_attention_activation(d, 3) == pytest.approx(3 * written[str(d)])
        assert written[str(d)] == 5 * 32 * 1024 * 1024 / d
    a = choose_plan(h2048, PlanSettings(schedule="auto", global_batch_size=128, memory_gb=32))[0]
    b = choose_plan(old, PlanSettings(schedule="auto", global_batch_size=128, memory_gb=32))[0]
    assert (b["schedule"], b["recompute"], b["degrees"]) == ("overlap", "selective", a["degrees"])
    assert b["predicted"]["peak_memory_bytes_per_rank"] == pytest.approx(
        a["predicted"]["peak_memory_bytes_per_rank"]
    )


def test_auto_cli_and_nothing_fits(tmp_path, capsys, h2048):
    prof = tmp_path / "profile.json"
    prof.write_text(json.dumps(h2048.data))
    out = tmp_path / "plan.json"
    argv = ["plan", "--profile", str(prof), "--global-batch-size", "128", "--schedule", "auto"]
    assert oases(argv + ["--memory", "32", "--quiet", "--out", str(out)]) == 0
    text = capsys.readouterr().out
    plan = load_plan(str(out))
    assert plan["recompute"] == "selective"
    assert f"run with: {plan['launch_flags']}" in text and "does not fit" in text
    assert "schedule overlap, selective recompute" in text
    assert oases(argv + ["--memory", "8", "--quiet"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "no schedule and recompute setting fits in 8" in err
    need = float(err.split("the smallest memory that fits is ")[1].split()[0])
    assert oases(argv + ["--memory", f"{need + 0.01:.2f}", "--quiet"]) == 0
    assert oases(argv + ["--memory", "24", "--no-recompute"]) == 2
    assert "drop --no-recompute" in capsys.readouterr().err
    assert oases(argv + ["--memory", "24", "--recompute", "selective"]) == 2
    assert "drop --recompute" in capsys.readouterr().err
    # one setting: --recompute selective, for the schedules that have it
    one = ["plan", "--profile", str(prof), "--global-batch-size", "128", "--memory", "32"]
    sel = tmp_path / "selective.json"
    assert oases(one + ["--schedule", "off", "--recompute", "selective", "--out", str(sel)]) == 0
    assert load_plan(str(sel))["recompute"] == "selective"
    capsys.readouterr()
    assert oases(one + ["--schedule", "oases", "--recompute", "selective"]) == 2
    assert "--schedule oases recomputes whole layers" in capsys.readouterr().err
    assert oases(one + ["--schedule", "off", "--recompute", "full", "--no-recompute"]) == 2
    assert "--no-recompute contradicts --recompute full" in capsys.readouterr().err


def test_old_plans_with_boolean_recompute_still_read(tmp_path, capsys, h2048):
    """Plans written before selective recomputation was planned store ``recompute`` as a bool."""
    prof = tmp_path / "profile.json"
    prof.write_text(json.dumps(h2048.data))
    for value, schedule, label in ((True, "oases", "full"), (False, "overlap", "no")):
        plan = make_plan(
            h2048,
            PlanSettings(
                global_batch_size=128,
                memory_gb=80,
                schedule=schedule,
                recompute="full" if value else "none",
            ),
        )[0]
        expected = plan["predicted"]["iteration_time_s"]
        plan["recompute"] = value  # as the planner wrote it before
        path = tmp_path / f"old-{schedule}.json"
        save_plan(plan, str(path))
        assert oases(["plan", "--profile", str(prof), "--evaluate", str(path), "--quiet"]) == 0
        out = capsys.readouterr().out
        assert f"(schedule {schedule}, {label} recompute)" in out
        assert f"predicted iteration {expected * 1e3:.2f} ms" in out
    assert launch_flags("off", True) == f"--oases-schedule off {FULL_FLAGS}"
    assert launch_flags("overlap", False) == "--oases-schedule overlap"
    old = {
        "alternatives": [
            {"schedule": "off", "recompute": True, "fits": False},
            {"schedule": "overlap", "recompute": False, "fits": False},
        ]
    }
    assert [line.split("  ")[0] for line in alternatives_table(old)[1:]] == [
        "off (full recompute)",
        "overlap (no recompute)",
    ]


def test_block_recompute_is_costed_per_layer(h2048):
    """``recompute_layers=N`` (Megatron's --recompute-method block): only the first N layers
    have recompute blocks, the others' backward comes first; at the same degrees fewer recomputed
    layers are faster and need more memory, between full recompute and none."""
    degrees = [2] * 24
    for schedule in ("off", "overlap", "cross-pass", "oases"):
        mem, time = [], []
        for n in (None, 18, 12, 6):
            problem = _problem(h2048, schedule, "full", degrees=[2], recompute_layers=n)
            assert problem.meta["recompute_num_layers"] == n
            names = [(b.layer, b.name) for seg in problem.backward for b in seg]
            recomputed = {l for l, name in names if ".R" in name}
            assert recomputed == set(range(24 if n is None else n)), schedule
            # (oases costs a recomputed block as one "R+B" block)
            assert sum(".R" in name for _, name in names) == 2 * len(recomputed)
            assert sum("B" in name.split(".")[1] for _, name in names) == 2 * 24
            assert names[0][0] == 23  # backward starts at the last layer
            res = evaluate(problem, problem.index(degrees))
            mem.append(res["peak_memory_bytes"])
            time.append(res["iteration_time_s"])
        assert mem == sorted(mem) and len(set(mem)) == 4, (schedule, mem)
        assert time == sorted(time, reverse=True) and len(set(time)) == 4, (schedule, time)
        if schedule in ("off", "overlap"):
            none = evaluate(_problem(h2048, schedule, "none", degrees=[2]), [0] * 24)
            assert mem[-1] < none["peak_memory_bytes"]
            assert time[-1] > none["iteration_time_s"]
    with pytest.raises(OasesConfigError, match="goes with --recompute full"):
        _problem(h2048, "overlap", "selective", recompute_layers=3)
    for n in (0, 25):
        with pytest.raises(OasesConfigError, match=f"--recompute-num-layers {n} must be between 1"):
            _problem(h2048, "oases", "full", recompute_layers=n)


def test_auto_plans_block_recompute_where_it_pays(tmp_path, capsys, h2048):
    """22 GB: keeping the last 3 of 24 layers (cross-pass, first 21 recomputed) still fits at
    degree 2 and beats recomputing every layer; 20 recomputed layers need more than 22 GB there.
    One block entry per schedule whose full recompute fits; the flags parse as Megatron-LM's."""
    from helpers.runs import parse

    plan = choose_plan(h2048, PlanSettings(schedule="auto", global_batch_size=128, memory_gb=22))[0]
    assert (plan["schedule"], plan["recompute"], plan["recompute_num_layers"]) == (
        "cross-pass",
        "full",
        21,
    )
    block = "--recompute-granularity full --recompute-method block --recompute-num-layers 21"
    assert plan["launch_flags"] == f"--oases-schedule cross-pass {block}"
    alt = plan["alternatives"]
    full = next(t for t in alt if t["schedule"] == "cross-pass" and "recompute_num_layers" not in t)
    assert plan["predicted"]["iteration_time_s"] < full["iteration_time_s"]
    blocks = [t for t in alt if "recompute_num_layers" in t]
    assert all(t["fits"] and t["recompute"] == "full" for t in blocks)
    kinds = {
        (t["schedule"], t.get("split", "batch"))
        for t in alt
        if t["fits"] and t["recompute"] == "full"
    }
    assert sorted((t["schedule"], t.get("split", "batch")) for t in blocks) == sorted(kinds)
    with pytest.raises(NoPlanFits):
        make_plan(
            h2048,
            PlanSettings(
                global_batch_size=128,
                memory_gb=22,
                schedule="cross-pass",
                recompute="full",
                recompute_layers=20,
                degrees=[2],
            ),
        )
    assert any("first 21 layers" in line for line in alternatives_table(plan))
    args = parse(f"{plan['launch_flags']} --num-layers 24 --micro-batch-size 2")
    assert (args.recompute_method, args.recompute_num_layers) == ("block", 21)
    # the plan file keeps it; --evaluate predicts the same
    prof, path = tmp_path / "profile.json", tmp_path / "plan.json"
    prof.write_text(json.dumps(h2048.data))
    save_plan(plan, str(path))
    assert load_plan(str(path))["recompute_num_layers"] == 21
    assert oases(["plan", "--profile", str(prof), "--evaluate", str(path), "--quiet"]) == 0
    out = capsys.readouterr().out
    assert "(schedule cross-pass, first-21-layers full recompute)" in out
    assert f"predicted iteration {plan['predicted']['iteration_time_s'] * 1e3:.2f} ms" in out


def test_block_recompute_cli(tmp_path, capsys, h2048):
    prof = tmp_path / "profile.json"
    prof.write_text(json.dumps(h2048.data))
    one = ["plan", "--profile", str(prof), "--global-batch-size", "128", "--memory", "22"]
    out = tmp_path / "plan.json"
    argv = one + ["--schedule", "oases", "--recompute-num-layers", "23", "--out", str(out)]
    assert oases(argv + ["--quiet"]) == 0
    assert "oases, first-23-layers full recompute" in capsys.readouterr().out
    plan = load_plan(str(out))
    assert (plan["recompute"], plan["recompute_num_layers"]) == ("full", 23)
    assert oases(one + ["--schedule", "auto", "--recompute-num-layers", "3"]) == 2
    assert "drop --recompute-num-layers" in capsys.readouterr().err
    assert (
        oases(one + ["--schedule", "overlap", "--no-recompute", "--recompute-num-layers", "3"]) == 2
    )
    assert "--recompute-num-layers goes with --recompute full" in capsys.readouterr().err
