"""The one bounded reader of every file the package reads: input files (plans, profiles, cluster
profiles, model configs, through :mod:`megatron_oases.formats`) and small control files (the
``--load`` tracker, a run lock, a checkpoint's ``metadata.json``). A regular file only, up to a
size cap, or one :class:`~megatron_oases.errors.OasesConfigError` line naming the file and the
fix: a symlink to ``/dev/zero`` was read until ``MemoryError``, a FIFO hung the job.
"""

import os
import stat

from .errors import OasesConfigError

#: The most bytes an input file (plan, profile, cluster profile, model config) may have: the
#: largest the package writes are a few MB; anything bigger is another file.
MAX_INPUT_BYTES = 64 * 2**20
#: The most bytes a small control file may have: the ``--load`` tracker
#: (``latest_checkpointed_iteration.txt``, one number), a run lock (``.oases-lock``), a
#: checkpoint's ``metadata.json``.
MAX_CONTROL_BYTES = 64 * 2**10


def refusal(what, path, problem, fix):
    """The one line of a file refused: ``{what} {path} {problem}; {fix}``."""
    return OasesConfigError(f"{what} {path} {problem}" + (f"; {fix}" if fix else ""))


def read_bytes(path, what, fix=None, kind="text", limit=MAX_INPUT_BYTES):
    """The bytes of the regular file ``path`` (at most ``limit``, :data:`MAX_INPUT_BYTES` unless
    a smaller control file: :data:`MAX_CONTROL_BYTES`), or one :class:`OasesConfigError` line
    naming ``what`` (``plan file``) and ``fix``: a missing or unreadable path, a directory (not a
    ``kind`` file), a device or pipe (a symlink to ``/dev/zero`` read until ``MemoryError``), a
    larger file. Opened without blocking (a FIFO without a writer hung the job) and checked on
    the open file, then read to at most the cap plus one byte (a file that grows meanwhile is
    caught)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    except FileNotFoundError:
        raise refusal(what, path, "not found", fix) from None
    except OSError as exc:
        raise refusal(f"cannot read {what}", path, f"({exc.strerror})", fix) from None
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        os.close(fd)
        if stat.S_ISDIR(st.st_mode):
            raise refusal(what, path, f"is a directory, not a {kind} file", fix)
        raise refusal(what, path, "is not a regular file (a device, pipe or socket)", fix)
    size = f"{limit // 2**20} MiB" if limit >= 2**20 else f"{limit} bytes"
    too_big = f"is larger than {size}, the most a {what} may be"
    if st.st_size > limit:
        os.close(fd)
        raise refusal(what, path, too_big, fix)
    with os.fdopen(fd, "rb") as f:
        try:
            data = f.read(limit + 1)
        except OSError as exc:
            raise refusal(f"cannot read {what}", path, f"({exc.strerror})", fix) from None
    if len(data) > limit:
        raise refusal(what, path, too_big, fix)
    return data
