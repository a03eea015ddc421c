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
"""

import os

from .errors import OasesConfigError


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
