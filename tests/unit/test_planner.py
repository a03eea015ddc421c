"""Planner: cost model (eq. 3–4, 6), ILP == DP == brute force, plan files, ``oases plan`` end to end."""

import copy
import json
import math

import numpy as np
import pytest
from helpers.brute import solve_brute
from helpers.random_instances import random_problem
from helpers.variants import MODELS, h2048_profile

from megatron_oases.cli import main as oases
from megatron_oases.errors import OasesConfigError
from megatron_oases.formats.plan import load_plan, save_plan, uniform_plan, validate_plan
from megatron_oases.formats.profile import Profile
from megatron_oases.planner import api
from megatron_oases.planner.build import build_problem
from megatron_oases.planner.dp import min_memory, solve_dp
from megatron_oases.planner.ilp import solve_ilp
from megatron_oases.planner.prediction import predict
from megatron_oases.planner.problem import Block, ChainProblem, enumerate_assignments
from megatron_oases.planner.settings import PlanSettings
from megatron_oases.planner.time_model import decompose, evaluate, objective
from megatron_oases.validation import TAIL_PIECES


@pytest.fixture(scope="module")
def h2048():
    """The paper's H=2048, L=24 model (Table 4) on the analytic NVLink-3090 cluster."""
    return h2048_profile("rtx3090-nvlink")


# ----------------------------------------------------------------------------- eq. (3) and (4) by hand
def _one_block_layer_problem(comp, comm, gather, subs=2):
    """Two layers, one block each (forward chain only), two candidate degrees."""
    L, K = 2, 2
    fwd = [[Block(l, "b", np.array(comp[l]), np.array(comm[l])) for l in range(L)]]
    return ChainProblem(
        degrees=[1, 2],
        num_layers=L,
        subs=subs,
        forward=fwd,
        backward=[],
        gather_fwd=np.array([gather]),
        gather_bwd=np.zeros((1, K, K)),
        boundary=np.zeros((L, K)),
        repeats=1,
        mem_add=np.zeros((L, K)),
        mem_runtime=np.zeros((L, K)),
        mem_fixed=0.0,
        margin=0.0,
        granule=1.0,
    )


def test_eq3_two_subbatch_max_terms_by_hand():
    # comp[layer][sub][k], comm[layer][sub][k]
    comp = [[[3.0, 1.0], [2.0, 1.0]], [[1.0, 5.0], [4.0, 2.0]]]
    comm = [[[2.5, 0.5], [1.5, 0.7]], [[0.2, 0.3], [0.9, 0.4]]]
    p = _one_block_layer_problem(comp, comm, [[0.0, 10.0], [10.0, 0.0]])
    # both layers at degree index 0: T_V = d0^0 + max(d1^0, c0^1) + max(d0^1, c0^0)
    #                                          + max(d1^1, c1^0) + c1^1
    expect = 3.0 + max(1.0, 1.5) + max(2.0, 2.5) + max(4.0, 0.2) + 0.9
    assert evaluate(p, [0, 0])["iteration_time_s"] == pytest.approx(expect)
    # degree grows 0 -> 1 in forward: blocking gather 10, the max becomes a sum (eq. 4)
    expect = 3.0 + (1.5 + 10.0 + 5.0) + max(2.0, 2.5) + max(2.0, 0.3) + 0.4
    res = evaluate(p, [0, 1])
    assert res["iteration_time_s"] == pytest.approx(expect)
    assert res["edges_s"] == pytest.approx(10.0 + min(5.0, 1.5))
    # degree shrinks 1 -> 0 in forward: no gather in this pass, overlap kept
    expect = 1.0 + max(1.0, 0.7) + max(1.0, 0.5) + max(4.0, 0.2) + 0.9
    assert evaluate(p, [1, 0])["iteration_time_s"] == pytest.approx(expect)
    # one sub-batch (schedule off): compute + comm, gather when growing
    p1 = _one_block_layer_problem(
        [[[3.0, 1.0]], [[1.0, 5.0]]], [[[2.5, 0.5]], [[0.2, 0.3]]], [[0, 10.0], [10.0, 0]], subs=1
    )
    assert evaluate(p1, [0, 1])["iteration_time_s"] == pytest.approx(3.0 + 2.5 + 10.0 + 5.0 + 0.3)


