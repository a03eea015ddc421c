"""Ctrl-C and SIGTERM (issue 60.4): every ``oases`` command ends with one line on stderr and exit
status 130 (SIGINT) or 143 (SIGTERM), never a traceback; ``oases compare`` stops the run in
progress, writes the report of the variants that finished (the others ``interrupted``), and
``--reanalyze`` reads such a directory.

The runs are stand-ins (a variant's launcher replaced by a small script that writes golden
values, or sleeps until it is stopped): what is tested is compare's handling, not training."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest
from helpers.variants import COMPARE_TINY as TINY

# Megatron's first import logs library start-up warnings: import it here, not in the middle of a
# test that checks stderr.
import megatron.training.arguments  # noqa: F401,E402  isort: skip

from megatron_oases import interrupts
from megatron_oases.cli import main as oases_main

ARGV = ["--variants", "megatron,oases", "--no-host-pass", "--warmup", "1", "--iters", "2"]


def _golden(vdir, loss=6.0):
    """The golden values a finished run writes (three iterations)."""
    series = {
        "iteration-time": [0.2, 0.1, 0.1],
        "tokens-per-sec": [320.0, 640.0, 640.0],
        "lm loss": [loss, loss - 0.1, loss - 0.2],
    }
    with open(os.path.join(vdir, "golden.json"), "w") as f:
        json.dump({k: {"values": v} for k, v in series.items()}, f)


def _fake_run(interrupt):
    """A stand-in for :func:`~megatron_oases.compare.runner.run_variant`: the first variant
    finishes, the second is interrupted by ``interrupt``."""
    from megatron_oases.compare import runner

    def run(variant, train_argv, out_dir, *args, **kwargs):
        if variant.name != "megatron":
            raise interrupt
        vdir = os.path.join(out_dir, variant.name)
        os.makedirs(vdir, exist_ok=True)
        _golden(vdir)
        r = {"name": variant.name, "label": variant.label, "paper": variant.paper}
        r.update(flags=list(variant.flags), dir=vdir, status="ok", returncode=0, wall_s=1.0)
        return dict(r, **runner._timings(runner.read_golden(vdir + "/golden.json"), 1))

    return run


def _stderr_lines(capsys):
    return [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]


def _check_report(out, by):
    """results.json and .md of a comparison ``by`` interrupted in its second variant's run."""
    report = json.loads((out / "results.json").read_text())
    status = {r["name"]: r["status"] for r in report["variants"]}
    assert status == {"megatron": "ok", "oases": "interrupted"}, status
    assert report["interrupted"] == {
        "by": by,
        "during": "the timed runs",
        "not_finished": ["oases"],
    }
    assert report["variants"][0]["tokens_per_sec"] == pytest.approx(640.0)
    md = (out / "results.md").read_text()
    assert f"**interrupted**: the comparison was interrupted by {by} during the timed runs" in md
    assert "| oases | " in md and "| interrupted (did not finish) |" in md
    assert (out / "throughput.png").is_file()
    assert not (out / ".oases-lock").exists()
    return report


@pytest.mark.parametrize(
    "interrupt, by, status",
    [(KeyboardInterrupt(), "Ctrl-C (SIGINT)", 130), (interrupts.Terminated(), "SIGTERM", 143)],
)
def test_an_interrupted_compare_reports_what_finished(
    tmp_path, capsys, monkeypatch, interrupt, by, status
):
    """Was: a 27-line KeyboardInterrupt traceback, no results.*, and --reanalyze refused the
    directory. Now: one line, 130 (143), the report of the finished variant, the other marked."""
    from megatron_oases.compare import runner

    monkeypatch.setattr(runner, "run_variant", _fake_run(interrupt))
    out = tmp_path / "cmp"
    assert oases_main(["compare", *ARGV, "--out", str(out), "--", *TINY]) == status
    err = _stderr_lines(capsys)
    assert err == [
        f"oases compare: interrupted by {by}: report of the variants that finished (megatron) in "
        f"{out}/results.md, not finished: oases"
    ]
    _check_report(out, by)

    # --reanalyze reads it: the finished variant reported, the other still marked; exit 1 (the
    # comparison is incomplete), one line naming what is missing
    assert oases_main(["compare", "--reanalyze", str(out)]) == 1
    err = _stderr_lines(capsys)
    assert err == [
        f"oases compare: the comparison was interrupted by {by} during the timed runs; not "
        "finished: oases; run its command again for a complete one"
    ]
    _check_report(out, by)
    # a new comparison into it is refused, as for any other results
    assert oases_main(["compare", *ARGV, "--out", str(out), "--", *TINY]) == 2
    assert "holds the results of another comparison (results.json)" in _stderr_lines(capsys)[0]


