"""``--load`` of a checkpoint of another model: refused up front with one line.

Megatron's own ``check_checkpoint_args`` (layers, hidden size, heads, ...) runs on the checkpoint's
saved arguments before any process group or model exists, plus the model-defining flags it does
not compare (norm, MLP, attention groups, positions, biases, vocabulary) — which torch_dist would
otherwise reject deep inside loading with a traceback.
"""

import os

from ..compat import require_symbol
from ..errors import OasesConfigError

#: Flags that change the parameters' names or shapes, beyond Megatron's own comparison.
MODEL_FLAGS = (
    "normalization",
    "swiglu",
    "ffn_hidden_size",
    "query_groups",
    "position_embedding_type",
    "add_bias_linear",
    "untie_embeddings_and_output_weights",
    "padded_vocab_size",
    "kv_channels",
)


def _flag(name):
    return "--num-query-groups" if name == "query_groups" else "--" + name.replace("_", "-")


def _value(args, name):
    if name == "query_groups":  # Megatron fills num_query_groups in late when GQA is off
        gqa = getattr(args, "group_query_attention", False)
        return args.num_query_groups if gqa else args.num_attention_heads
    return getattr(args, name, None)


def check_load_matches(args):
    """Raise :class:`OasesConfigError` if ``--load`` holds a checkpoint of another model."""
    if not args.load or not os.path.isfile(
        os.path.join(args.load, "latest_checkpointed_iteration.txt")
    ):
        return  # nothing to load: Megatron starts from scratch (or fails on its own flag)
    from megatron.training import checkpointing

    load = require_symbol(checkpointing, "_load_base_checkpoint")
    check = require_symbol(checkpointing, "check_checkpoint_args")
    try:
        state_dict, _, _, _ = load(args.load, args, rank0=True)
    except Exception as exc:  # noqa: BLE001 - an unreadable checkpoint is the user's to fix
        raise OasesConfigError(
            f"--load {args.load}: cannot read the checkpoint ({str(exc).splitlines()[0]}); "
            "point --load at a directory written by --save"
        ) from exc
    saved = (state_dict or {}).get("args")
    if saved is None:
        return
    checkpointing.set_checkpoint_version(state_dict.get("checkpoint_version", 0))
    problems = []
    try:
        check(saved)
    except AssertionError as exc:
        problems.append(str(exc).strip())
    for name in MODEL_FLAGS:
        if _value(saved, name) != _value(args, name):
            problems.append(
                f"{_flag(name)} is {_value(saved, name)!r} in the checkpoint, "
                f"{_value(args, name)!r} here."
            )
    if problems:
        raise OasesConfigError(
            f"--load {args.load} holds a checkpoint of another model: {problems[0]} Use the "
            "model flags it was saved with, or another --load directory"
        )
