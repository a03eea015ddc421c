"""Bad input ⇒ one clear error line and exit status 2 from the ``oases`` command itself, run as a
program: once per job (only rank 0 prints), and for an unsupported megatron-core. The parsing
rules themselves, in this process: ``tests/unit/test_arguments.py``."""

import subprocess
import sys


def _cli(*argv, env=None):
    import os

    code = "import sys; from megatron_oases.cli import main; sys.exit(main(sys.argv[1:]))"
    return subprocess.run(
        [sys.executable, "-c", code, *argv],
        capture_output=True,
        text=True,
        timeout=120,
        env=dict(os.environ, **(env or {})),
    )


def test_cli_reports_one_line_and_exit_code():
    proc = _cli("train", "--hidden-size", "65")
    assert proc.returncode == 2
    errors = [ln for ln in proc.stderr.splitlines() if "error" in ln.lower()]
    assert errors == [
        "oases train: error: --hidden-size 65 is not divisible by --num-attention-heads 4"
    ], proc.stderr


def test_cli_prints_an_error_once_per_job():
    """Under torchrun every rank parses; only rank 0 prints."""
    proc = _cli("train", "--hidden-size", "65", env={"RANK": "1"})
    assert proc.returncode == 2 and "error" not in proc.stderr.lower(), proc.stderr


def test_cli_rejects_unsupported_megatron_version():
    code = (
        "import sys, megatron_oases.compat as c; c.megatron_core_version = lambda: '0.16.1'; "
        "from megatron_oases.cli import main; sys.exit(main(['train']))"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    errors = [ln for ln in proc.stderr.splitlines() if "error" in ln]
    assert len(errors) == 1 and "megatron-core 0.16.1 is not supported" in errors[0]