def test_decomposition_matches_direct_walk():
    rng = np.random.default_rng(7)
    for _ in range(40):
        p = random_problem(rng, int(rng.integers(1, 6)), memory="none")
        U, P = decompose(p)
        for ks in list(enumerate_assignments(p))[:60]:
            assert objective(U, P, ks) == pytest.approx(evaluate(p, ks)["iteration_time_s"])


# ----------------------------------------------------------------------------- solvers agree
def test_ilp_dp_brute_agree_on_random_instances():
    rng = np.random.default_rng(2024)
    seen = {"infeasible": 0, "memory_binding": 0, "pinned": 0, "switch_limited": 0}
    for i in range(40):
        p = random_problem(rng, int(rng.integers(1, 7)))
        b, d, il = solve_brute(p), solve_dp(p), solve_ilp(p)
        assert b.status == d.status == il.status, (i, b.status, d.status, il.status)
        if not b.feasible:
            seen["infeasible"] += 1
            continue
        assert d.objective == pytest.approx(b.objective, rel=1e-9, abs=1e-12), i
        assert il.objective == pytest.approx(b.objective, rel=1e-7, abs=1e-9), i
        for sol in (d, il):
            assert p.feasible(sol.ks)
            _, _, _, budget = p.quantized()
            if budget is not None:
                assert p.peak_memory_granules(sol.ks) <= budget
        free = solve_dp(random_problem_copy(p))
        if free.objective < b.objective - 1e-12:
            seen["memory_binding"] += 1
        seen["pinned"] += int(not p.allowed.all())
        seen["switch_limited"] += int(p.max_switches is not None)
    # the sample exercises every constraint
    assert all(v >= 3 for v in seen.values()), seen


def random_problem_copy(p):
    """The same instance without a memory limit."""
    import copy

    q = copy.copy(p)
    q.memory_bytes = math.inf
    return q


def test_ilp_uses_no_deprecated_pulp_api():
    """PuLP 3 warns (once per variable) that ``PULP_CBC_CMD`` and ``LpVariable(...)`` go in PuLP 4.0:
    solves with every constraint kind must emit no PuLP warning at all."""
    import warnings

    rng = np.random.default_rng(7)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(6):
            p = random_problem(rng, 4)
            assert solve_ilp(p).status == solve_dp(p).status
    pulp_warnings = [
        f"{w.filename}: {w.message}"
        for w in caught
        if "pulp" in w.filename.lower()
        or "pulp" in str(w.message).lower()
        or "4.0" in str(w.message)
    ]
    assert not pulp_warnings, pulp_warnings


def test_ilp_without_cbc_is_a_config_error(monkeypatch):
    """No CBC binary (PuLP >= 4 without cbcbox, or a broken install): one clear error, not a
    PuLP traceback from inside the solve."""
    import pulp

    monkeypatch.setattr(pulp.COIN_CMD, "available", lambda self: False)
    with pytest.raises(OasesConfigError, match="--solver dp"):
        solve_ilp(random_problem(np.random.default_rng(0), 3))


def test_tests_can_fail_on_a_wrong_cost_model():
    """Brute force uses the direct walk; a decomposition that drops eq. (4)'s lost overlap differs."""
    rng = np.random.default_rng(3)
    found = False
    for _ in range(30):
        p = random_problem(
            rng, 4, subs=2, backward="oases", memory="none", pins=False, switches=False
        )
        U, P = decompose(p)
        wrong = P - np.where(P > 0, 1e-3, 0.0)  # perturb pair terms
        for ks in enumerate_assignments(p):
            if any(a != b for a, b in zip(ks, ks[1:])):
                if abs(objective(U, wrong, ks) - evaluate(p, ks)["iteration_time_s"]) > 1e-6:
                    found = True
                    break
        if found:
            break
    assert found


