"""The CLIs refuse bad input with one line before their work, in this process:

* ``oases plan --evaluate PLAN``: the plan, the profile and the flags must describe the same model
  and run (layers, TMP domain, data-parallel size, batch, schedule, recompute); a plan's own batch
  or degrees that do not fit are named as the plan's, not as flags the user never passed; the
  prediction is that of the run the plan was made for (distributed optimizer, unsplit layers).
* ``--out`` of ``oases plan``, ``oases profile`` and ``oases compare``: checked before the solve,
  the profiling or any run (a directory where a file goes, a file where a directory goes, a parent
  that is a file, an unwritable location); missing parent directories are created.
* a plan file without the plan's fields names them (not "unsupported plan version None").
"""

import json
import os
import time

import pytest

from megatron_oases.cli import main as oases

GBS = 8  # tiny-cpu: T=2, DP 1: micro-batch 8 by default, 2 with --micro-batch-size 2


def _one_line(capsys):
    """The one stderr line of a refused command (and nothing else on stderr)."""
    err = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]
    assert len(err) == 1, err
    return err[0]


def _profile(path, *extra):
    argv = ["profile", "--model", "tiny-cpu", "--analytic", "--cluster", "rtx3090-pcie"]
    assert oases(argv + list(extra) + ["--out", str(path)]) == 0
    return str(path)


def _plan(profile, path, *extra):
    argv = ["plan", "--profile", profile, "--global-batch-size", str(GBS), "--quiet"]
    assert oases(argv + list(extra) + ["--out", str(path)]) == 0
    return str(path)


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """Analytic tiny-cpu profiles (24 layers; 12 layers; 24 layers at DP 2; 24 layers at T=4) and
    plans made from the 12- and 24-layer ones."""
    d = tmp_path_factory.mktemp("cli")
    out = {
        "p24": _profile(d / "p24.json", "--set", "num_layers=24"),
        "p12": _profile(d / "p12.json", "--set", "num_layers=12"),
        "dp2": _profile(d / "dp2.json", "--set", "num_layers=24", "--data-parallel-size", "2"),
        "t4": _profile(
            d / "t4.json", "--set", "num_layers=24", "--tensor-model-parallel-size", "4"
        ),
    }
    out["plan12"] = _plan(out["p12"], d / "plan12.json")
    out["plan24"] = _plan(out["p24"], d / "plan24.json")
    return out


def _evaluate(profile, plan, *extra):
    return oases(["plan", "--profile", profile, "--evaluate", plan, "--quiet", *extra])


# ------------------------------------------------------------------ case 1: --evaluate's checks
def test_evaluate_refuses_a_plan_of_another_number_of_layers(files, capsys):
    """A 12-degree plan on a 24-layer profile was predicted as a 12-layer model (exit 0)."""
    capsys.readouterr()
    assert _evaluate(files["p24"], files["plan12"]) == 2
    line = _one_line(capsys)
    assert f"plan {files['plan12']} has 12 layer degrees" in line
    assert f"profile {files['p24']} is of a 24-layer model" in line
    assert f"made from ({files['p12']})" in line  # the fix names the plan's own profile
    assert _evaluate(files["p12"], files["plan12"]) == 0


def test_evaluate_refuses_another_tmp_domain_or_data_parallel_size(files, capsys):
    capsys.readouterr()
    assert _evaluate(files["t4"], files["plan24"]) == 2
    line = _one_line(capsys)
    assert "is for a TMP domain T of 2 but profile" in line and "has 4" in line, line
    assert "--tensor-model-parallel-size" not in line  # a flag the user never passed
    assert _evaluate(files["dp2"], files["plan24"]) == 2
    assert "is for a data-parallel size of 1 but profile" in _one_line(capsys)


