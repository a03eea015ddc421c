"""Profiler: measured profiles on 2 gloo ranks, caching, and the memory model against the measured
peaks (PP=1 and the two stages of PP=2)."""

import json

import pytest
from helpers import RECOMPUTE

from megatron_oases.cli import main as oases
from megatron_oases.formats.profile import Profile, load_profile
from megatron_oases.profiler import layer_math
from megatron_oases.profiler.model_config import model_args, read_model_file, shape_of

TINY = """
num_layers: 4
hidden_size: 64
num_attention_heads: 4
seq_length: 32
vocab_size: 256
tensor_model_parallel_size: 2
micro_batch_size: 4
global_batch_size: 8
"""


@pytest.fixture(scope="module")
def measured(tmp_path_factory):
    """One measured profile on 2 gloo ranks (tiny layer, degrees 1 and 2)."""
    d = tmp_path_factory.mktemp("measured")
    model = d / "tiny.yaml"
    model.write_text(TINY)
    out = d / "profile.json"
    rc = oases(
        [
            "profile",
            "--model",
            str(model),
            "--timeout",
            "300",
            "--repeats",
            "1",
            "--cache-dir",
            str(d / "cache"),
            "--out",
            str(out),
        ]
    )
    assert rc == 0
    return {"dir": d, "model": model, "out": out, "profile": load_profile(str(out))}


def test_measured_profile_contents(measured):
    prof = measured["profile"]
    data = prof.data
    assert data["kind"] == "measured" and prof.degrees == [1, 2] and prof.tp == 2
    assert data["hardware"]["world_size"] == 2 and data["cache_key"]
    # micro-batch 4, T=2: degree 1 groups see 2 samples (sub-batches 1), degree 2 sees 4 (2+2)
    for block in ("attention", "mlp"):
        for d, sizes in (("1", {1, 2}), ("2", {1, 2, 4})):
            for phase in ("forward_s", "recompute_s", "backward_s"):
                pts = data["compute"][block][d][phase]
                assert {n for n, _ in pts} == sizes
                assert all(t > 0 for _, t in pts)
    for kind in ("all_reduce", "all_gather"):
        fit = data["comm"][kind]["0,1"]
        assert fit["alpha_s"] >= 0 and fit["beta_s_per_byte"] >= 0 and len(fit["points"]) >= 3
    # parameters per rank counted on the real Megatron layer match the closed form (per degree)
    margs = model_args(read_model_file(str(measured["model"])))
    shape = shape_of(margs)
    for d in (1, 2):
        assert data["memory"]["state_bytes_per_layer"][str(d)] == pytest.approx(
            layer_math.layer_params(shape, d) * 16
        )
    # saved activations (saved_tensors_hooks) vs the Korthikanti-style count, fp32
    for d in (1, 2):
        measured_b = data["memory"]["layer_activation_bytes_per_sample"][str(d)]
        formula = layer_math.layer_activation_bytes(shape, d, 4)
        assert 0.5 * formula < measured_b < 2.0 * formula, (d, measured_b, formula)
    a1 = data["memory"]["layer_activation_bytes_per_sample"]["1"]
    a2 = data["memory"]["layer_activation_bytes_per_sample"]["2"]
    assert a2 < a1  # TP divides the attention/MLP intermediates
    # core attention's intermediates (what Megatron's selective recompute does not keep),
    # measured with the layer's own checkpoint switched on, vs the 5·a·s²/t-style count (fp32)
    for d in (1, 2):
        core = dict(data["memory"]["core_attention_activation_bytes"][str(d)])
        act = dict(data["memory"]["layer_activation_bytes"][str(d)])
        formula = layer_math.core_attention_activation_bytes(shape, d, 4)
        assert set(core) == set(act)
        for n, nbytes in core.items():
            assert 0.8 * formula * n < nbytes < 2.0 * formula * n, (d, n, nbytes, formula)
            assert nbytes < 0.5 * act[n]
        times = data["compute"]["attention"][str(d)]["core_attention_forward_s"]
        assert {n for n, _ in times} == set(core) and all(t > 0 for _, t in times)


