"""A ``--save`` directory belongs to one run: a second live run into it is refused, and so is a
new run that would write over another run's checkpoints without resuming from them.

Rank 0 holds an advisory lock (``fcntl.flock`` on ``SAVE/.oases-lock``, released by the kernel when
the process ends, so a killed run leaves no stale lock) for the whole job; the lock file names the
holder (host, pid, start time) for the error line. A directory that already holds checkpoints (its
tracker file) is written only by a run that resumes from it (``--load`` the same directory) or is
told to start over (``--oases-start-over``). See ``docs/checkpoints.md``.
"""

import os

from ..errors import OasesConfigError
from ..outputs import lock_dir
from ..patches import Patch, install_patch, is_installed
from .safe_save import TRACKER, read_tracker

PATCH_NAME = "save-dir-lock"


def same_dir(a, b):
    """``a`` and ``b`` name the same directory (both given)."""
    return bool(a and b) and os.path.realpath(a) == os.path.realpath(b)


def check_not_overwriting(args, start_over):
    """Refuse a run that would write over the checkpoints ``--save`` holds without resuming from
    them (``--load`` elsewhere or none), unless ``start_over`` (``--oases-start-over``)."""
    save = getattr(args, "save", None)
    if not save or not os.path.isfile(os.path.join(save, TRACKER)):
        return
    if same_dir(getattr(args, "load", None), save) or start_over:
        return
    try:  # through the one bounded reader
        what = f"checkpoints up to iteration {read_tracker(save)[:20]}"
    except OasesConfigError:
        what = "checkpoints"
    raise OasesConfigError(
        f"--save {save} holds {what} of another run; resume from them with --load {save}, "
        "choose another --save directory, or add --oases-start-over to replace them"
    )


def lock_save_dir(save):
    """Take ``save``'s run lock for this process (the job's rank 0): :func:`..outputs.lock_dir`
    (an open file whose closing releases it, or None with a warning where the file system has no
    locks); raises :class:`OasesConfigError` when another live run holds it."""
    return lock_dir(save, "--save")


def is_job_rank_0():
    """Rank 0 of the job: of the process group once up, else torchrun's ``RANK``."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank() == 0
    return int(os.environ.get("RANK", "0")) == 0


def claim_save_dir(args, start_over):
    """Before training: refuse what would overwrite another run's checkpoints (unless
    ``start_over``), then (rank 0) hold the directory's lock until the job's patches are
    uninstalled."""
    save = getattr(args, "save", None)
    if not save:
        return None
    check_not_overwriting(args, start_over)
    if not is_job_rank_0() or is_installed(PATCH_NAME):
        return None
    held = lock_save_dir(save)
    if held is None:
        return None
    return install_patch(Patch(PATCH_NAME, after_uninstall=held.close))