def test_a_failed_variant_is_named_in_the_one_line(tmp_path, capsys, monkeypatch):
    """A variant that failed before the interrupt: still one line on stderr (the failure named
    in it), not the report's own "variant(s) failed" line beside it."""
    from megatron_oases.compare import runner

    def run(variant, train_argv, out_dir, *args, **kwargs):
        if variant.name != "megatron":
            raise KeyboardInterrupt
        return {"name": variant.name, "label": variant.label, "paper": variant.paper,
                "flags": [], "status": "failed", "error": "oases train exit code 1"}  # fmt: skip

    monkeypatch.setattr(runner, "run_variant", run)
    out = tmp_path / "cmp"
    assert oases_main(["compare", *ARGV, "--out", str(out), "--", *TINY]) == 130
    assert _stderr_lines(capsys) == [
        f"oases compare: interrupted by Ctrl-C (SIGINT): report of the variants that finished "
        f"(none) in {out}/results.md, failed: megatron, not finished: oases"
    ]
    assert oases_main(["compare", "--reanalyze", str(out)]) == 1
    assert _stderr_lines(capsys) == [
        "oases compare: variant(s) failed: megatron",
        "oases compare: the comparison was interrupted by Ctrl-C (SIGINT) during the timed runs; "
        "not finished: oases; run its command again for a complete one",
    ]


def test_a_pass_cut_short_is_an_error_of_each_variant_not_a_missing_count(
    tmp_path, capsys, monkeypatch
):
    """Interrupted in the host pass: every variant ran, and each says its count was cut short."""
    from megatron_oases.compare import host, runner

    def cut(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(runner, "run_variant", _fake_run(KeyboardInterrupt()))
    monkeypatch.setattr(host, "count_calls", cut)
    out = tmp_path / "cmp"
    argv = ["--variants", "megatron", "--warmup", "1", "--iters", "2", "--out", str(out)]
    assert oases_main(["compare", *argv, "--", *TINY]) == 130
    assert _stderr_lines(capsys) == [
        f"oases compare: interrupted by Ctrl-C (SIGINT): report of the variants that finished "
        f"(megatron) in {out}/results.md"
    ]
    report = json.loads((out / "results.json").read_text())
    assert report["interrupted"]["during"] == "the host pass"
    assert report["variants"][0]["status"] == "ok"
    assert report["variants"][0]["host"] == {"error": "the host pass was interrupted"}


def test_sigterm_raises_while_handled_and_the_handler_is_put_back():
    previous = signal.getsignal(signal.SIGTERM)
    with pytest.raises(interrupts.Terminated):
        with interrupts.handled():
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(5)
            pytest.fail("SIGTERM did not raise")
    assert signal.getsignal(signal.SIGTERM) == previous


def test_a_torchrun_rank_keeps_sigterms_default(monkeypatch):
    """torchrun stops its ranks with SIGTERM and waits for them; Megatron's
    --exit-signal-handler installs its own: a rank must not raise on it."""
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "x")
    previous = signal.getsignal(signal.SIGTERM)
    with interrupts.handled():
        assert signal.getsignal(signal.SIGTERM) == previous


