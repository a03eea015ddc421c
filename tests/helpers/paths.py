"""Where things are, for the tests of either tier (``tests/unit``, ``tests/e2e``)."""

import importlib.util
import os

#: This checkout's root (``patches/``, ``launch_scripts/``, ``benchmarks/``, ``.ci/``).
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
#: The ``oases`` command with a fault injected (``OASES_FAULT``), run as a torchrun program.
FAULT_INJECTION = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fault_injection.py")
#: The SLURM launch script (``sbatch`` it, or run it with ``DRY_RUN=1``).
LAUNCHER = os.path.join(REPO, "launch_scripts", "slurm_pretrain_gpt_oases.sh")


def load_script(relpath, name):
    """A script of this checkout (``benchmarks/...``, not a package) imported as module ``name``:
    the tests read a generator's constants and functions from the file that runs them."""
    spec = importlib.util.spec_from_file_location(name, os.path.join(REPO, relpath))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
