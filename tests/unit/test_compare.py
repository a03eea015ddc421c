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
        "overlap-norecompute",
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


def test_every_default_stock_setting_runs_beside_its_oases_twin():
    """Issue 62.2: the defaults ran stock without recompute but every Oases variant with full
    recompute, so the best-against-best line set unlike against unlike."""
    from megatron_oases.compare.variants import (
        DEFAULT_VARIANTS,
        MEMORY_VARIANTS,
        missing_twins,
        twins,
    )

    for defaults in (DEFAULT_VARIANTS, MEMORY_VARIANTS):
        assert missing_twins(list(defaults)) == [], defaults
    assert [v.name for v in twins(VARIANTS["megatron-norecompute"])] == ["overlap-norecompute"]
    assert [v.name for v in twins(VARIANTS["megatron-selective"])] == ["overlap-selective"]
    assert [v.name for v in twins(VARIANTS["megatron-block"])] == ["oases-block"]
    assert "oases" in [v.name for v in twins(VARIANTS["megatron"])]
    assert twins(VARIANTS["oases"]) == []
    assert missing_twins(["megatron", "megatron-selective", "oases"]) == [
        ("megatron-selective", "overlap-selective")
    ]


def test_every_committed_compare_row_runs_each_stock_setting_beside_its_oases_twin():
    """The rows of ``benchmarks/compare/run_benchmarks.py`` choose their own variants: each row's
    best-against-best line must set like against like too (rtx3090-pcie-h2048l4 ran stock without
    recompute and no Oases variant without it)."""
    from helpers.paths import load_script

    from megatron_oases.compare.variants import DEFAULT_VARIANTS, missing_twins

    rb = load_script("benchmarks/compare/run_benchmarks.py", "run_benchmarks_under_test")
    for profile, shape in rb.MATRIX:
        options = rb.SHAPE_OPTIONS.get(shape, [])
        names = (
            options[options.index("--variants") + 1].split(",")
            if "--variants" in options
            else list(DEFAULT_VARIANTS)
        )
        assert missing_twins(names) == [], (profile, shape)


def test_best_against_best_at_each_measured_memory_level():
    from megatron_oases.compare.summary import best_against_best

    results = [
        _synthetic("megatron", 2000, 1.9),
        _synthetic("megatron-selective", 1800, 2.4),
        _synthetic("megatron-norecompute", 1234, 3.1),
        _synthetic("oases", 1500, 2.0),
        _synthetic("overlap-selective", 1400, 2.5),
        _synthetic("overlap-norecompute", 1012, 3.2),
        dict(_synthetic("cross-pass", 10, 1.0), status="failed"),  # never picked
    ]
    best = best_against_best(results)
    pairs = [
        (lv["limit_gb"], (lv["stock"] or {}).get("name"), (lv["oases"] or {}).get("name"))
        for lv in best["levels"]
    ]
    assert pairs == [
        (None, "megatron-norecompute", "overlap-norecompute"),  # everything ran: no limit
        (3.1, "megatron-norecompute", "overlap-selective"),  # 3.1 GB: stock's fits, not its twin
        (2.5, "megatron-selective", "overlap-selective"),
        (2.4, "megatron-selective", "oases"),
        (2.0, "megatron", "oases"),
        (1.9, "megatron", None),
    ]
    assert best["levels"][0]["speedup"] == pytest.approx(1234 / 1012)
    assert best["line"] == (
        "best stock: megatron-norecompute 1.234 s/iter at 3.1 GB; best Oases: overlap-norecompute "
        "1.012 s/iter (1.22x) at 3.2 GB; at <= 3.1 GB: megatron-norecompute 1.234 s/iter at 3.1 "
        "GB vs overlap-selective 1.4 s/iter (0.88x) at 2.5 GB; at <= 2.5 GB: megatron-selective "
        "1.8 s/iter at 2.4 GB vs overlap-selective 1.4 s/iter (1.29x) at 2.5 GB; at <= 2.4 GB: "
        "megatron-selective 1.8 s/iter at 2.4 GB vs oases 1.5 s/iter (1.20x) at 2 GB; at <= 2 GB: "
        "megatron 2 s/iter at 1.9 GB vs oases 1.5 s/iter (1.33x) at 2 GB; at <= 1.9 GB: megatron "
        "2 s/iter at 1.9 GB vs no Oases variant fits"
    )
    assert "\n" not in best["line"] and best["missing_twins"] == []
    # no memory pass, a stock setting without its twin: both said in the line
    plain = [dict(r, memory=None) for r in results if r["name"] != "overlap-selective"]
    line = best_against_best(plain)["line"]
    assert line == (
        "best stock: megatron-norecompute 1.234 s/iter; best Oases: overlap-norecompute 1.012 "
        "s/iter (1.22x); peak memory not measured (--memory-budget measures it); no Oases twin of "
        "megatron-selective ran (add overlap-selective to --variants)"
    )
    assert best_against_best([]) is None
    only_stock = best_against_best([dict(_synthetic("megatron", 1000, 1), memory=None)])
    assert only_stock["line"].startswith("best stock: megatron 1 s/iter; best Oases: none ran")