def test_memory_dp_handles_tight_homogeneous_chain(h2048):
    free = build_problem(h2048, PlanSettings(schedule="oases", global_batch_size=128))
    need = min_memory(free)
    all2 = free.peak_memory_bytes([1] * 24)
    mem_gb = (need + 0.5 * (all2 - need)) * 1.1 / 1e9
    p = build_problem(
        h2048, PlanSettings(schedule="oases", global_batch_size=128, memory_gb=mem_gb)
    )
    d = solve_dp(p)
    assert d.status == "optimal" and d.info["path"] == "memory-dp"
    degs = [p.degrees[k] for k in d.ks]
    assert set(degs) == {2, 4}  # a mixed plan, as in the paper's Table 6
    assert p.peak_memory_bytes(d.ks) * 1.1 <= mem_gb * 1e9
    il = solve_ilp(p, time_limit_s=120)
    assert il.status == "optimal" and il.objective == pytest.approx(d.objective, rel=1e-7)


def test_the_forward_ends_on_a_piece_of_its_last_block(h2048):
    """The split schedules charge 1/TAIL_PIECES of the last block's all-reduce at the forward's
    end (the runtime's pieces), whole all-reduces everywhere else; stock and SP: no pieces."""
    for schedule in ("overlap", "cross-pass", "oases"):
        p = build_problem(h2048, PlanSettings(schedule=schedule, global_batch_size=128))
        last = p.forward[0][-1]
        assert np.allclose(last.exposed_tail(), last.comm[1] / TAIL_PIECES), schedule
        assert all(b.tail is None for seg in p.backward for b in seg)
        assert all(b.tail is None for b in p.forward[0][:-1])
        k = len(p.degrees) - 1  # the largest degree (degree 1 communicates nothing)
        ks = [k] * p.num_layers
        whole = copy.deepcopy(p)
        whole.forward[0][-1].tail = None
        saved = p.repeats * (last.comm[1, k] - last.exposed_tail()[k])
        got = evaluate(whole, ks)["iteration_time_s"] - evaluate(p, ks)["iteration_time_s"]
        assert saved > 0 and got == pytest.approx(saved), schedule
    assert (
        build_problem(h2048, PlanSettings(schedule="off", global_batch_size=128))
        .forward[0][-1]
        .tail
        is None
    )


# ----------------------------------------------------------------------------- cost model on profiles
def test_predict_schedules_and_memory(h2048):
    res = {
        s: predict(h2048, [4] * 24, PlanSettings(schedule=s, global_batch_size=128))
        for s in ("off", "overlap", "cross-pass", "oases")
    }
    for r in res.values():
        assert set(r) >= {
            "iteration_time_s",
            "forward_s",
            "backward_s",
            "edges_s",
            "peak_memory_bytes",
        }
        assert r["iteration_time_s"] > 0 and r["peak_memory_bytes"] > 0
    t = {s: r["iteration_time_s"] for s, r in res.items()}
    assert t["oases"] < t["cross-pass"] <= t["overlap"] < t["off"]
    # fine-grained recompute saves two block inputs per layer instead of one layer input
    assert res["oases"]["peak_memory_bytes"] > res["cross-pass"]["peak_memory_bytes"]
    # TP-aware memory: lower degree, more parameter state per rank
    assert (
        predict(h2048, [1] * 24, PlanSettings(schedule="oases", global_batch_size=128))[
            "peak_memory_bytes"
        ]
        > res["oases"]["peak_memory_bytes"]
    )
    # predict agrees with the plan's own prediction for a mixed plan
    mixed = [2] * 8 + [4] * 16
    a = predict(
        h2048, mixed, PlanSettings(schedule="oases", global_batch_size=128, micro_batch_size=16)
    )
    assert (
        a["edges_s"]
        > predict(
            h2048,
            [2] * 24,
            PlanSettings(schedule="oases", global_batch_size=128, micro_batch_size=16),
        )["edges_s"]
    )
    assert len(a["per_layer"]) == 24


