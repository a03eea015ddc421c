"""The GPU check's driver (``benchmarks/gpu/check.py``) and its step modules
(``benchmarks/gpu/steps/``), without running a step: each step takes exactly the options the
driver hands its process, the driver's flags reach the steps that take them, and no file of the
check grows back past 400 lines (the end-to-end dry run is tests/e2e/test_gpu_check.py)."""

import ast
import inspect
import json
import os
import subprocess
import sys
import types

import pytest
from helpers.paths import REPO, load_script

GPU = os.path.join(REPO, "benchmarks", "gpu")


@pytest.fixture(scope="module")
def check():
    return load_script("benchmarks/gpu/check.py", "gpu_check")


def test_every_step_module_keeps_the_drivers_contract(check):
    assert list(check.STEPS) == [
        "env", "parity", "timing", "host", "split", "graphs", "python", "faithful",
    ]  # fmt: skip
    assert sorted(check.REPORT_ORDER) == sorted(check.STEPS)
    for name, step in check.STEPS.items():
        params = list(inspect.signature(step.run).parameters)
        assert params[0] == "dry", name
        assert sorted(params[1:]) == sorted(step.OPTIONS), name
        assert step.LIMIT_S > 0 and callable(step.report), name


def test_the_drivers_flags_reach_the_steps_that_take_them(check):
    args = check._parser().parse_args(
        ["--rows", "rtx4090-pcie:4:2", "--iters", "3", "--parity-configs", "llama"]
    )
    env = {"gemm_tflops": {"float32": 1.5, "bfloat16": 3.0}, "cuda_available": True}
    env["memory_gbs"] = 900.0

    def flags(name, env=env):
        return check._step_flags(check.STEPS[name], args, env, "/out", 100.0)

    for name in ("env", "host", "split", "python"):
        assert flags(name) == [], name
    assert flags("timing") == ["--gemm-tflops", "3.0"]  # bf16's rate on CUDA
    assert flags("graphs") == ["--gemm-tflops", "3.0", "--trace-dir", "/out"]
    assert flags("parity") == ["--parity-configs", "llama"]
    assert flags("faithful") == [
        "--gemm-tflops", "3.0", "--mem-gbs", "900.0", "--trace-dir", "/out",
        "--deadline-s", "80.0", "--rows", "rtx4090-pcie:4:2", "--iters", "3",
    ]  # fmt: skip
    assert flags("timing", env={}) == []  # no env step: the emulator calibrates its own rates


def test_a_steps_process_runs_it_with_its_options_and_keeps_its_result(
    check, tmp_path, monkeypatch
):
    seen = {}

    def run(dry, save=None, gemm_rate=None, only=None):
        seen.update(dry=dry, gemm_rate=gemm_rate, only=only)
        save({"partial": True})
        return {"done": True}

    fake = types.SimpleNamespace(OPTIONS=("save", "gemm_rate", "only"), run=run)
    result = tmp_path / "result.json"
    argv = ["--step", "fake", "--result", str(result), "--dry-run", "--gemm-tflops", "2.5"]
    argv += ["--parity-configs", "gpt,llama"]
    monkeypatch.setitem(check.STEPS, "fake", fake)
    monkeypatch.setenv("CUDA_DEVICE_MAX_CONNECTIONS", "1")  # what a step's process sets
    assert check.main(argv) == 0
    assert seen == {"dry": True, "gemm_rate": 2.5, "only": ["gpt", "llama"]}
    assert json.loads(result.read_text()) == {"done": True}


def test_no_file_of_the_gpu_check_is_over_400_lines():
    sizes = {}
    for folder, _, names in os.walk(GPU):
        for name in names:
            if name.endswith((".py", ".sh")):
                path = os.path.join(folder, name)
                with open(path) as f:
                    sizes[os.path.relpath(path, GPU)] = sum(1 for _ in f)
    assert "check.py" in sizes and "steps/faithful.py" in sizes
    assert {k: n for k, n in sizes.items() if n > 400} == {}


def _imported_roots(path):
    """The top-level names of every absolute import in ``path`` (lazy ones inside functions too)."""
    with open(path) as f:
        tree = ast.parse(f.read(), path)
    roots = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            roots |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0:
            roots.add(node.module.split(".")[0])
    return roots


def test_the_gpu_check_runs_on_the_package_not_on_the_test_helpers():
    """The check is a tool a lent GPU machine runs: what its steps share with the tests (the
    in-process runs, their caches, the parity comparison) comes from a package module
    (``megatron_oases.training.inprocess``), not from ``tests/helpers``, and the driver puts no
    ``tests/`` on ``sys.path``; the package module itself needs neither pytest nor the tests."""
    files = [os.path.join(folder, name) for folder, _, names in os.walk(GPU) for name in names]
    files = [f for f in files if f.endswith(".py")]
    assert os.path.join(GPU, "steps", "parity.py") in files
    test_side = {"helpers", "tests", "pytest", "conftest"}
    leaks = {os.path.relpath(f, REPO): sorted(_imported_roots(f) & test_side) for f in files}
    assert {k: v for k, v in leaks.items() if v} == {}
    inprocess = os.path.join(REPO, "megatron_oases", "training", "inprocess.py")
    assert not _imported_roots(inprocess) & test_side
    # the driver's own additions to sys.path, in a process that starts without the tests' path
    probe = (
        "import importlib.util, json, sys; before = list(sys.path); "
        f"spec = importlib.util.spec_from_file_location('c', {os.path.join(GPU, 'check.py')!r}); "
        "spec.loader.exec_module(importlib.util.module_from_spec(spec)); "
        "print(json.dumps([p for p in sys.path if p not in before]))"
    )
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    out = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, env=env, cwd="/"
    )
    assert out.returncode == 0, out.stderr[-2000:]
    added = [os.path.normpath(p) for p in json.loads(out.stdout)]
    assert os.path.join(REPO, "tests") not in added, added
    assert added == [REPO, GPU], added
