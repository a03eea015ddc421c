"""``oases``'s dispatcher (``megatron_oases/cli.py``): every subcommand's entry function is
found by its name in ``ENTRIES`` and imported only when it runs; one that moved is Python's own
error naming it, not a quiet exit."""

import subprocess
import sys

import pytest

from megatron_oases import cli


def test_every_subcommand_has_an_entry_function():
    assert list(cli.ENTRIES) == list(cli.COMMANDS)
    for name in cli.COMMANDS:
        assert callable(cli.command(name)), name
    with pytest.raises(KeyError):
        cli.command("nonesuch")


def test_help_imports_no_subcommand():
    """``oases --help`` answers without importing a subcommand's module (nor Megatron)."""
    modules = sorted({f"megatron_oases.{e.split(':')[0]}" for e in cli.ENTRIES.values()})
    code = (
        "import sys\n"
        "from megatron_oases.cli import main\n"
        "assert main(['--help']) == 0\n"
        "print('IMPORTED', sorted(m for m in sys.modules if m in sys.argv[1:] or "
        "m.split('.')[0] == 'megatron'))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code, *modules], capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    assert "IMPORTED []" in out.stdout, out.stdout


@pytest.mark.parametrize(
    "entry, error",
    [("testbed.moved:main", ModuleNotFoundError), ("testbed.calibrate:moved", AttributeError)],
)
def test_a_moved_entry_fails_loudly(monkeypatch, entry, error):
    monkeypatch.setitem(cli.ENTRIES, "calibrate", entry)
    with pytest.raises(error, match="moved"):
        cli.main(["calibrate"])