def test_build_problem_rejects_bad_inputs(h2048):
    with pytest.raises(OasesConfigError, match="not a positive multiple"):
        build_problem(h2048, PlanSettings(global_batch_size=100))
    with pytest.raises(OasesConfigError, match="does not divide"):
        build_problem(h2048, PlanSettings(global_batch_size=128, micro_batch_size=3))
    with pytest.raises(OasesConfigError, match="needs ≥ 2 to split"):
        build_problem(
            h2048, PlanSettings(global_batch_size=128, micro_batch_size=4, degrees=[1, 4])
        )
    for recompute in (False, "none"):  # the older bool, and the setting's name
        with pytest.raises(
            OasesConfigError, match="merges recompute with backward; use --recompute full"
        ):
            build_problem(
                h2048, PlanSettings(global_batch_size=128, schedule="oases", recompute=recompute)
            )
    with pytest.raises(OasesConfigError, match="out of range"):
        build_problem(h2048, PlanSettings(global_batch_size=128, pins=[([30], 4)]))


# ----------------------------------------------------------------------------- plan files
def test_plan_json_round_trip(tmp_path, h2048):
    plan, problem, sol = api.make_plan(
        h2048, PlanSettings(global_batch_size=128, memory_gb=18), verify=True
    )
    path = tmp_path / "plan.json"
    save_plan(plan, path)
    back = load_plan(path, num_layers=24, tensor_model_parallel_size=4)
    assert back == json.loads(json.dumps(plan))
    for key in (
        "version",
        "tensor_model_parallel_size",
        "degrees",
        "schedule",
        "global_batch_size",
        "micro_batch_size",
        "predicted",
        "objective",
        "solver",
        "solve_time_s",
        "status",
        "input_hash",
        "profile",
    ):
        assert key in back
    for key in (
        "iteration_time_s",
        "forward_s",
        "backward_s",
        "edges_s",
        "peak_memory_bytes_per_rank",
        "per_layer",
    ):
        assert key in back["predicted"]
    assert back["solver"] == "dp" and back["verify"]["agree"] is True
    # the degrees line stays one editable line
    assert any(
        line.strip().startswith('"degrees": [') and line.strip().endswith("],")
        for line in path.read_text().splitlines()
    )
    # same inputs, same hash
    plan2, _, _ = api.make_plan(h2048, PlanSettings(global_batch_size=128, memory_gb=18))
    assert plan2["input_hash"] == plan["input_hash"] and plan2["degrees"] == plan["degrees"]


@pytest.mark.parametrize(
    "degrees,T,layers,match",
    [
        ([4, 4, 4], 4, 4, "3 entries but the model has 4 layers"),
        ([4, 8, 4], 4, None, "exceeds tensor_model_parallel_size 4"),
        ([2, 4, 2], 6, None, "does not divide tensor_model_parallel_size 6"),
        ([2, 3, 2], 4, None, "not a power of two"),
        ([2, 0], 4, None, "not a positive integer"),
        ([2, "2"], 4, None, "not a positive integer"),
    ],
)
def test_load_plan_rejects(tmp_path, degrees, T, layers, match):
    path = tmp_path / "bad.json"
    path.write_text(json.dumps({"version": 1, "tensor_model_parallel_size": T, "degrees": degrees}))
    with pytest.raises(OasesConfigError, match=match) as exc:
        load_plan(path, num_layers=layers)
    assert "\n" not in str(exc.value)


