"""The files the planner writes and the runtime reads: the contract between them.

* :mod:`.plan` — the per-layer TMP plan (``oases plan --out plan.json``, ``--oases-plan``).
* :mod:`.profile` — the layer profile (``oases profile --out profile.json``, read by ``oases plan``).

Every input file of the package (these two, cluster profiles, model configs) is read through
:func:`read_json` or :func:`read_yaml`: one bounded reader (:func:`read_bytes`) that refuses, in
one :class:`OasesConfigError` line naming the file, what is missing, not a regular file
(``/dev/zero``, a pipe), larger than :data:`MAX_INPUT_BYTES`, binary or malformed; each format's
own validator then checks the values. Plans and profiles are written by :func:`write_atomic`.
"""

import json
import math
import os
import stat

from ..errors import OasesConfigError

#: The most bytes an input file (plan, profile, cluster profile, model config) may have: the
#: largest the package writes are a few MB; anything bigger is another file.
MAX_INPUT_BYTES = 64 * 2**20


def _refuse(what, path, problem, fix):
    return OasesConfigError(f"{what} {path} {problem}" + (f"; {fix}" if fix else ""))


def read_bytes(path, what, fix=None, kind="text"):
    """The bytes of the regular file ``path`` (at most :data:`MAX_INPUT_BYTES`), or one
    :class:`OasesConfigError` line naming ``what`` (``plan file``) and ``fix``: a missing or
    unreadable path, a directory (not a ``kind`` file), a device or pipe, a larger file. Opened
    without blocking (a FIFO without a writer must not hang the command) and checked on the open
    file, then read to at most the cap plus one byte (a file that grows meanwhile is caught)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    except FileNotFoundError:
        raise _refuse(what, path, "not found", fix) from None
    except OSError as exc:
        raise _refuse(f"cannot read {what}", path, f"({exc.strerror})", fix) from None
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        os.close(fd)
        if stat.S_ISDIR(st.st_mode):
            raise _refuse(what, path, f"is a directory, not a {kind} file", fix)
        raise _refuse(what, path, "is not a regular file (a device, pipe or socket)", fix)
    too_big = f"is larger than {MAX_INPUT_BYTES // 2**20} MiB, the most a {what} may be"
    if st.st_size > MAX_INPUT_BYTES:
        os.close(fd)
        raise _refuse(what, path, too_big, fix)
    with os.fdopen(fd, "rb") as f:
        try:
            data = f.read(MAX_INPUT_BYTES + 1)
        except OSError as exc:
            raise _refuse(f"cannot read {what}", path, f"({exc.strerror})", fix) from None
    if len(data) > MAX_INPUT_BYTES:
        raise _refuse(what, path, too_big, fix)
    return data


def read_text(path, what, fix=None, kind="text"):
    """:func:`read_bytes` decoded as UTF-8; binary content (undecodable, or a NUL byte, which no
    text format here holds) is one line."""
    data = read_bytes(path, what, fix, kind)
    try:
        if b"\0" in data:
            raise UnicodeError
        return data.decode("utf-8")
    except UnicodeError:
        raise _refuse(what, path, "is not a text file (binary content)", fix) from None


def read_json(path, what, fix):
    """The JSON document in ``path`` (:func:`read_text`); malformed JSON is one
    :class:`OasesConfigError` line naming ``what`` (``plan file``), the line and ``fix``."""
    text = read_text(path, what, fix, kind="JSON")
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise _refuse(
            what, path, f"is not valid JSON ({exc.msg} at line {exc.lineno})", fix
        ) from None
    except RecursionError:
        raise _refuse(what, path, "is not valid JSON (nested too deeply)", fix) from None


def read_yaml(path, what, fix=None):
    """The YAML document in ``path`` (:func:`read_text`), read with ``yaml.safe_load`` only:
    malformed YAML and tags that would construct Python objects (``!!python/...``) are one
    :class:`OasesConfigError` line naming ``what``, the line and ``fix``."""
    import yaml

    text = read_text(path, what, fix, kind="YAML")
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        if isinstance(exc, yaml.constructor.ConstructorError) and " tag " in problem:
            tag = problem.split(" tag ", 1)[1].strip("'").replace("tag:yaml.org,2002:", "!!")
            problem, where = f"tag {tag}{where} is not allowed: plain YAML, no Python objects", ""
        raise _refuse(
            what, path, f"is not valid YAML ({problem}{where})", fix or "fix the file"
        ) from None
    except RecursionError:
        raise _refuse(
            what, path, "is not valid YAML (nested too deeply)", fix or "fix the file"
        ) from None


def is_number(x):
    """A JSON/YAML number (``bool`` is not one)."""
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def is_finite(x):
    """A number that is neither NaN nor infinite (JSON and YAML can spell both)."""
    return is_number(x) and math.isfinite(x)


def write_atomic(path, text, what):
    """Write ``text`` to ``path`` whole or not at all: into a new file beside it, flushed to disk,
    then renamed over it, so that an interrupted write (Ctrl-C, a full disk, a failed
    serialisation upstream) leaves the old file as it was; the new file keeps an existing file's
    permissions. A ``path`` that exists and is not a regular file (``/dev/stdout``) is written in
    place. A failure is one :class:`OasesConfigError` line naming ``what``."""
    path = os.fspath(path)
    try:
        st = os.stat(path)
    except OSError:  # missing (or unreachable: the write below says why)
        st = None
    try:
        if st is not None and not stat.S_ISREG(st.st_mode):
            with open(path, "w", encoding="utf-8") as f:
                f.write(text)
            return path
        directory, base = os.path.split(os.path.abspath(path))
        tmp = os.path.join(directory, f".{base}.{os.getpid()}.{os.urandom(4).hex()}.tmp")
        try:
            with open(tmp, "x", encoding="utf-8") as f:  # the umask's permissions, as open(path)
                f.write(text)
                f.flush()
                os.fsync(f.fileno())
            if st is not None:
                os.chmod(tmp, stat.S_IMODE(st.st_mode))
            os.replace(tmp, path)
        except BaseException:
            try:
                os.unlink(tmp)
            except OSError:
                pass
            raise
        try:  # the rename itself to disk (best effort: not every filesystem allows it)
            dfd = os.open(directory, os.O_RDONLY)
            try:
                os.fsync(dfd)
            finally:
                os.close(dfd)
        except OSError:
            pass
    except OSError as exc:
        raise OasesConfigError(
            f"cannot write {what} {path} ({exc.strerror or exc}); free space there or choose "
            "another path"
        ) from None
    return path