def test_every_command_is_one_line_on_ctrl_c(capsys, monkeypatch):
    """The dispatcher covers every subcommand (here: calibrate and plan, interrupted at once)."""
    import megatron_oases.cli as cli

    def interrupted(argv):
        raise KeyboardInterrupt

    monkeypatch.setattr(cli, "command", lambda name: interrupted)
    for name in cli.COMMANDS:
        assert oases_main([name]) == 130
        assert _stderr_lines(capsys) == [f"oases {name}: interrupted by Ctrl-C (SIGINT)"]


def test_rank_0_alone_prints(capsys, monkeypatch):
    monkeypatch.setenv("RANK", "1")
    assert interrupts.exit_status(interrupts.Terminated(), "oases train") == 143
    assert capsys.readouterr().err == ""


# ------------------------------------------------ a real signal, a real child process
#: ``oases compare`` with each variant's launcher replaced by :data:`_FAKE_LAUNCHER`.
_DRIVER = """
import signal, sys
signal.signal(signal.SIGINT, signal.default_int_handler)  # even where the test's runner ignores it
from megatron_oases.compare import runner
def train_command(variant, train_argv, vdir, nproc, iters, emulate_link=None, one_rank=False):
    return [sys.executable, sys.argv[1], vdir, variant.name], {}
runner.train_command = train_command
from megatron_oases.cli import main
sys.exit(main(sys.argv[2:]))
"""

#: A variant's launcher: ``megatron`` writes its golden values and ends; any other one notes its
#: pid, then sleeps until it is stopped, noting a SIGTERM (torchrun stops its ranks on it).
_FAKE_LAUNCHER = """
import json, os, signal, sys, time
vdir, name = sys.argv[1], sys.argv[2]
if name == "megatron":
    series = {"iteration-time": [0.2, 0.1, 0.1], "tokens-per-sec": [320.0, 640.0, 640.0],
              "lm loss": [6.0, 5.9, 5.8]}
    with open(os.path.join(vdir, "golden.json"), "w") as f:
        json.dump({k: {"values": v} for k, v in series.items()}, f)
    sys.exit(0)
def stopped(signum, frame):
    open(os.path.join(vdir, "got-sigterm"), "w").close()
    sys.exit(143)
signal.signal(signal.SIGTERM, stopped)
with open(os.path.join(vdir, "pid"), "w") as f:
    f.write(str(os.getpid()))
time.sleep(300)
"""


def _alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:  # a zombie is gone for this purpose
        return f.read().rsplit(")", 1)[1].split()[0] != "Z"


@pytest.mark.timeout(180)
def test_ctrl_c_stops_the_run_in_progress_and_leaves_the_report(tmp_path):
    """A real SIGINT to ``oases compare`` while its second variant runs: exit 130, one stderr
    line, the variant's launcher stopped (SIGTERM first, as torchrun needs), the report written."""
    driver, launcher = tmp_path / "driver.py", tmp_path / "launcher.py"
    driver.write_text(_DRIVER)
    launcher.write_text(_FAKE_LAUNCHER)
    out = tmp_path / "cmp"
    cmd = [sys.executable, str(driver), str(launcher), "compare", *ARGV, "--out", str(out)]
    proc = subprocess.Popen(
        cmd + ["--", *TINY],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    pid_file = out / "oases" / "pid"
    deadline = time.monotonic() + 150
    while not pid_file.is_file() or not pid_file.read_text():
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() < deadline, "the second variant never started"
        time.sleep(0.2)
    child = int(pid_file.read_text())
    proc.send_signal(signal.SIGINT)
    stdout, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 130, stdout[-2000:] + stderr[-2000:]
    assert [ln for ln in stderr.splitlines() if ln.strip()] == [
        f"oases compare: interrupted by Ctrl-C (SIGINT): report of the variants that finished "
        f"(megatron) in {out}/results.md, not finished: oases"
    ], stderr
    assert not _alive(child)
    assert (out / "oases" / "got-sigterm").is_file()
    _check_report(out, "Ctrl-C (SIGINT)")
