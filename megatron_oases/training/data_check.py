"""Data paths checked before the model is built: a missing or empty ``.idx``/``.bin`` pair is one
line naming the prefix, not a traceback on every rank after the model is built (Megatron opens the
files only when it builds the datasets)."""

import os

from ..errors import OasesConfigError


def _prefixes(args):
    """Every dataset prefix the flags name (Megatron's own parsing of the blend lists)."""
    from megatron.training.utils import get_blend_and_blend_per_split

    for path, flag in (
        (args.data_args_path, "--data-args-path"),
        (args.per_split_data_args_path, "--per-split-data-args-path"),
    ):
        if path and "://" not in path and not os.path.isfile(path):
            raise OasesConfigError(f"{flag} {path} does not exist; check the path")
    try:
        blend, per_split = get_blend_and_blend_per_split(args)
    except (OSError, ValueError, KeyError, AssertionError) as exc:
        raise OasesConfigError(f"cannot read the data paths: {exc}") from None
    for b in [blend] + list(per_split or []):
        if b is not None:
            yield from b[0]


def check_data_paths(args):
    """Refuse a ``--data-path`` (or per-split path) whose ``PREFIX.idx``/``PREFIX.bin`` is
    missing or empty. ``--mock-data`` and object-store paths (``scheme://``) are not checked."""
    if getattr(args, "mock_data", False):
        return
    for prefix in _prefixes(args):
        if "://" in prefix:
            continue
        for ext in (".idx", ".bin"):
            path = prefix + ext
            if not os.path.isfile(path):
                raise OasesConfigError(
                    f"data prefix {prefix}: {path} does not exist; --data-path takes the prefix "
                    "of a .bin/.idx pair made by Megatron's tools/preprocess_data.py (without "
                    "the extension), or use --mock-data"
                )
            if os.path.getsize(path) == 0:
                raise OasesConfigError(
                    f"data prefix {prefix}: {path} is empty; preprocess the data again "
                    "(Megatron's tools/preprocess_data.py)"
                )
