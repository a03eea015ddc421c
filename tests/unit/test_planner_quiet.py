"""The front door is quiet: ``oases plan``, ``oases profile`` and ``oases compare`` print no
third-party ``UserWarning`` wall (Megatron / TE / Apex import fallbacks) before their output, while
a warning of ours still shows."""

import os
import subprocess
import sys

import pytest

THIRD_PARTY = ("UserWarning", "Transformer Engine and Apex", "Apex is not installed", "absl")


def _oases(argv, tmp_path, extra_env=None):
    env = dict(os.environ, PYTHONWARNINGS="default", **(extra_env or {}))
    return subprocess.run(
        [sys.executable, "-m", "megatron_oases", *argv],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp_path,
        env=env,
    )


@pytest.mark.parametrize(
    "argv",
    [
        ["plan", "--gpus", "2", "--cluster", "rtx3090-pcie", "--model", "tiny-cpu",
         "--global-batch-size", "4", "--top", "1"],
        ["profile", "--analytic", "--cluster", "rtx3090-pcie", "--model", "tiny-cpu",
         "--out", "profile.json"],
        ["compare", "--nproc", "0"],
    ],
    ids=["plan", "profile", "compare"],
)  # fmt: skip
def test_entry_points_print_no_third_party_warnings(argv, tmp_path):
    out = _oases(argv, tmp_path)
    for text in THIRD_PARTY:
        assert text not in out.stderr, f"oases {argv[0]} printed {text!r}:\n{out.stderr}"
    if argv[0] == "compare":  # a bad flag: our one error line still shows
        assert out.returncode == 2 and "oases compare: error:" in out.stderr
    else:
        assert out.returncode == 0, out.stderr
        assert out.stdout.strip()


def test_megatron_is_imported_and_its_warnings_would_show_unfiltered(tmp_path):
    """The check above can fail: importing what ``oases plan`` imports, without the entry point's
    filters, prints the warning wall on this host."""
    code = "import warnings; warnings.simplefilter('default'); import megatron.core.models.gpt"
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=tmp_path
    )
    assert out.returncode == 0, out.stderr
    try:
        import torch

        cuda = torch.cuda.is_available()
    except ImportError:  # pragma: no cover
        cuda = False
    if not cuda:
        assert "UserWarning" in out.stderr


def test_our_own_warnings_still_show(tmp_path):
    """A warning of ours (the plan's memory margin) is not filtered by the entry point."""
    prof = tmp_path / "profile.json"
    assert _oases(["profile", "--analytic", "--cluster", "rtx3090-pcie", "--model", "tiny-cpu",
                   "--out", str(prof)], tmp_path).returncode == 0  # fmt: skip
    code = (
        "import sys, warnings; from megatron_oases import cli; "
        "real = cli.command; "
        "cli.command = lambda name: (lambda argv: warnings.warn('oases: ours', UserWarning)); "
        "sys.exit(cli.main(['plan', '--profile', 'x']))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=tmp_path
    )
    assert "oases: ours" in out.stderr