def test_evaluate_names_the_plan_as_the_micro_batch_source(files, tmp_path, capsys):
    """A plan that records no data-parallel size (an older or hand-written one), on a profile of
    another DP: the micro-batch is the plan's, not a ``--micro-batch-size`` the user never passed.
    """
    plan = json.load(open(files["plan24"]))
    del plan["data_parallel_size"]
    path = tmp_path / "old.json"
    path.write_text(json.dumps(plan))
    capsys.readouterr()
    assert _evaluate(files["dp2"], str(path)) == 2
    line = _one_line(capsys)
    assert f"micro-batch 8 (plan {path}'s micro_batch_size) does not divide the 4 samples" in line
    assert "--micro-batch-size" not in line, line
    # a degree whose group gets one sample, in a plan that does not allow unsplit layers
    plan = json.load(open(files["plan24"]))
    plan.update(micro_batch_size=2, degrees=[1] + [2] * 23, allow_unsplit=False)
    path.write_text(json.dumps(plan))
    assert _evaluate(files["p24"], str(path)) == 2
    line = _one_line(capsys)
    assert "layer 0 at degree 1 gets 1 samples per group" in line and "--degrees" not in line


def test_evaluate_refuses_flags_that_contradict_the_plan(files, capsys):
    capsys.readouterr()
    for flags, recorded in (
        (["--global-batch-size", "16"], "global_batch_size 8"),
        (["--micro-batch-size", "2"], "micro_batch_size 8"),
        (["--schedule", "off"], 'schedule "oases"'),
        (["--no-recompute"], 'recompute "full"'),
        (["--recompute-num-layers", "3"], "recompute_num_layers null"),
        (["--distributed-optimizer"], "distributed_optimizer false"),
    ):
        assert _evaluate(files["p24"], files["plan24"], *flags) == 2, flags
        line = _one_line(capsys)
        assert f"{' '.join(flags)} contradicts plan" in line and recorded in line, line
        assert "drop the flag" in line
    # the plan's own values given again are no contradiction
    same = ["--global-batch-size", "8", "--schedule", "oases", "--recompute", "full"]
    assert _evaluate(files["p24"], files["plan24"], *same) == 0


def test_evaluate_predicts_the_run_the_plan_was_made_for(files, tmp_path, capsys):
    """The distributed optimizer and unsplit layers the plan records are part of its prediction
    (they were dropped: 2x the memory, or a refusal naming --degrees)."""
    for name, flags in (
        ("dist", ["--distributed-optimizer"]),
        ("unsplit", ["--micro-batch-size", "2", "--allow-unsplit", "--pin", "0-3=1"]),
    ):
        plan = _plan(files["p24"], tmp_path / f"{name}.json", *flags)
        predicted = json.load(open(plan))["predicted"]
        capsys.readouterr()
        assert _evaluate(files["p24"], plan) == 0, capsys.readouterr().err
        out = capsys.readouterr().out
        assert f"predicted iteration {predicted['iteration_time_s'] * 1e3:.2f} ms" in out
        assert f"peak memory {predicted['peak_memory_bytes_per_rank'] / 1e9:.2f} GB" in out


# ------------------------------------------------------------- case 2: --out before the work
def _must_not_run(what):
    def fail(*args, **kwargs):
        raise AssertionError(f"{what} ran before --out was checked")

    return fail


def test_plan_out_is_checked_before_the_solve(files, tmp_path, capsys, monkeypatch):
    import megatron_oases.planner.api as api
    import megatron_oases.planner.choose as choose

    monkeypatch.setattr(api, "make_plan", _must_not_run("the solve"))
    monkeypatch.setattr(choose, "choose_plan", _must_not_run("the solve"))
    a_file = tmp_path / "a-file"
    a_file.write_text("x")
    read_only = tmp_path / "ro"
    read_only.mkdir()
    real_access = os.access
    monkeypatch.setattr(  # root may write anywhere: the check asks os.access
        os,
        "access",
        lambda p, mode, **kw: os.path.abspath(p) != str(read_only) and real_access(p, mode, **kw),
    )
    argv = ["plan", "--profile", files["p24"], "--global-batch-size", str(GBS)]
    capsys.readouterr()
    for out, message in (
        (tmp_path, f"--out {tmp_path} is a directory; name the file to write, e.g. --out "),
        (a_file / "plan.json", f"{a_file} is a file, not a directory"),
        (read_only / "plan.json", f"cannot write in {read_only} (permission denied)"),
    ):
        for schedule in ("oases", "auto"):
            assert oases(argv + ["--schedule", schedule, "--out", str(out)]) == 2, out
            assert message in _one_line(capsys)
    monkeypatch.undo()
    # missing parent directories are created, as `oases profile` and `oases compare` do
    new = tmp_path / "new" / "sub" / "plan.json"
    assert oases(argv + ["--quiet", "--out", str(new)]) == 0
    assert json.load(open(new))["degrees"]


