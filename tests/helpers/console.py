"""The installed console scripts (``oases-pretrain-gpt``, ``oases-pretrain-hybrid``) under torchrun,
as a user launches them: this interpreter's environment, stdout and stderr together."""

import os
import shutil
import subprocess
import sys

from megatron_oases.launch import torchrun_command


def console_script(name):
    """The path of console script ``name`` installed next to this interpreter."""
    path = shutil.which(
        name, path=os.path.dirname(sys.executable) + os.pathsep + os.environ["PATH"]
    )
    assert path, f"{name} is not installed next to {sys.executable} (pip install -e .)"
    return path


def torchrun(program, argv, nproc=2, timeout=240, cwd=None):
    """``torchrun --nproc_per_node N PROGRAM ARGV`` with this interpreter; (exit code, output)."""
    cmd = torchrun_command(argv, nproc, program=program)
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run(
        cmd,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        timeout=timeout,
        env=env,
        cwd=cwd,
    )
    return proc.returncode, proc.stdout