def test_measured_profile_without_core_attention_fields(measured):
    """A measured profile from before the core-attention probes still loads and plans selective
    recompute: the bytes counted from the shape, the time the core's FLOP share of the measured
    attention forward."""
    import copy

    from megatron_oases.formats.profile import attention_flops_forward
    from megatron_oases.planner.prediction import predict
    from megatron_oases.planner.settings import PlanSettings

    data = copy.deepcopy(measured["profile"].data)
    del data["memory"]["core_attention_activation_bytes"]
    del data["memory"]["core_attention_activation_bytes_per_sample"]
    for per_degree in data["compute"]["attention"].values():
        del per_degree["core_attention_forward_s"]
    old, new = Profile(data), measured["profile"]
    shape = data["model"]
    for d in (1, 2):
        formula = layer_math.core_attention_activation_bytes(shape, d, 4)
        assert old.core_attention_activation(d, 2) == pytest.approx(2 * formula)
        f = attention_flops_forward(shape, d)
        share = (f["core"] + f["softmax"]) / sum(f.values())
        assert 0.1 < share < 0.9
        fwd = old.compute_time("attention", "forward_s", d, 2)
        assert old.core_attention_time(d, 2) == pytest.approx(share * fwd)
        measured_core = dict(new.data["compute"]["attention"][str(d)]["core_attention_forward_s"])
        assert new.core_attention_time(d, 2) == pytest.approx(measured_core[2])
    for profile in (old, new):
        res = {
            mode: predict(
                profile,
                [2] * 4,
                PlanSettings(
                    schedule="off", global_batch_size=8, micro_batch_size=4, recompute=mode
                ),
            )
            for mode in ("none", "selective", "full")
        }
        peak = {mode: r["peak_memory_bytes"] for mode, r in res.items()}
        assert peak["full"] < peak["selective"] < peak["none"]
        assert res["selective"]["backward_s"] > res["none"]["backward_s"]


def test_measured_profile_is_cached_and_plannable(measured, capsys):
    d = measured["dir"]
    out2 = d / "again.json"
    rc = oases(
        [
            "profile",
            "--model",
            str(measured["model"]),
            "--repeats",
            "1",
            "--cache-dir",
            str(d / "cache"),
            "--out",
            str(out2),
        ]
    )
    assert rc == 0 and "(cache)" in capsys.readouterr().out
    a, b = json.loads(measured["out"].read_text()), json.loads(out2.read_text())
    assert a["cache_key"] == b["cache_key"] and a["compute"] == b["compute"]
    plan = d / "plan.json"
    assert (
        oases(
            [
                "plan",
                "--profile",
                str(measured["out"]),
                "--global-batch-size",
                "8",
                "--memory",
                "1",
                "--schedule",
                "oases",
                "--verify",
                "--out",
                str(plan),
            ]
        )
        == 0
    )
    p = json.loads(plan.read_text())
    assert len(p["degrees"]) == 4 and set(p["degrees"]) <= {1, 2}
    assert p["verify"]["agree"] is True and p["profile_kind"] == "measured"


#: (degrees, schedule, recompute[, recomputed layers]): each schedule × recompute setting once,
#: with per-layer degrees where they run, and block recompute per schedule. Each configuration is
#: a Megatron job on 2 ranks; 9 more were dropped for the suite's time (2026-11-28), each a
#: repeat of a setting kept here with a wider margin when last measured (predicted above
#: measured by: 1111-off-full +25.8 %, 1221-off-selective +15.8, 2222-overlap-full +27.1,
#: 2222-overlap-selective +10.3, 2222-cross-pass-full +29.6, 2222-oases-full +22.5, 1111-oases-full
#: +51.4, sequence overlap-full +31.6, sequence cross-pass-full +34.4).
MEMORY_PLANS = [
    ([2, 2, 2, 2], "off", "full"),
    ([2, 2, 2, 2], "off", "none"),
    ([1, 2, 2, 1], "off", "none"),
    ([2, 2, 2, 2], "off", "selective"),
    ([2, 1, 1, 2], "overlap", "full"),
    ([2, 1, 1, 2], "overlap", "selective"),
    ([1, 1, 2, 2], "cross-pass", "full"),
    ([2, 1, 1, 2], "oases", "full"),
    # Megatron's block recompute: only the first N of the 4 layers recomputed
    ([2, 2, 2, 2], "off", "full", 2),
    ([2, 2, 2, 2], "overlap", "full", 3),
    ([2, 1, 1, 2], "cross-pass", "full", 2),
    ([2, 2, 2, 2], "oases", "full", 1),
]
#: sequence chunks (--oases-split sequence; uniform T, no --oases-plan): (schedule, recompute)
SEQUENCE_PLANS = [
    ("overlap", "none"),
    ("overlap", "selective"),
    ("oases", "full"),
]


