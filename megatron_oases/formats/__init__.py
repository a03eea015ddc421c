"""The files the planner writes and the runtime reads: the contract between them.

* :mod:`.plan` — the per-layer TMP plan (``oases plan --out plan.json``, ``--oases-plan``).
* :mod:`.profile` — the layer profile (``oases profile --out profile.json``, read by ``oases plan``).

Every input file of the package (these two, cluster profiles, model configs) and every small
control file (the ``--load`` tracker, a run lock, a checkpoint's ``metadata.json``) is read
through :func:`read_json`, :func:`read_yaml` or :func:`read_text`: one bounded reader
(:func:`megatron_oases.reading.read_bytes`, at the bottom of the package so that
:mod:`megatron_oases.outputs` reads its run lock through it too) that refuses, in one :class:`OasesConfigError` line naming the file, what is
missing, not a regular file (``/dev/zero``, a pipe), larger than :data:`MAX_INPUT_BYTES` (a
control file: :data:`MAX_CONTROL_BYTES`), binary or malformed; each format's
own validator then checks the values by the one numeric rule (:func:`number_fault`, bounds in
:data:`RANGES`). Plans and profiles are written by :func:`write_atomic`.
"""

import json
import math
import os
import reprlib
import stat

from ..errors import OasesConfigError
from ..reading import MAX_CONTROL_BYTES, MAX_INPUT_BYTES, read_bytes, refusal  # noqa: F401


def read_text(path, what, fix=None, kind="text", limit=MAX_INPUT_BYTES):
    """:func:`read_bytes` decoded as UTF-8; binary content (undecodable, or a NUL byte, which no
    text format here holds) is one line."""
    data = read_bytes(path, what, fix, kind, limit)
    try:
        if b"\0" in data:
            raise UnicodeError
        return data.decode("utf-8")
    except UnicodeError:
        raise refusal(what, path, "is not a text file (binary content)", fix) from None


def read_json(path, what, fix, limit=MAX_INPUT_BYTES):
    """The JSON document in ``path`` (:func:`read_text`); malformed JSON is one
    :class:`OasesConfigError` line naming ``what`` (``plan file``), the line and ``fix``."""
    text = read_text(path, what, fix, kind="JSON", limit=limit)
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise refusal(
            what, path, f"is not valid JSON ({exc.msg} at line {exc.lineno})", fix
        ) from None
    except ValueError:  # an integer of more digits than Python converts (4300)
        raise refusal(what, path, "holds a number too large for any field", fix) from None
    except RecursionError:
        raise refusal(what, path, "is not valid JSON (nested too deeply)", fix) from None


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
        raise refusal(
            what, path, f"is not valid YAML ({problem}{where})", fix or "fix the file"
        ) from None
    except RecursionError:
        raise refusal(
            what, path, "is not valid YAML (nested too deeply)", fix or "fix the file"
        ) from None
    except ValueError:  # an integer of more digits than Python converts (4300)
        raise refusal(
            what, path, "holds a number too large for any field", fix or "fix the file"
        ) from None


def is_number(x):
    """A JSON/YAML number (``bool`` is not one)."""
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def is_finite(x):
    """A number that is neither NaN nor infinite (JSON and YAML can spell both) and that a float
    can hold: an integer such as ``10**400`` is not (``math.isfinite`` on it raised
    ``OverflowError``, a traceback per rank for a plan's ``memory_gb``)."""
    if not is_number(x):
        return False
    try:
        return math.isfinite(x)
    except OverflowError:
        return False


