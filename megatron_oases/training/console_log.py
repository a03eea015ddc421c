"""Megatron's console loss at an interval boundary that is also the run's first iteration.

Megatron-LM (0.19) prints the first iteration of every run (``is_first_iteration``) without
resetting the interval's sums, so that a longer ``--log-interval`` still averages all of its
iterations. When that first iteration is itself a regular log point (``--log-interval 1``, or a
resume right before a boundary) its loss is counted again in the next line: at
``--log-interval 1`` the console's iteration 2 shows the mean of iterations 1 and 2, so a resumed
run and an uninterrupted one print different numbers (``--log-json`` was always exact). This patch
makes such a first iteration an ordinary log point, which resets as every other one does."""

import inspect

from ..compat import require_call, require_symbol
from ..patches import Patch, install_patch, is_installed

PATCH_NAME = "console-log-interval"


def make_patch(log_interval):
    from megatron.training import training

    original = require_symbol(
        training,
        "training_log",
        called_by=[training.train],
        parameters=("iteration", "is_first_iteration"),
    )
    require_call(training.train, "is_first_iteration=is_first_iteration")
    signature = inspect.signature(getattr(original, "__wrapped__", original))

    def training_log(*args, **kwargs):
        bound = signature.bind_partial(*args, **kwargs).arguments
        if kwargs.get("is_first_iteration") and bound.get("iteration", 1) % log_interval == 0:
            kwargs["is_first_iteration"] = False  # a regular log point: reset its sums
        return original(*args, **kwargs)

    training_log.__wrapped__ = original
    return Patch(PATCH_NAME, [(training, "training_log", training_log)])


def install(args):
    """For the run's ``--log-interval`` (idempotent; ``patches.uninstall_all()`` reverts it)."""
    if not is_installed(PATCH_NAME):
        install_patch(make_patch(max(1, int(getattr(args, "log_interval", 1) or 1))))
