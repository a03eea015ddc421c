"""Megatron's dataset helpers, built where they can be built: on every device, not only the CPU.

Megatron-LM's ``initialize_megatron`` runs ``make`` in ``megatron/core/datasets`` on rank 0 and
exits when it fails. The megatron-core wheel ships the helper prebuilt and no Makefile, so that
``make`` fails on any machine (first seen on an H100: every job of the pip-installed Megatron
stopped there). This patch runs ``make`` only where a Makefile is (a Megatron-LM checkout), and a
failed build is one line naming the fix."""

import os
import subprocess
import sys

from ..compat import require_symbol
from ..patches import Patch, install_patch, is_installed

PATCH_NAME = "dataset-helpers"


def compile_dataset_helpers(directory=None):
    """``make`` in ``directory`` (default: ``megatron/core/datasets``) when it has a Makefile;
    nothing for the wheel. A failed build: one line naming what to run, exit 1."""
    if directory is None:
        import megatron.core.datasets as datasets

        directory = os.path.dirname(os.path.abspath(datasets.__file__))
    if not os.path.isfile(os.path.join(directory, "Makefile")):
        return
    proc = subprocess.run(["make", "-C", directory], capture_output=True, text=True)
    if proc.returncode != 0:
        lines = [ln.strip() for ln in proc.stderr.splitlines() if ln.strip()]
        own = [ln for ln in lines if not ln.startswith("make")]  # the compiler's, not make's
        last = next((ln for ln in own if "error" in ln.lower()), (own or lines or ["make"])[-1])
        print(
            f"oases: building Megatron's dataset helpers failed ({last}); run "
            f"`pip install pybind11 && make -C {directory}`, then start again",
            file=sys.stderr,
            flush=True,
        )
        sys.exit(1)


def make_patch():
    from megatron.core.datasets import utils
    from megatron.training import initialize

    require_symbol(utils, "compile_helpers", called_by=[initialize._compile_dependencies])
    return Patch(PATCH_NAME, [(utils, "compile_helpers", compile_dataset_helpers)])


def install():
    """Idempotent; ``patches.uninstall_all()`` reverts it. ``initialize_megatron`` imports
    ``compile_helpers`` from its module at call time, so replacing the module's name suffices."""
    if not is_installed(PATCH_NAME):
        install_patch(make_patch())