def test_profile_out_directory_fails_before_profiling(tmp_path, capsys):
    """A measured profile (spawned ranks, ~35 s) was lost to an --out it could not write."""
    capsys.readouterr()
    argv = ["profile", "--model", "tiny-cpu", "--no-cache", "--cache-dir", str(tmp_path / "c")]
    start = time.monotonic()
    assert oases(argv + ["--out", str(tmp_path)]) == 2
    assert time.monotonic() - start < 5
    assert f"--out {tmp_path} is a directory" in _one_line(capsys)
    a_file = tmp_path / "a-file"
    a_file.write_text("x")
    start = time.monotonic()
    assert oases(argv[:-2] + ["--cache-dir", str(a_file), "--out", str(tmp_path / "p.json")]) == 2
    assert time.monotonic() - start < 5
    assert f"--cache-dir {a_file} is a file" in _one_line(capsys)


def test_compare_out_file_fails_before_any_run(tmp_path, capsys, monkeypatch):
    import megatron_oases.compare.runner as runner

    monkeypatch.setattr(runner, "run_variant", _must_not_run("a compare run"))
    out = tmp_path / "results"
    out.write_text("keep me")
    capsys.readouterr()
    argv = ["compare", "--nproc", "2", "--out", str(out), "--", "--tensor-model-parallel-size", "2"]
    assert oases(argv) == 2
    line = _one_line(capsys)
    assert f"--out {out} is a file, but a directory is written there" in line
    assert out.read_text() == "keep me"
    assert oases(argv[:3] + ["--out", str(out / "sub"), *argv[5:]]) == 2
    assert f"{out} is a file, not a directory" in _one_line(capsys)


# ----------------------------------------------------------- case 3: a plan of the wrong fields
def test_plan_without_the_plan_fields_names_them(files, tmp_path, capsys):
    plan = json.load(open(files["plan24"]))
    capsys.readouterr()
    for edit, message in (
        (lambda p: p.pop("version"), "missing field 'version'; add \"version\": 1"),
        (lambda p: p.update(degree=p.pop("degrees")), "missing field 'degrees' (found 'degree')"),
        (
            lambda p: p.clear() or p.update(variants=[]),
            "missing fields 'version', 'tensor_model_parallel_size', 'degrees'",
        ),
        (lambda p: p.update(json.load(open(files["p24"]))), "this is a profile"),
    ):
        bad = json.loads(json.dumps(plan))
        edit(bad)
        path = tmp_path / "bad.json"
        path.write_text(json.dumps(bad))
        assert _evaluate(files["p24"], str(path)) == 2
        line = _one_line(capsys)
        assert message in line and "version None" not in line, line


def test_evaluate_writes_nothing_so_out_is_refused(files, capsys):
    assert _evaluate(files["p24"], files["plan24"], "--out", "again.json") != 0
    line = _one_line(capsys)
    assert "--evaluate re-predicts PLAN and writes nothing; drop --out" in line


def test_viz_refuses_a_directory_as_its_chart_before_reading_traces(tmp_path, capsys):
    from megatron_oases.viz.__main__ import main as viz

    assert viz([str(tmp_path / "no-traces-here"), "-o", str(tmp_path)]) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert "-o/--out" in line and "is a directory" in line and "timeline.png" in line
