"""The schedule's engine (``megatron_oases/schedule/engine/``) needs no Megatron: none of its
modules imports ``megatron`` (lazy imports included), and its unit tests pass in a Python where
importing megatron-core fails, as in an environment without it."""

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
ENGINE = ROOT / "megatron_oases" / "schedule" / "engine"
#: the engine's unit tests: they must not need megatron-core either
ENGINE_TESTS = [
    "tests/unit/test_engine.py",
    "tests/unit/test_executor.py",
    "tests/unit/test_cuts.py",
]

#: run pytest with ``megatron`` unimportable (a finder that refuses it before any other)
_WITHOUT_MEGATRON = """
import sys

class NoMegatron:
    def find_spec(self, name, path=None, target=None):
        if name == "megatron" or name.startswith("megatron."):
            raise ModuleNotFoundError(f"No module named {name!r} (hidden by the test)")
        return None

sys.meta_path.insert(0, NoMegatron())
import pytest
sys.exit(pytest.main(["-q", "-p", "no:cacheprovider", "-o", "addopts=", *sys.argv[1:]]))
"""


def _megatron_imports(path):
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and not node.level:
            names = [node.module or ""]
        else:
            continue
        for name in names:
            if name == "megatron" or name.startswith("megatron."):
                yield node.lineno, name


def test_no_engine_module_imports_megatron():
    found = [
        f"{path.relative_to(ROOT)}:{line} imports {name}"
        for path in sorted(ENGINE.glob("*.py"))
        for line, name in _megatron_imports(path)
    ]
    assert len(list(ENGINE.glob("*.py"))) >= 10, "the engine's modules moved?"
    assert not found, found


def test_the_blocker_hides_megatron():
    """The stand-in environment really has no megatron-core (else the next test proves
    nothing)."""
    code = _WITHOUT_MEGATRON.replace("import pytest\nsys.exit", "import megatron.core\nsys.exit")
    run = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert run.returncode != 0 and "hidden by the test" in run.stderr, run.stderr[-2000:]


def test_engine_unit_tests_pass_without_megatron_core():
    run = subprocess.run(
        [sys.executable, "-c", _WITHOUT_MEGATRON, *ENGINE_TESTS],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-2000:]
    assert " passed" in run.stdout and "skipped" not in run.stdout, run.stdout[-2000:]