def test_load_plan_other_errors(tmp_path):
    p = tmp_path / "p.json"
    p.write_text("{not json")
    with pytest.raises(OasesConfigError, match="not valid JSON"):
        load_plan(p)
    with pytest.raises(OasesConfigError, match="not found"):
        load_plan(tmp_path / "missing.json")
    p.write_text(json.dumps(uniform_plan(4, 4, 2)))
    with pytest.raises(OasesConfigError, match="--tensor-model-parallel-size is 8"):
        load_plan(p, tensor_model_parallel_size=8)
    with pytest.raises(OasesConfigError, match="unsupported plan version"):
        validate_plan({"version": 2, "tensor_model_parallel_size": 4, "degrees": [4]})


def test_uniform_plan_is_a_valid_plan(tmp_path):
    plan = uniform_plan(6, 4, schedule="oases", global_batch_size=8, micro_batch_size=4)
    assert plan["degrees"] == [4] * 6
    save_plan(plan, tmp_path / "u.json")
    assert load_plan(tmp_path / "u.json", num_layers=6, tensor_model_parallel_size=4) == plan
    assert uniform_plan(3, 8, 2)["degrees"] == [2, 2, 2]
    with pytest.raises(OasesConfigError):
        uniform_plan(3, 4, 3)


# ----------------------------------------------------------------------------- CLI end to end
def test_cli_profile_plan_end_to_end(tmp_path, capsys):
    prof = tmp_path / "profile.json"
    assert (
        oases(
            [
                "profile",
                "--model",
                f"{MODELS}:h2048",
                "--analytic",
                "--cluster",
                "rtx3090-nvlink",
                "--out",
                str(prof),
            ]
        )
        == 0
    )
    out = tmp_path / "plan.json"
    rc = oases(
        [
            "plan",
            "--profile",
            str(prof),
            "--global-batch-size",
            "128",
            "--memory",
            "18",
            "--verify",
            "--out",
            str(out),
        ]
    )
    assert rc == 0
    text = capsys.readouterr().out
    assert "runner-up" in text and "verified: ILP" in text and "speedup" in text
    plan = load_plan(out, num_layers=24, tensor_model_parallel_size=4)
    assert set(plan["degrees"]) == {2, 4} and plan["status"] == "optimal"

    # user control: candidate degrees, pins, switch limit
    out2 = tmp_path / "plan2.json"
    assert (
        oases(
            [
                "plan",
                "--profile",
                str(prof),
                "--global-batch-size",
                "128",
                "--memory",
                "24",
                "--degrees",
                "2,4",
                "--pin",
                "0-3=4",
                "--pin",
                "20=4",
                "--max-switches",
                "1",
                "--solver",
                "ilp",
                "--quiet",
                "--out",
                str(out2),
            ]
        )
        == 0
    )
    plan2 = load_plan(out2)
    d = plan2["degrees"]
    assert d[:4] == [4, 4, 4, 4] and d[20] == 4 and set(d) <= {2, 4}
    assert sum(a != b for a, b in zip(d, d[1:])) <= 1
    assert plan2["solver"] == "ilp"

    # re-predict an edited plan
    edited = json.loads(out2.read_text())
    edited["degrees"] = [2] * 12 + [4] * 12
    (tmp_path / "edited.json").write_text(json.dumps(edited))
    assert (
        oases(
            ["plan", "--profile", str(prof), "--evaluate", str(tmp_path / "edited.json"), "--quiet"]
        )
        == 0
    )
    assert "[2]*12 + [4]*12" in capsys.readouterr().out


