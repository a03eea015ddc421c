"""``oases plan --schedule auto``: the schedule and recompute setting chosen with the degrees."""

import json

import pytest

from megatron_oases.cli import main as oases
from megatron_oases.formats.plan import load_plan
from megatron_oases.formats.profile import Profile
from megatron_oases.planner.api import NoPlanFits, make_plan
from megatron_oases.planner.choose import SETTINGS, choose_plan
from megatron_oases.profiler.analytic import analytic_profile
from megatron_oases.profiler.model_config import model_args, read_model_file


@pytest.fixture(scope="module")
def h2048():
    """The paper's H=2048, L=24 model (Table 4) on the analytic NVLink-3090 cluster."""
    margs = model_args(read_model_file("benchmarks/planner/models.yaml:h2048"))
    return Profile(analytic_profile(margs, "rtx3090-nvlink"))


def _fits(profile, schedule, recompute, memory_gb):
    try:
        return make_plan(
            profile, global_batch_size=128, memory_gb=memory_gb, schedule=schedule,
            recompute=recompute,
        )[0]  # fmt: skip
    except NoPlanFits:
        return None


@pytest.mark.parametrize("memory_gb", [16, 24, 80])
def test_auto_is_the_fastest_setting_that_fits(h2048, memory_gb):
    plan = choose_plan(h2048, global_batch_size=128, memory_gb=memory_gb)[0]
    direct = {s: _fits(h2048, *s, memory_gb) for s in SETTINGS}
    fitting = {s: p["predicted"]["iteration_time_s"] for s, p in direct.items() if p}
    best = min(fitting, key=fitting.get)
    assert plan["predicted"]["iteration_time_s"] == pytest.approx(fitting[best])
    assert plan["degrees"] == direct[(plan["schedule"], plan["recompute"])]["degrees"]
    assert {(t["schedule"], t["recompute"]) for t in plan["alternatives"] if t["fits"]} == set(
        fitting
    )
    recompute_flags = "--recompute-granularity full" in plan["launch_flags"]
    assert plan["launch_flags"].startswith(f"--oases-schedule {plan['schedule']}")
    assert recompute_flags == plan["recompute"]
    if memory_gb == 80:  # room for all activations: no recomputation, and overlapped
        assert (plan["schedule"], plan["recompute"]) == ("overlap", False)
    else:  # keeping all activations does not fit: an overlapped schedule with recompute
        assert plan["recompute"] and plan["schedule"] != "off"


def test_auto_cli_and_nothing_fits(tmp_path, capsys, h2048):
    prof = tmp_path / "profile.json"
    prof.write_text(json.dumps(h2048.data))
    out = tmp_path / "plan.json"
    argv = ["plan", "--profile", str(prof), "--global-batch-size", "128", "--schedule", "auto"]
    assert oases(argv + ["--memory", "24", "--quiet", "--out", str(out)]) == 0
    text = capsys.readouterr().out
    plan = load_plan(str(out))
    assert f"run with: {plan['launch_flags']}" in text and "does not fit" in text
    assert oases(argv + ["--memory", "8", "--quiet"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "no schedule and recompute setting fits in 8" in err
    need = float(err.split("the smallest memory that fits is ")[1].split()[0])
    assert oases(argv + ["--memory", f"{need + 0.01:.2f}", "--quiet"]) == 0
    assert oases(argv + ["--memory", "24", "--no-recompute"]) == 2
    assert "drop --no-recompute" in capsys.readouterr().err
