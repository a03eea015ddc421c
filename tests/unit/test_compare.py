"""``oases compare`` without running it: bad input, variants and their flags, host projection,
loss check, memory estimate and budget, the code version. End-to-end runs on a tiny model:
``tests/e2e/test_compare_e2e.py``."""

import subprocess

import pytest
from helpers.variants import COMPARE_TINY as TINY

# Megatron's first import logs library start-up warnings (no CUDA, no APEX): import it here, not in
# the middle of a test that checks its stderr.
import megatron.training.arguments  # noqa: F401,E402  isort: skip

from megatron_oases.cli import main as oases_main
from megatron_oases.compare.report import add_derived, check_losses, format_table
from megatron_oases.compare.variants import VARIANTS, estimate_memory_gb, parse_variants
from megatron_oases.errors import OasesConfigError
from megatron_oases.profiler.model_config import parse_offline


def _one_line_error(capsys, argv, *needles):
    assert oases_main(["compare", *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("oases compare: error:") and "\n" not in err, err
    for n in needles:
        assert n in err, err
    return err


def test_bad_input_is_one_line_exit_2(capsys, tmp_path):
    out = ["--out", str(tmp_path / "o")]
    _one_line_error(
        capsys,
        ["--emulate-link", "dgx-9000", *out, "--", *TINY],
        "dgx-9000",
        "rtx3090-pcie",
        "rtx3090-nvlink",
        "h100-nvlink",
    )
    _one_line_error(capsys, ["--variants", "megatron,merak", *out, "--", *TINY], "merak")
    _one_line_error(capsys, ["--variants", "oases+planner", *out, "--", *TINY], "planner")
    _one_line_error(capsys, [*out, "--", *TINY, "--train-iters", "3"], "--train-iters")
    # Checked before anything is launched: the split schedules need micro-batch >= 2.
    _one_line_error(capsys, [*out, "--", *TINY[:-2], "--micro-batch-size", "1"], "micro-batch")
    assert not (tmp_path / "o" / "megatron").exists()


def test_host_projection_and_layer_override():
    from megatron_oases.compare.host import _with_layers, project
    from megatron_oases.testbed.clusters import load_cluster

    argv = _with_layers(["--num-layers", "2", "--hidden-size", "64", "--train-iters=9"], 4)
    assert argv == ["--hidden-size", "64", "--num-layers", "4", "--train-iters", "2",
                    "--fake-process-group"]  # fmt: skip
    prof = load_cluster("rtx3090-pcie")
    host = {"aten_calls_per_iteration": 500}
    # 500 calls x 12 us = 6 ms of issue; 1 s emulated at D=100 = 10 ms of GPU: not host-bound
    assert prof.host_us_per_call == 12.0
    project(host, {"mean_iteration_s": 1.0}, {"dilation": 100.0}, prof)
    assert host["issue_ms_per_iteration"] == pytest.approx(6.0)
    assert host["device_ms_per_iteration"] == pytest.approx(10.0)
    assert host["host_bound"] is False and host["host_floor_s"] == pytest.approx(0.6)
    project(host, {"mean_iteration_s": 0.5}, {"dilation": 100.0}, prof)
    assert host["host_bound"] is True  # 5 ms of GPU < 6 ms of issue
    assert project({"error": "x"}, {}, {"dilation": 1}, prof) == {"error": "x"}


def test_variants_and_flags():
    assert [v.name for v in parse_variants(None)] == [
        "megatron",
        "megatron-norecompute",
        "overlap",
        "cross-pass",
        "oases",
    ]
    assert "--recompute-granularity" in VARIANTS["megatron"].flags
    assert "--recompute-granularity" not in VARIANTS["megatron-norecompute"].flags
    for name in ("overlap", "cross-pass", "oases"):
        assert VARIANTS[name].flags[:2] == ("--oases-schedule", name)
    # Control variant: stock Megatron on sub-batch-sized micro-batches, same tokens per iteration.
    base = parse_offline(TINY + ["--mock-data", "--global-batch-size", "8"], 2, demo=True)
    flags = VARIANTS["megatron-halfmb"].resolved_flags(base)
    assert flags[-4:] == ("--micro-batch-size", "1", "--global-batch-size", "8")


def test_block_variants_recompute_half_of_each_stage():
    """``megatron-block`` / ``oases-block``: Megatron's --recompute-method block over the first
    half of each pipeline stage's layers; their memory estimate lies between full and none."""
    # a shape where a layer's activations dwarf its input (as on real models)
    four = TINY[:2] + ["--num-layers", "4", "--hidden-size", "512", "--micro-batch-size", "2"]
    four += ["--seq-length", "1024", "--max-position-embeddings", "1024", "--mock-data"]
    for pp, n in ((1, "2"), (2, "1")):
        argv = four + ["--pipeline-model-parallel-size", str(pp)]
        base = parse_offline(argv, 2 * pp, demo=True)
        for name in ("megatron-block", "oases-block"):
            flags = VARIANTS[name].resolved_flags(base)
            assert flags[-6:] == (
                "--recompute-granularity",
                "full",
                "--recompute-method",
                "block",
                "--recompute-num-layers",
                n,
            ), flags
            args = parse_offline(argv + list(flags), 2 * pp, demo=True)
            gb = {r: estimate_memory_gb(args, r) for r in ("full", "block", "none")}
            # (one layer per stage kept, one micro-batch in flight: the kept layer holds what
            # full recompute's working set holds)
            assert gb["full"] <= gb["block"] < gb["none"], gb
    one_per_stage = parse_offline(TINY[:2] + ["--num-layers", "1", "--mock-data"], 2, demo=True)
    with pytest.raises(OasesConfigError, match="at least 2 layers per pipeline stage"):
        VARIANTS["oases-block"].resolved_flags(one_per_stage)


def test_loss_check_flags_disagreement():
    ok = {
        "status": "ok",
        "tokens_per_sec": 100.0,
        "losses": [6.0, 5.9],
        "mean_iteration_s": 1.0,
        "stdev_iteration_s": 0.0,
        "trace": None,
    }
    res = [
        dict(ok, name="megatron", paper="Megatron-LM"),
        dict(ok, name="oases", paper="x", tokens_per_sec=150.0, losses=[6.0, 5.9 * (1 + 5e-4)]),
        dict(ok, name="overlap", paper="y", losses=[6.0, 5.5]),
        {"name": "cross-pass", "paper": "z", "status": "failed"},
    ]
    ref = add_derived(res)
    assert ref["name"] == "megatron" and res[1]["speedup"] == pytest.approx(1.5)
    bad = check_losses(res, ref, 1e-3)
    assert len(bad) == 1 and bad[0].startswith("overlap")
    assert res[1]["loss_agrees"] and not res[2]["loss_agrees"]
    assert "failed" in format_table(res)


def test_memory_estimate_skips_what_cannot_fit():
    small = parse_offline(TINY + ["--mock-data"], 2, demo=True)
    assert estimate_memory_gb(small, recompute=False) < 0.1
    # ~3.4 GB of activations per layer and micro-batch without recompute: 8 layers do not fit.
    long_seq = parse_offline(
        [
            "--tensor-model-parallel-size",
            "2",
            "--num-layers",
            "8",
            "--hidden-size",
            "2048",
            "--num-attention-heads",
            "16",
            "--seq-length",
            "4096",
            "--max-position-embeddings",
            "4096",
            "--micro-batch-size",
            "4",
            "--mock-data",
        ],
        2,
        demo=True,
    )
    assert estimate_memory_gb(long_seq, recompute=False) > 24 > estimate_memory_gb(long_seq, True)
    # Sequence parallelism divides the s·b·h activations by t (Korthikanti et al. eq. 5 vs 2).
    without = {r: estimate_memory_gb(long_seq, r) for r in ("none", "selective", "full")}
    long_seq.sequence_parallel = True
    for r, gb in without.items():
        assert estimate_memory_gb(long_seq, r) < gb, r


def _synthetic(name, ms, peak_gb):
    return {
        "name": name,
        "status": "ok",
        "tokens_per_sec": 1e3 / ms,
        "mean_iteration_s": ms / 1e3,
        "memory": {"peak_bytes_per_rank": int(peak_gb * 1e9)},
    }


def test_memory_budget_selection_and_state_bytes():
    from megatron_oases.compare.memory import parse_budgets, select
    from megatron_oases.errors import OasesConfigError
    from megatron_oases.training.measure import state_bytes

    results = [
        _synthetic("megatron", 100, 10),
        _synthetic("megatron-selective", 90, 14),
        _synthetic("megatron-norecompute", 80, 20),
        _synthetic("oases", 80, 10.5),
        _synthetic("overlap-norecompute", 70, 20),
        dict(_synthetic("overlap-selective", 10, 1), status="failed"),  # never picked
        {"name": "overlap", "status": "ok", "tokens_per_sec": 50.0, "memory": {"error": "x"}},
    ]
    picks = select(results, [5, 10.2, 12, 15, 25])
    assert [(p["stock"], p["oases"]) for p in picks] == [
        (None, None),
        ("megatron", None),
        ("megatron", "oases"),
        ("megatron-selective", "oases"),
        ("megatron-norecompute", "overlap-norecompute"),
    ]
    assert picks[0]["speedup"] is None and picks[1]["speedup"] is None
    assert picks[2]["speedup"] == pytest.approx(100 / 80)
    assert picks[3]["speedup"] == pytest.approx(90 / 80)
    assert picks[4]["speedup"] == pytest.approx(80 / 70)
    assert parse_budgets("0.2, 0.05,0.1") == [0.05, 0.1, 0.2]
    for bad in ("", "x", "0,1", "-1"):
        with pytest.raises(OasesConfigError, match="--memory-budget"):
            parse_budgets(bad)
    # Model states per parameter: fp32 weight + gradient buffer + two Adam moments = 16 B; bf16
    # adds an fp32 master copy and keeps an fp32 gradient buffer; the distributed optimizer shards
    # master copy and moments over data parallelism.
    fp32 = parse_offline(TINY + ["--mock-data"], 2, demo=True)
    assert state_bytes(1000, fp32) == 16000
    bf16 = parse_offline(TINY[2:] + ["--mock-data", "--bf16"], 2, demo=True)
    assert bf16.data_parallel_size == 2 and state_bytes(1000, bf16) == 18000
    dist = parse_offline(
        TINY[2:] + ["--mock-data", "--bf16", "--use-distributed-optimizer"], 2, demo=True
    )
    assert state_bytes(1000, dist) == 1000 * (2 + 4) + 1000 * 12 // 2


def test_memory_variants_validate():
    from megatron_oases.compare.variants import MEMORY_VARIANTS

    base = parse_offline(TINY + ["--mock-data"], 2, demo=True)
    for name in MEMORY_VARIANTS:
        v = VARIANTS[name]
        args = parse_offline(TINY + ["--mock-data", *v.resolved_flags(base)], 2, demo=True)
        granularity = {"full": "full", "none": None}.get(v.recompute, "selective")
        assert args.recompute_granularity == granularity, name
        if granularity == "selective":
            ln = v.recompute == "selective+ln"
            want = ["core_attn", "layernorm"] if ln else ["core_attn"]
            assert args.recompute_modules == want, name
        assert v.stock == (args.oases_schedule == "off"), name
    assert {VARIANTS[n].stock for n in MEMORY_VARIANTS} == {True, False}


def test_code_version_is_dirty_only_for_code_changes(tmp_path):
    """A run's own results (and the report, written before the version is asked) do not make
    the recorded commit ``+dirty``; a changed source file does."""
    from megatron_oases.compare.session import code_version as _code_version

    def git(*args):
        subprocess.run(["git", *args], cwd=tmp_path, check=True, capture_output=True)

    (tmp_path / "pkg").mkdir()
    (tmp_path / "benchmarks" / "results" / "row").mkdir(parents=True)
    (tmp_path / "pkg" / "a.py").write_text("x = 1\n")
    (tmp_path / "benchmarks" / "results" / "row" / "results.json").write_text("{}\n")
    git("init", "-q")
    git("add", ".")
    git("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "c")
    clean = _code_version(str(tmp_path))["commit"]
    assert clean and not clean.endswith("+dirty")
    (tmp_path / "benchmarks" / "results" / "row" / "results.json").write_text("{1}\n")
    assert _code_version(str(tmp_path))["commit"] == clean
    (tmp_path / "pkg" / "a.py").write_text("x = 2\n")
    assert _code_version(str(tmp_path))["commit"] == clean + "+dirty"


def test_reanalyze_without_the_raw_traces_is_one_line(tmp_path):
    """A committed results directory has its report but not its traces (.gitignore): one line
    naming the fix, before any chart is drawn (was a FileNotFoundError traceback)."""
    import json

    from megatron_oases.compare.results import reanalyze
    from megatron_oases.errors import OasesConfigError

    report = {
        "config": {"model": "m"},
        "variants": [
            {"name": "megatron", "status": "ok", "trace_files": ["megatron/trace.rank0.json"]}
        ],
    }
    (tmp_path / "results.json").write_text(json.dumps(report))
    with pytest.raises(OasesConfigError, match="megatron/trace.rank0.json is not there"):
        reanalyze(str(tmp_path))


# ------------------------------------------------ issue 54 item 5: one --out, one comparison
_HOLD = (
    "import sys, time\n"
    "from megatron_oases.outputs import lock_dir\n"
    "held = lock_dir(sys.argv[1], '--out')\n"
    "print('held', flush=True)\n"
    "time.sleep(float(sys.argv[2]))\n"
)


def _holder(out, seconds):
    """Another process that takes ``out``'s run lock (and keeps it ``seconds``)."""
    import sys

    proc = subprocess.Popen(
        [sys.executable, "-c", _HOLD, str(out), str(seconds)], stdout=subprocess.PIPE, text=True
    )
    assert proc.stdout.readline().strip() == "held"
    return proc


def test_a_second_run_into_an_out_with_results_is_refused_before_running(
    tmp_path, capsys, monkeypatch
):
    """Two runs into one --out both said "wrote results.md" and only the second's report, logs
    and traces remained: a directory holding another comparison's results is refused, one line
    before any run, and left as it was."""
    import megatron_oases.compare.runner as runner

    def must_not_run(*args, **kwargs):
        raise AssertionError("a variant ran into an --out that holds results")

    monkeypatch.setattr(runner, "run_variant", must_not_run)
    out = tmp_path / "cmp"
    (out / "megatron").mkdir(parents=True)
    (out / "results.json").write_text('{"first": "run"}')
    argv = ["--variants", "megatron", "--no-host-pass", "--out", str(out), "--", *TINY]
    err = _one_line_error(capsys, argv)
    assert err == (
        f"oases compare: error: --out {out} holds the results of another comparison "
        "(results.json); choose another --out directory, or add --force to write over them"
    )
    assert (out / "results.json").read_text() == '{"first": "run"}'
    assert sorted(p.name for p in out.iterdir()) == ["megatron", "results.json"]  # no lock left


def test_out_results_are_written_over_only_with_force(tmp_path):
    from megatron_oases.compare.session import claim_out_dir
    from megatron_oases.outputs import LOCK_FILE

    out = tmp_path / "cmp"
    with claim_out_dir(str(out)):  # new: created and held
        assert (out / LOCK_FILE).is_file()
    assert list(out.iterdir()) == []  # the lock file goes with the run
    (out / "notes.txt").write_text("mine")  # what compare does not write is no result
    with claim_out_dir(str(out)):
        pass
    (out / "oases").mkdir()  # a variant's logs of an unfinished run
    with pytest.raises(OasesConfigError, match=r"\(oases, an unfinished run's logs\); choose"):
        with claim_out_dir(str(out)):
            pytest.fail("claimed an --out with another run's logs")
    (out / "results.json").write_text("{}")
    with pytest.raises(OasesConfigError, match=r"\(results.json\)"):
        with claim_out_dir(str(out), force=False):
            pytest.fail("claimed an --out with results")
    with claim_out_dir(str(out), force=True) as claimed:  # --force: proceeds
        assert claimed == str(out) and (out / LOCK_FILE).is_file()
    assert not (out / LOCK_FILE).exists()


def test_an_out_in_use_by_a_live_run_is_refused_even_with_force(tmp_path):
    import os

    from megatron_oases.compare.session import claim_out_dir
    from megatron_oases.outputs import lock_dir

    out = str(tmp_path / "cmp")
    os.makedirs(out)
    held = lock_dir(out, "--out")  # a live run in this process
    try:
        with pytest.raises(OasesConfigError) as err:
            with claim_out_dir(out, force=True):
                pytest.fail("claimed an --out in use")
    finally:
        held.close()
    assert str(err.value).startswith(f"--out {out} is in use by another run (pid {os.getpid()} on ")
    assert str(err.value).endswith("wait for it to end, stop it, or choose another --out directory")
    other = _holder(out, 60)  # a live run in another process
    try:
        with pytest.raises(OasesConfigError, match=f"in use by another run \\(pid {other.pid} on "):
            with claim_out_dir(out, force=True):
                pytest.fail("claimed an --out in use")
    finally:
        other.kill()
        other.wait()
    with claim_out_dir(out):  # that run is gone: its lock went with it
        pass


def test_a_lock_left_by_a_dead_run_is_taken_over(tmp_path):
    """A run killed before it could remove its lock file leaves it behind: the next run takes
    it over (the kernel released the lock with the process) and names itself in it."""
    import json
    import os

    from megatron_oases.compare.session import claim_out_dir
    from megatron_oases.outputs import LOCK_FILE

    out = tmp_path / "cmp"
    out.mkdir()
    dead = _holder(out, 0)
    dead.wait()
    stale = json.loads((out / LOCK_FILE).read_text())
    assert stale["pid"] == dead.pid != os.getpid()
    with pytest.raises(ProcessLookupError):
        os.kill(dead.pid, 0)
    with claim_out_dir(str(out)):
        assert json.loads((out / LOCK_FILE).read_text())["pid"] == os.getpid()
    assert not (out / LOCK_FILE).exists()


def test_a_lock_on_a_file_its_run_removed_is_taken_anew(tmp_path, monkeypatch):
    """A comparison removes its lock file as it ends; a run that opened the file just before and
    locks it just after holds a lock on no file. It must lock the file at the path instead, or a
    third run could take that one too."""
    import fcntl
    import os

    from megatron_oases import outputs

    real = outputs._flock
    path = tmp_path / outputs.LOCK_FILE
    path.write_text("{}")
    late = open(path, "r+")  # opened while the first run held it
    path.unlink()  # the first run ends: file removed, then its lock released
    fcntl.flock(late, fcntl.LOCK_EX | fcntl.LOCK_NB)
    calls = []

    def first_the_late_lock(*args):
        calls.append(args)
        return late if len(calls) == 1 else real(*args)

    monkeypatch.setattr(outputs, "_flock", first_the_late_lock)
    held = outputs.lock_dir(str(tmp_path), "--out")
    assert len(calls) == 2 and late.closed
    assert os.path.samestat(os.fstat(held.fileno()), os.stat(path))
    monkeypatch.setattr(outputs, "_flock", real)
    with pytest.raises(OasesConfigError, match="in use by another run"):
        outputs.lock_dir(str(tmp_path), "--out")
    held.close()