@pytest.mark.timeout(600)
def test_memory_model_never_under_predicts_measured_peak(measured, tmp_path):
    """Issue 5: the planner's activation memory (fixed + saved + worst layer's runtime peak) is
    never more than 5 % below the LiveTensorMeter peak of a real forward+backward, per plan and
    schedule, sequence chunks included (state excluded on both sides: it is counted exactly from
    parameter counts)."""
    from helpers.runs import activation_peaks

    from megatron_oases.formats.plan import save_plan, uniform_plan
    from megatron_oases.launch import run_distributed
    from megatron_oases.planner.choose import RECOMPUTE_FLAGS
    from megatron_oases.planner.prediction import predict
    from megatron_oases.planner.settings import PlanSettings
    from megatron_oases.recompute_settings import block_argv

    flags = (
        "--num-layers 4 --hidden-size 64 --num-attention-heads 4 --seq-length 32 "
        "--max-position-embeddings 32 --vocab-size 256 --tensor-model-parallel-size 2 "
        "--micro-batch-size 4 --global-batch-size 8 --mock-data --seed 1234"
    )
    configs, predicted = [], {}
    for i, (degrees, schedule, recompute, *block) in enumerate(MEMORY_PLANS):
        plan = uniform_plan(4, 2, 1, schedule=schedule, global_batch_size=8, micro_batch_size=4)
        plan["degrees"] = degrees
        path = str(tmp_path / f"plan{i}.json")
        save_plan(plan, path)
        layers = block[0] if block else None
        name = f"{''.join(map(str, degrees))}-{schedule}-{recompute}" + (
            f"{layers}" if block else ""
        )
        argv = f"{flags} --oases-plan {path} --oases-schedule {schedule}"
        rflags = " ".join(block_argv(layers)) if block else RECOMPUTE_FLAGS[recompute]
        configs.append((name, f"{argv} {rflags}"))
        bd = predict(
            measured["profile"],
            degrees,
            PlanSettings(
                schedule=schedule,
                global_batch_size=8,
                micro_batch_size=4,
                recompute=recompute,
                recompute_layers=layers,
            ),
        )["memory_breakdown_bytes"]
        predicted[name] = bd["fixed_activations"] + bd["saved_activations"]
        predicted[name] += bd["runtime_peak_layer"]
    for schedule, recompute in SEQUENCE_PLANS:
        name = f"2222-{schedule}-{recompute}-sequence"
        argv = f"{flags} --oases-schedule {schedule} --oases-split sequence"
        configs.append((name, f"{argv} {RECOMPUTE_FLAGS[recompute]}"))
        bd = predict(
            measured["profile"],
            [2] * 4,
            PlanSettings(
                schedule=schedule,
                global_batch_size=8,
                micro_batch_size=4,
                recompute=recompute,
                split="sequence",
            ),
        )["memory_breakdown_bytes"]
        predicted[name] = bd["fixed_activations"] + bd["saved_activations"]
        predicted[name] += bd["runtime_peak_layer"]
    per_rank = run_distributed(activation_peaks, 2, configs, timeout=560)
    rows = []
    for name, _ in configs:
        meas = max(p[name] for p in per_rank)
        rows.append((name, predicted[name] / meas - 1))
    print("\n".join(f"{n}: predicted {100 * e:+.1f} % vs measured" for n, e in rows))
    assert all(e >= -0.05 for _, e in rows), rows
    # selective recompute lies between keeping everything and full recompute, measured and
    # predicted alike
    peak = {name: max(p[name] for p in per_rank) for name, _ in configs}
    for table in (peak, predicted):
        assert table["2222-off-full"] < table["2222-off-selective"] < table["2222-off-none"]
        # and so does block recompute of 2 of the 4 layers
        assert table["2222-off-full"] < table["2222-off-full2"] < table["2222-off-none"]
    # and not uselessly pessimistic either
    assert all(e <= 1.0 for _, e in rows), rows


@pytest.mark.timeout(400)
def test_memory_model_pipeline_stages(measured, tmp_path):
    """PP=2 (1F1B, 4 micro-batches): stage 0 keeps two micro-batches' checkpoints, stage 1 one;
    the per-stage predictions never under-predict the measured per-stage peak by > 5 %."""
    import copy

    from helpers.runs import activation_peaks

    from megatron_oases.formats.profile import Profile
    from megatron_oases.launch import run_distributed
    from megatron_oases.planner.prediction import predict
    from megatron_oases.planner.settings import PlanSettings

    data = copy.deepcopy(measured["profile"].data)
    data["pipeline_model_parallel_size"] = 2
    profile = Profile(data)
    flags = (
        "--num-layers 4 --hidden-size 64 --num-attention-heads 4 --seq-length 32 "
        "--max-position-embeddings 32 --vocab-size 256 --tensor-model-parallel-size 2 "
        "--pipeline-model-parallel-size 2 --micro-batch-size 2 --global-batch-size 8 "
        f"--mock-data --seed 1234 {RECOMPUTE}"
    )
    configs = [(s, f"{flags} --oases-schedule {s}") for s in ("off", "oases")]
    per_rank = run_distributed(activation_peaks, 4, configs, timeout=380)
    for schedule, _ in configs:
        res = predict(
            profile,
            [2] * 4,
            PlanSettings(
                schedule=schedule, global_batch_size=8, micro_batch_size=2, recompute=True
            ),
        )
        for stage, ranks in ((0, (0, 1)), (1, (2, 3))):
            bd = res["stages"][stage]["memory_breakdown_bytes"]
            pred = bd["fixed_activations"] + bd["saved_activations"] + bd["runtime_peak_layer"]
            meas = max(per_rank[r][schedule] for r in ranks)
            print(f"{schedule} stage {stage}: predicted {pred / meas - 1:+.1%} vs measured")
            assert pred >= 0.95 * meas, (schedule, stage, pred, meas)
            assert pred <= 2.0 * meas, (schedule, stage, pred, meas)