def test_cli_infeasible_reports_smallest_memory(tmp_path, capsys, h2048):
    prof = tmp_path / "profile.json"
    prof.write_text(json.dumps(h2048.data))
    rc = oases(
        ["plan", "--profile", str(prof), "--global-batch-size", "128", "--memory", "8", "--quiet"]
    )
    assert rc == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1
    assert "no plan fits in 8.00 GB" in err and "the smallest memory that fits is" in err
    need = float(err.rsplit("is ", 1)[1].split()[0])
    assert (
        oases(
            [
                "plan",
                "--profile",
                str(prof),
                "--global-batch-size",
                "128",
                "--memory",
                f"{need + 0.01:.2f}",
                "--quiet",
            ]
        )
        == 0
    )
    assert (
        oases(
            [
                "plan",
                "--profile",
                str(prof),
                "--global-batch-size",
                "128",
                "--memory",
                f"{need - 0.05:.2f}",
                "--quiet",
            ]
        )
        == 2
    )
    capsys.readouterr()
    # contradictory pins and switch limit
    rc = oases(
        [
            "plan",
            "--profile",
            str(prof),
            "--global-batch-size",
            "128",
            "--memory",
            "24",
            "--pin",
            "0=2",
            "--pin",
            "1=4",
            "--max-switches",
            "0",
            "--quiet",
        ]
    )
    assert rc == 2 and "--pin and --max-switches" in capsys.readouterr().err


def test_cli_user_errors(tmp_path, capsys, h2048):
    prof = tmp_path / "profile.json"
    prof.write_text(json.dumps(h2048.data))
    base = ["plan", "--profile", str(prof), "--global-batch-size", "128", "--quiet"]
    for extra, match in (
        (["--pin", "0-x=4"], "bad --pin"),
        (["--degrees", "1,3"], "not a power of two"),
        (["--degrees", "8"], "not in the profile"),
        (["--memory", "-1"], "must be positive"),
    ):
        assert oases(base + extra) == 2
        assert match in capsys.readouterr().err
    assert (
        oases(["plan", "--profile", str(tmp_path / "nope.json"), "--global-batch-size", "8"]) == 2
    )
    assert "not found" in capsys.readouterr().err


