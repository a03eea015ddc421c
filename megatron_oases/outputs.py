"""The paths a command writes, checked before its work: one :class:`OasesConfigError` line each.

``oases plan --out``, ``oases profile --out`` (and ``--cache-dir``) and ``oases compare --out``
check their output here right after parsing, so that a path that cannot be written is refused
before a solve, a measured profile or a compare run is spent on it (never a traceback after it):

* :func:`check_output_file`: a directory (or a path ending in ``/``) where a file is expected, a
  parent that is a file, an unwritable location.
* :func:`check_output_dir`: a file where a directory is expected, an unwritable location.

Missing parent directories are not an error: the commands create them when they write
(:func:`make_parent`, ``os.makedirs``), as ``oases profile`` and ``oases compare`` always did; the
check is that they can be created (the nearest existing ancestor is a writable directory).

A directory written by a whole run belongs to one live run at a time (:func:`lock_dir`): training's
``--save`` and ``oases compare --out``.
"""

import json
import os
import socket
import sys
import time

from .errors import OasesConfigError
from .reading import MAX_CONTROL_BYTES, read_bytes


def _nearest_existing(path):
    """``path`` or its nearest ancestor that exists."""
    while not os.path.exists(path):
        parent = os.path.dirname(path)
        if parent == path:
            break
        path = parent
    return path


def _check_location(directory, flag, path):
    """``directory`` (to be created if missing) can hold what ``flag`` ``path`` writes."""
    existing = _nearest_existing(directory)
    if not os.path.isdir(existing):
        raise OasesConfigError(
            f"{flag} {path}: {existing} is a file, not a directory; choose another path"
        )
    if not os.access(existing, os.W_OK | os.X_OK):
        raise OasesConfigError(
            f"{flag} {path}: cannot write in {existing} (permission denied); choose a writable "
            "location"
        )


def check_output_file(path, flag="--out", example="out.json"):
    """Refuse (one line naming the fix) a ``flag`` ``path`` where a file cannot be written;
    ``example``: a file name to suggest when ``path`` is a directory."""
    if not path:
        raise OasesConfigError(f"{flag} needs a file path")
    full = os.path.abspath(path)
    if os.path.isdir(full) or path.endswith(("/", os.sep)):
        raise OasesConfigError(
            f"{flag} {path} is a directory; name the file to write, e.g. "
            f"{flag} {os.path.join(path, example)}"
        )
    if os.path.exists(full):
        if not os.access(full, os.W_OK):
            raise OasesConfigError(
                f"{flag} {path} exists and is not writable (permission denied); choose another "
                "path or make it writable"
            )
        if os.path.isfile(full):  # replaced whole (formats.write_atomic): written beside it
            _check_location(os.path.dirname(full), flag, path)
        return
    _check_location(os.path.dirname(full), flag, path)


def check_output_dir(path, flag="--out"):
    """Refuse (one line naming the fix) a ``flag`` ``path`` where a directory cannot be written
    (new or existing)."""
    if not path:
        raise OasesConfigError(f"{flag} needs a directory path")
    full = os.path.abspath(path)
    if os.path.exists(full) and not os.path.isdir(full):
        raise OasesConfigError(
            f"{flag} {path} is a file, but a directory is written there; pass a directory path "
            "(new or existing) or move the file away"
        )
    _check_location(full, flag, path)


def make_parent(path):
    """Create the missing parent directories of the file ``path`` (checked by
    :func:`check_output_file`)."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)


#: The run lock's file inside a locked directory (:func:`lock_dir`).
LOCK_FILE = ".oases-lock"


def _holder(path):
    """Who holds the lock at ``path``, as its file names it (for the error line), read through
    the one bounded reader."""
    try:
        h = json.loads(read_bytes(path, "run lock", limit=MAX_CONTROL_BYTES))
        return f"pid {h['pid']} on {h['host']}, started {h['started']}"[:200]
    except (OasesConfigError, ValueError, KeyError, TypeError):
        return "another process"


def lock_dir(directory, flag):
    """Take ``directory``'s run lock for this process: an advisory ``fcntl.flock`` on
    ``directory/.oases-lock``, which the kernel releases when the process ends (so a killed run
    leaves no stale lock: a lock file whose process is gone is simply taken over); the file names
    the holder (host, pid, start time) for the error line. Returns the open file (closing it
    releases the lock), or None (with a warning) where the file system has no locks. Raises
    :class:`OasesConfigError` naming ``flag`` when another live run (or another open of this
    process) holds it.

    A holder may remove the file as it ends (``oases compare`` does, so that its results carry
    no lock file): a lock taken on a file no longer at ``path`` is no lock, so it is taken anew."""
    path = os.path.join(directory, LOCK_FILE)
    while True:
        f = _flock(path, directory, flag)
        if f is None:
            return None
        try:
            if os.path.samestat(os.fstat(f.fileno()), os.stat(path)):
                break
        except FileNotFoundError:
            pass
        f.close()
    f.seek(0)
    f.truncate()
    started = time.strftime("%Y-%m-%d %H:%M:%S")
    json.dump({"host": socket.gethostname(), "pid": os.getpid(), "started": started}, f)
    f.flush()
    return f


def _flock(path, directory, flag):
    """``path`` opened (created if missing) and locked for this process: the open file, or None
    where the file system has no locks; refused when another holds it."""
    import fcntl
    import stat

    try:  # never through a link (it could truncate another file), never blocking on a FIFO
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK, 0o644)
    except OSError as exc:
        raise OasesConfigError(
            f"{flag} {directory}: cannot open its run lock {path} ({exc.strerror}); remove it "
            f"(a run lock is a regular file), or choose another {flag} directory"
        ) from None
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise OasesConfigError(
            f"{flag} {directory}: its run lock {path} is not a regular file; remove it, or "
            f"choose another {flag} directory"
        )
    f = os.fdopen(fd, "r+")
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = _holder(path)
        f.close()
        raise OasesConfigError(
            f"{flag} {directory} is in use by another run ({holder}); wait for it to end, stop "
            f"it, or choose another {flag} directory"
        ) from None
    except OSError as exc:  # a file system without flock (some Lustre/NFS mounts): say so
        f.close()
        print(
            f"oases: warning: {flag} {directory} cannot be locked on this file system "
            f"({exc.strerror or exc}): a second live run into it would not be detected",
            file=sys.stderr,
            flush=True,
        )
        return None
    return f
