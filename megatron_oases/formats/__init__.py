"""The files the planner writes and the runtime reads: the contract between them.

* :mod:`.plan` — the per-layer TMP plan (``oases plan --out plan.json``, ``--oases-plan``).
* :mod:`.profile` — the layer profile (``oases profile --out profile.json``, read by ``oases plan``).
"""

import json

from ..errors import OasesConfigError


def read_json(path, what, fix):
    """The JSON object in ``path``; a missing, unreadable, binary or malformed file is one
    :class:`OasesConfigError` line naming ``what`` (``plan file``) and ``fix``."""
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except FileNotFoundError:
        raise OasesConfigError(f"{what} {path} not found; {fix}") from None
    except IsADirectoryError:
        raise OasesConfigError(f"{what} {path} is a directory, not a JSON file; {fix}") from None
    except UnicodeDecodeError:
        raise OasesConfigError(
            f"{what} {path} is not a text file (binary content); {fix}"
        ) from None
    except json.JSONDecodeError as exc:
        raise OasesConfigError(
            f"{what} {path} is not valid JSON ({exc.msg} at line {exc.lineno}); {fix}"
        ) from None
    except OSError as exc:
        raise OasesConfigError(f"cannot read {what} {path} ({exc.strerror}); {fix}") from None