def test_allow_unsplit_and_distributed_optimizer(h2048):
    # micro-batch 4 with T=4: a degree-1 group gets one sample and cannot be split in two
    with pytest.raises(OasesConfigError, match="needs ≥ 2 to split"):
        build_problem(h2048, PlanSettings(global_batch_size=32, degrees=[1, 4]))
    p = build_problem(h2048, PlanSettings(global_batch_size=32, degrees=[1, 4], allow_unsplit=True))
    assert p.meta["unsplit_degrees"] == [1]
    for passes in (p.forward, p.backward):
        for seg in passes:
            for blk in seg:
                assert blk.comp[1, 0] == 0.0 and blk.comm[1, 0] == 0.0  # empty second sub-batch
    # sharded Adam state: less memory, more so for low degrees (more data-parallel replicas)
    rep = build_problem(h2048, PlanSettings(global_batch_size=128))
    dist = build_problem(h2048, PlanSettings(global_batch_size=128, distributed_optimizer=True))
    k1, k4 = rep.degrees.index(1), rep.degrees.index(4)
    assert dist.mem_add[0, k1] < rep.mem_add[0, k1] and dist.mem_add[0, k4] < rep.mem_add[0, k4]
    assert rep.mem_add[0, k1] - dist.mem_add[0, k1] > rep.mem_add[0, k4] - dist.mem_add[0, k4]
    # optimizer share per rank = 12 B / param / (D·T/d)
    params = h2048.mem("params_per_layer", 4)
    saved = rep.mem_add[0, k4] - dist.mem_add[0, k4]
    assert saved == pytest.approx(params * 12 * (1 - 1 / (8 * 4 // 4)))


def test_plan_summary_reports_memory_breakdown(h2048):
    plan, problem, sol = api.make_plan(h2048, PlanSettings(global_batch_size=128, memory_gb=24))
    bd = plan["predicted"]["memory_breakdown_bytes"]
    parts = sum(v for k, v in bd.items() if k not in ("total", "runtime_peak_at_layer"))
    assert (
        parts
        == pytest.approx(bd["total"])
        == pytest.approx(plan["predicted"]["peak_memory_bytes_per_rank"])
    )


# ----------------------------------------------------------------------------- pipeline parallelism
def test_pipeline_parallel_plans_one_stage_with_1f1b_costs(h2048):
    """PP=2: the chain is one stage (12 of 24 layers), the iteration pays the 1F1B bubble
    (M + P − 1 stage slots) and stage 0 holds min(P, M) micro-batches' saved activations."""
    import copy

    data = copy.deepcopy(h2048.data)
    data["pipeline_model_parallel_size"] = 2
    pp2 = Profile(data)
    mb = 4
    M = 128 // h2048.dp // mb
    assert M >= 2
    one = build_problem(h2048, PlanSettings(global_batch_size=128, micro_batch_size=mb))
    two = build_problem(pp2, PlanSettings(global_batch_size=128, micro_batch_size=mb))
    last = build_problem(pp2, PlanSettings(global_batch_size=128, micro_batch_size=mb), stage=1)
    assert (one.num_layers, two.num_layers) == (24, 12)
    assert (one.repeats, two.repeats) == (M, M + 1)
    assert two.meta["in_flight_microbatches"] == 2 and last.meta["in_flight_microbatches"] == 1
    saved = lambda pb: pb.meta["memory_parts"]["saved"]  # noqa: E731
    assert np.allclose(saved(two), 2 * saved(last))
    # a stage's per-micro-batch time is about half the whole chain's (half as many layers; the
    # two-sub-batch chain's fill and drain terms do not halve)
    ks1, ks2 = [one.degrees.index(4)] * 24, [two.degrees.index(4)] * 12
    per_mb = (
        lambda pb, ks: (evaluate(pb, ks)["forward_s"] + evaluate(pb, ks)["backward_s"]) / pb.repeats
    )  # noqa: E731,E501
    fixed = one.fixed_forward_s + one.fixed_backward_s
    assert per_mb(two, ks2) - fixed == pytest.approx((per_mb(one, ks1) - fixed) / 2, rel=0.02)
    res = predict(
        pp2, [4] * 24, PlanSettings(schedule="oases", global_batch_size=128, micro_batch_size=mb)
    )
    assert len(res["stages"]) == 2
    assert res["stages"][0]["peak_memory_bytes"] > res["stages"][1]["peak_memory_bytes"]
    assert res["peak_memory_bytes"] == res["stages"][0]["peak_memory_bytes"]
    with pytest.raises(OasesConfigError, match="split evenly"):
        predict(
            pp2,
            [4] * 23,
            PlanSettings(schedule="oases", global_batch_size=128, micro_batch_size=mb),
        )
    # the plan file covers every layer: the planned stage repeated on each stage
    plan, problem, _ = api.make_plan(
        pp2, PlanSettings(global_batch_size=128, micro_batch_size=mb, memory_gb=24)
    )
    assert plan["pipeline_model_parallel_size"] == 2 and plan["num_layers"] == 24
    assert plan["degrees"][:12] == plan["degrees"][12:] and len(plan["degrees"]) == 24
    validate_plan(plan, num_layers=24, tensor_model_parallel_size=4)


def test_cli_plans_and_evaluates_a_pipeline_parallel_model(tmp_path, capsys):
    prof, plan = str(tmp_path / "pp2.json"), str(tmp_path / "plan.json")
    common = ["--model", f"{MODELS}:h2048", "--analytic", "--cluster", "rtx3090-nvlink"]
    assert (
        oases(["profile", *common, "--set", "pipeline_model_parallel_size=2", "--out", prof]) == 0
    )
    assert oases(["plan", "--profile", prof, "--global-batch-size", "128", "--memory", "24",
                  "--quiet", "--out", plan]) == 0  # fmt: skip
    written = json.load(open(plan))
    assert written["pipeline_model_parallel_size"] == 2 and len(written["degrees"]) == 24
    capsys.readouterr()
    assert oases(["plan", "--profile", prof, "--evaluate", plan, "--quiet"]) == 0
    out = capsys.readouterr().out
    ms = float(out.split("predicted iteration ")[1].split(" ms")[0])
    assert ms == pytest.approx(1e3 * written["predicted"]["iteration_time_s"], rel=1e-4)