#: The one numeric rule's plausible ranges, per kind of value in an input file (plan, profile,
#: cluster profile): ``kind: (low, high, unit)``, both ends included (``low`` 0 for a value that
#: may be 0). Generous — far beyond any real device — they only catch what no machine is, and
#: would plan in silence with absurd numbers (``sustained_tflops: 1e-300`` planned 300-digit
#: iteration times):
#:
#: * ``tflops``: a GPU's dense rate, 1 GFLOP/s to 1 EFLOP/s (today's: 10 to 5000).
#: * ``bandwidth_gbs``: a link's or memory's bandwidth, 1 MB/s to 1 PB/s (today's: 1 to 10000).
#: * ``latency_us``: a link's per-step latency, up to one second.
#: * ``host_us``: host time per aten call, up to one second (as ``--host-us-per-call``).
#: * ``memory_gb``: a device's memory budget, above 0 up to 100000 GB (as ``--memory``).
#: * ``fraction``: a memory margin, 0 to 10 (1000 %, as ``--margin``).
#: * ``seconds``: a profiled time (one layer, one collective), up to 10^6 s (11 days).
#: * ``s_per_byte``: a fit's time per byte, up to 1 ms per byte (1 kB/s).
#: * ``bytes``: a profiled size or count (bytes, parameters, samples), up to 10^18.
RANGES = {
    "tflops": (1e-3, 1e6, "TFLOPS"),
    "bandwidth_gbs": (1e-3, 1e6, "GB/s"),
    "latency_us": (0, 1e6, "us"),
    "host_us": (0, 1e6, "us"),
    "memory_gb": (0, 1e5, "GB"),
    "fraction": (0, 10, ""),
    "seconds": (0, 1e6, "s"),
    "s_per_byte": (0, 1e-3, "s/byte"),
    "bytes": (0, 1e18, ""),
}


def number_fault(value, kind=None, positive=False):
    """The one numeric rule of every input file: None when ``value`` is a number (not a
    ``bool``) that a float holds, finite, above 0 where ``positive``, and inside ``kind``'s
    :data:`RANGES` (no bound without ``kind``); else what it must be, for the format's one
    line: ``must be {fault}, got ...``."""
    low, high, unit = RANGES[kind] if kind else (None, None, "")
    positive = positive or bool(low)
    what = "a finite positive number" if positive else "a finite number"
    if low:
        what += f" from {low:g} to {high:g}"
    elif high is not None:
        what += f" of at most {high:g}" if positive else f" >= 0 and at most {high:g}"
    what += f" {unit}" if unit else ""
    ok = is_finite(value) and not (positive and value <= 0)
    if ok and low is not None:
        ok = low <= value <= high
    return None if ok else what


#: The one rule's bounds for counts, per kind: ``kind: (low, high)``, generous as :data:`RANGES`.
#:
#: * ``size``: a model dimension, layer count, parallel size or batch (up to 2^31 - 1).
#: * ``gpus_per_node``: up to 4096.
#: * ``sms``: streaming multiprocessors a collective takes (an H100 has 132), up to 1024.
#: * ``dtype_bytes``: bytes per element, 1 to 8.
COUNTS = {
    "size": (1, 2**31 - 1),
    "gpus_per_node": (1, 4096),
    "sms": (1, 1024),
    "dtype_bytes": (1, 8),
}


def count_fault(value, kind="size"):
    """The one rule for a count: an integer (not a ``bool``) inside ``kind``'s :data:`COUNTS`;
    None, or what it must be."""
    low, high = COUNTS[kind]
    if isinstance(value, int) and not isinstance(value, bool) and low <= value <= high:
        return None
    return (
        f"a positive integer of at most {high}" if low == 1 else f"an integer from {low} to {high}"
    )


#: The longest quoted value an error line shows (:func:`quote`): one line reached 106 kB.
MAX_QUOTED = 200
_QUOTE = reprlib.Repr()
_QUOTE.maxlevel, _QUOTE.maxlist, _QUOTE.maxdict = 3, 8, 8
_QUOTE.maxstring = _QUOTE.maxother = _QUOTE.maxlong = MAX_QUOTED


def quote(value):
    """``repr(value)`` for an error line, at most :data:`MAX_QUOTED` characters (bounded for any
    value: a YAML alias can nest a list a billion deep, an integer can have 4000 digits)."""
    if isinstance(value, int) and not isinstance(value, bool) and abs(value) >= 10**30:
        try:
            text = str(value)
        except ValueError:  # beyond Python's limit of digits for str()
            return f"an integer of about {int(value.bit_length() * 0.30103)} digits"
        return f"{text[:8]}... ({len(text.lstrip('-'))} digits)"
    try:
        text = _QUOTE.repr(value)
    except (ValueError, RecursionError):
        text = f"<{type(value).__name__}>"
    if len(text) > MAX_QUOTED:
        text = text[: MAX_QUOTED - 3] + "..."
    return text


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