def _traced(name, ms, free_ms, runq_ms=0.0):
    r = dict(_synthetic(name, ms, 1), paper="-", stdev_iteration_s=0.0)
    r["trace"] = {
        "iteration_us": 1e3 * ms,
        "runq_us": 1e3 * runq_ms,
        "contention_free_us": 1e3 * free_ms,
    }
    return r


def _rank_trace(T, cpu, compute, comms):
    """A rank's trace: ``compute`` [(start, end)] labelled segments, ``comms`` [(issue, wait,
    done, modelled µs)]; the compute thread's CPU time is ``cpu`` (the rest of its running time
    it waited for a CPU), none of it inside a wait."""
    events = [
        {"name": "F layer", "cat": "compute", "ph": "X", "tid": 0, "ts": s, "dur": e - s,
         "args": {"pass": "forward", "layer": 0, "block": "layer", "sub_batch": -1}}
        for s, e in compute
    ]  # fmt: skip
    for issue, wait, done, model in comms:
        events.append(
            {"name": "all_reduce", "cat": "comm", "ph": "X", "tid": 1, "ts": issue,
             "dur": done - issue, "args": {"op": "all_reduce", "bytes": 4, "group_size": 2,
             "issue_us": issue, "wait_us": wait, "done_us": done, "model_us": model,
             "issue_cpu_us": 0.0, "wait_cpu_us": cpu, "done_cpu_us": cpu}}
        )  # fmt: skip
    md = {"rank": 0, "iteration_time_us": T, "iteration_cpu_us": cpu, "iteration_runq_us": T - cpu}
    return {"traceEvents": events, "metadata": md}


def test_the_iteration_replayed_without_contention():
    """What waiting for a CPU added to a traced iteration: the compute thread's run-queue wait
    where the iteration waited for it, a collective's completion past its modelled time; not a
    run-queue wait while the link was busy anyway."""
    from megatron_oases.compare.contention import contention_free_us, replay_us

    def model(ev):
        return ev["args"]["model_us"]

    # stock-like: 40 us of compute (30 on the CPU), then a synchronous all-reduce modelled at
    # 50 us that returned 10 us late: 100 -> 30 + 50
    sync = _rank_trace(100.0, 30.0, [(0, 40)], [(40, 40, 100, 50)])
    assert replay_us(sync, model) == pytest.approx(80.0)
    assert replay_us(sync) == pytest.approx(90.0)  # no link model: the wait as measured
    # overlapped: the all-reduce in flight from the start for its modelled 90 us; the compute
    # thread's 10 us in the run queue were hidden behind it: nothing to take out
    hidden = _rank_trace(100.0, 30.0, [(0, 40)], [(0, 40, 90, 90), (90, 90, 100, 10)])
    assert replay_us(hidden, model) == pytest.approx(100.0)
    # two ops on one group queue behind each other, as the emulator's channel does: the second,
    # issued at 5, starts when the first ends (60) and ends at 110; the compute thread waits
    # for both from 40 (its 40 us all on the CPU)
    queued = _rank_trace(120.0, 40.0, [(0, 40)], [(0, 40, 70, 60), (5, 70, 120, 50)])
    assert replay_us(queued, model) == pytest.approx(110.0)
    assert contention_free_us([sync, sync], model) == pytest.approx(80.0)
    assert contention_free_us([sync, {"traceEvents": [], "metadata": {}}], model) is None


def test_speedup_less_contention_and_a_contended_run():
    from megatron_oases.compare.summary import add_less_contention, best_against_best, contention

    # contention added 30 of stock's 300 ms and 105 of oases' 330: 0.91x raw, 1.2x without it
    results = [_traced("megatron", 300, 270), _traced("oases", 330, 225, runq_ms=50)]
    ref = add_derived(results)
    add_less_contention(results, ref)
    assert results[1]["speedup"] == pytest.approx(300 / 330)
    assert results[1]["contention_share"] == pytest.approx(105 / 330)
    assert results[1]["run_queue_share"] == pytest.approx(50 / 330)
    assert results[1]["iteration_less_contention_s"] == pytest.approx(0.225)
    assert results[1]["speedup_less_contention"] == pytest.approx(270 / 225)
    assert results[0]["speedup_less_contention"] == pytest.approx(1.0)
    assert "0.91x    1.20x" in format_table(results).splitlines()[3]
    c = contention(results)
    assert c["contended"] and c["spread_points"] == pytest.approx(100 * (105 / 330 - 0.1))
    assert c["line"].startswith("contended: waiting for a CPU added 10.0 % (megatron) to 31.8 %")
    assert c["line"].endswith("or rerun on a quieter host") and "\n" not in c["line"]
    line = best_against_best(results, corrected=True)["line"]
    assert "oases 0.33 s/iter (0.91x; 1.20x less contention) at 1 GB" in line
    # within 5 points: not contended; no replay (no trace, no CPU record): no correction
    calm = [_traced("megatron", 300, 270), _traced("oases", 330, 285)]
    add_less_contention(calm, add_derived(calm))
    assert contention(calm)["contended"] is False and contention(calm)["line"] is None
    bare = [_synthetic("megatron", 300, 1), _synthetic("oases", 330, 1)]
    add_less_contention(bare, add_derived(bare))
    assert bare[1]["speedup_less_contention"] is None and contention(bare) is None
