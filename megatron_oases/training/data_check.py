"""Data paths checked before the model is built: a missing, empty or damaged ``.idx``/``.bin`` pair
is one line naming the prefix, not a traceback on every rank after the model is built (Megatron
opens the files only when it builds the datasets) or hours into training (a ``.bin`` cut short is
read only when a sample from its end is drawn).

The index check reads a few bytes of each ``.idx`` (Megatron's ``_IndexReader`` layout: header,
version, dtype code, counts, then the sequence lengths, pointers and document indices) and compares
the ``.bin``'s size with the end of its last sequence. Where the vocabulary is known before the
tokenizer is built (``--tokenizer-type NullTokenizer``: ``--vocab-size`` is the vocabulary), the
largest token id of each ``.bin`` is read once (one pass, memory-mapped, by the index's dtype):
an id beyond the vocabulary is masked by Megatron's vocab-parallel embedding and loss in silence
at TP > 1 (an ``IndexError`` at TP 1)."""

import os
import struct

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
                raise OasesConfigError(f"data prefix {prefix}: {path} is empty; {_AGAIN}")
        why = index_problem(prefix)
        if why:
            raise OasesConfigError(f"data prefix {prefix}: {why}; {_AGAIN}")
        why = vocabulary_problem(prefix, _vocabulary(args))
        if why:
            raise OasesConfigError(f"data prefix {prefix}: {why}")


def _vocabulary(args):
    """The vocabulary size known before the tokenizer is built, or None: ``--vocab-size`` under
    ``--tokenizer-type NullTokenizer`` (other tokenizers read theirs from files, not loaded
    here)."""
    if getattr(args, "tokenizer_type", None) == "NullTokenizer":
        return getattr(args, "vocab_size", None)
    return None


_AGAIN = "preprocess the data again (Megatron's tools/preprocess_data.py)"
#: Megatron's ``indexed_dataset``: the index header and the sizes of its dtype codes.
INDEX_HEADER = b"MMIDIDX\x00\x00"
DTYPE_SIZES = {1: 1, 2: 1, 3: 2, 4: 4, 5: 8, 6: 8, 7: 4, 8: 2}
_FIXED = 34  # header 9 + version 8 + dtype code 1 + sequence count 8 + document count 8


def index_problem(prefix):
    """What is wrong with the ``PREFIX.idx``/``PREFIX.bin`` pair (one phrase), or None: a header,
    version or dtype that Megatron's reader refuses, an index shorter than its counts say, a
    ``.bin`` of another size than the index's last sequence ends at."""
    idx, bin_ = prefix + ".idx", prefix + ".bin"
    idx_size = os.path.getsize(idx)
    with open(idx, "rb") as f:
        head = f.read(_FIXED)
        if len(head) < _FIXED or head[:9] != INDEX_HEADER:
            return f"{idx} is not a Megatron index (no MMIDIDX header)"
        version, code, sequences, documents = struct.unpack("<QBQQ", head[9:])
        if version != 1:
            return f"{idx} has index version {version}, Megatron reads version 1"
        if code not in DTYPE_SIZES:
            return f"{idx} names an unknown token dtype (code {code})"
        need = _FIXED + 12 * sequences + 8 * documents
        if idx_size < need:
            return f"{idx} is truncated ({idx_size} of {need} bytes)"
        end = 0
        if sequences:
            f.seek(_FIXED + 4 * (sequences - 1))
            (length,) = struct.unpack("<i", f.read(4))
            f.seek(_FIXED + 4 * sequences + 8 * (sequences - 1))
            (pointer,) = struct.unpack("<q", f.read(8))
            end = pointer + length * DTYPE_SIZES[code]
        if documents:
            f.seek(_FIXED + 12 * sequences + 8 * (documents - 1))
            (last_document,) = struct.unpack("<q", f.read(8))
            if last_document != sequences:
                return (
                    f"{idx} is damaged (its document index ends at {last_document}, "
                    f"not at its {sequences} sequences)"
                )
    have = os.path.getsize(bin_)
    if have < end:
        return f"{bin_} is truncated ({have} of {end} bytes that {os.path.basename(idx)} indexes)"
    if have > end:
        return (
            f"{bin_} holds {have} bytes, {os.path.basename(idx)} indexes {end}: the two files "
            "are not one pair"
        )
    return None


#: numpy's names of Megatron's index dtype codes (``indexed_dataset.DType``).
DTYPE_NAMES = {
    1: "uint8",
    2: "int8",
    3: "int16",
    4: "int32",
    5: "int64",
    6: "float64",
    7: "float32",
    8: "uint16",
}
#: Token ids read per step of :func:`token_id_range` (a bounded working set on any corpus).
_CHUNK = 1 << 24


def token_id_range(prefix):
    """(smallest, largest) token id of ``PREFIX.bin`` (a pair :func:`index_problem` passed), read
    once, memory-mapped in chunks by the index's dtype; None for an empty one."""
    import numpy

    with open(prefix + ".idx", "rb") as f:
        f.seek(17)
        code = f.read(1)[0]
    dtype = numpy.dtype(DTYPE_NAMES[code])
    count = os.path.getsize(prefix + ".bin") // dtype.itemsize
    if count == 0:
        return None
    ids = numpy.memmap(prefix + ".bin", dtype=dtype, mode="r", shape=(count,))
    low, high = None, None
    for start in range(0, count, _CHUNK):
        chunk = ids[start : start + _CHUNK]
        lo, hi = chunk.min().item(), chunk.max().item()
        low = lo if low is None else min(low, lo)
        high = hi if high is None else max(high, hi)
    del ids
    return low, high


def vocabulary_problem(prefix, vocab_size):
    """Why ``PREFIX.bin``'s token ids do not fit a vocabulary of ``vocab_size`` (ids 0 to
    ``vocab_size - 1``), or None (also when ``vocab_size`` is None: not known)."""
    if not vocab_size:
        return None
    found = token_id_range(prefix)
    if found is None:
        return None
    low, high = found
    bin_ = prefix + ".bin"
    if high >= vocab_size:
        return (
            f"{bin_} holds token id {high}, beyond --vocab-size {vocab_size} (ids 0 to "
            f"{vocab_size - 1}; past the padded vocabulary Megatron masks such ids in silence at "
            f"--tensor-model-parallel-size > 1); set --vocab-size to at least {high + 1} (the "
            "vocabulary the data was made with), or preprocess the data again with this run's "
            "tokenizer"
        )
    if low < 0:
        return f"{bin_} holds token id {low}, below 0: not token ids of any tokenizer; {_AGAIN}"
    return None
