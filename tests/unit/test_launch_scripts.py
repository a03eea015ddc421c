"""The launch scripts take values from the environment: each is checked before its use and never
evaluated. Bash arithmetic evaluates a variable's text, command substitutions in array subscripts
included: ``compare_vs_megatron.sh`` ran ``$((BASE_PORT + INDEX))`` on ``MASTER_PORT`` (a command
once per run) and the SLURM script ``$((20000 + ${SLURM_JOB_ID} % 20000))``. Each case here stops
at the check, before anything is launched (and would run only a stub launcher, or print the
command line, if it did not)."""

import glob
import os
import subprocess
import sys

import pytest
from helpers.paths import REPO

SCRIPTS = os.path.join(REPO, "launch_scripts")
#: Sourced by the others, not run.
LIBRARY = "env_checks.sh"
#: Crafted values: evaluated as arithmetic, the subscript of a variable that is set (``PWD``; an
#: unset one stops ``set -u`` first) runs its command, which would leave its mark.
CRAFTED = "PWD[$(touch {mark})]"
ERRORS = {
    "MASTER_PORT": "must be a port number from 1 to 65535",
    "SLURM_JOB_ID": "must be a job number (SLURM sets it)",
    "GPUS_PER_NODE": "must be a positive integer",
    "TRAIN_ITERS": "must be a positive integer",
}
CASES = [
    ("slurm_pretrain_gpt_oases.sh", "MASTER_PORT"),
    ("slurm_pretrain_gpt_oases.sh", "SLURM_JOB_ID"),
    ("compare_vs_megatron.sh", "MASTER_PORT"),
    ("compare_vs_megatron.sh", "SLURM_JOB_ID"),
    ("compare_vs_megatron.sh", "TRAIN_ITERS"),
    ("run_cpu_demo.sh", "MASTER_PORT"),
    ("run_cpu_demo.sh", "GPUS_PER_NODE"),
]


def _run(script, tmp_path, **env):
    keep = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    for k in ("MASTER_PORT", "MASTER_ADDR", "GPUS_PER_NODE", "TRAIN_ITERS", "TP", "PP", "MODEL"):
        keep.pop(k, None)
    stub = tmp_path / "launcher.sh"  # compare_vs_megatron.sh's runs, were they reached
    stub.write_text("exit 0\n")
    full = dict(
        keep,
        DRY_RUN="1",
        DEVICE="cpu",
        PYTHON=sys.executable,
        OASES_ROOT=REPO,
        LAUNCHER=str(stub),
        MATRIX="cpu-demo",
        OUT_DIR=str(tmp_path / "out"),
        LOG_JSON=str(tmp_path / "out.json"),
    )
    full.update(env)
    return subprocess.run(
        ["bash", os.path.join(SCRIPTS, script)],
        env=full,
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
    )


@pytest.mark.parametrize("script,name", CASES)
def test_a_crafted_value_is_one_line_and_never_runs(script, name, tmp_path):
    mark = tmp_path / "crafted-value-ran"
    value = CRAFTED.format(mark=mark)
    proc = _run(script, tmp_path, **{name: value})
    assert not mark.exists(), f"{script} evaluated {name}"
    assert proc.returncode == 2, (proc.returncode, proc.stderr[-2000:])
    assert proc.stderr.splitlines() == [f"error: {name}={value}: {ERRORS[name]}"], proc.stderr
    assert "oases launch:" not in proc.stdout and "oases compare:" not in proc.stdout


def test_every_launch_script_is_covered():
    scripts = {os.path.basename(p) for p in glob.glob(os.path.join(SCRIPTS, "*.sh"))}
    assert scripts - {LIBRARY} == {script for script, _ in CASES}


@pytest.mark.parametrize(
    "env,line",
    [
        (
            {"MASTER_PORT": "70000"},
            "error: MASTER_PORT=70000: must be a port number from 1 to 65535",
        ),
        (
            {"MASTER_PORT": "1\n2"},
            "error: MASTER_PORT=$'1\\n2': must be a port number from 1 to 65535",
        ),
        ({"DEVICE": "gpu"}, "error: DEVICE=gpu: choose one of auto cuda cpu"),
        ({"DRY_RUN": "yes"}, "error: DRY_RUN=yes: choose one of 0 1"),
        ({"MASTER_ADDR": "a b"}, "error: MASTER_ADDR=a b: must be a host name or an IP address"),
    ],
)
def test_other_bad_values_of_the_slurm_script_are_one_line(env, line, tmp_path):
    proc = _run("slurm_pretrain_gpt_oases.sh", tmp_path, **env)
    assert proc.returncode == 2 and proc.stderr.splitlines() == [line], proc.stderr


def test_compare_refuses_ports_past_65535_before_any_run(tmp_path):
    proc = _run("compare_vs_megatron.sh", tmp_path, MASTER_PORT="65535")
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.splitlines() == [
        "error: MASTER_PORT=65535: its 4 runs use ports 65535 to 65538, past 65535; choose a "
        "lower MASTER_PORT"
    ]
    assert not (tmp_path / "out").exists()


def test_checked_values_still_launch(tmp_path):
    """The checks let good values through: the SLURM script's command line (dry run), with the
    port derived from SLURM's job id."""
    proc = _run("slurm_pretrain_gpt_oases.sh", tmp_path, SLURM_JOB_ID="0123457", LR="1e-3")
    assert proc.returncode == 0, proc.stderr
    assert "master=127.0.0.1:23457 " in proc.stdout  # 20000 + 123457 % 20000, not octal
    assert "--min-lr 0.0001" in proc.stdout  # LR reaches Python as an argument, not as code
