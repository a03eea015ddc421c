"""Model shapes for profiling: a YAML file of Megatron-LM argument names, validated the Megatron way.

A model file is a flat (or sectioned) mapping of ``pretrain_gpt.py`` argument names, with dashes or
underscores (``num_layers`` / ``num-layers``)::

    num_layers: 24
    hidden_size: 2048
    num_attention_heads: 32
    seq_length: 1024
    vocab_size: 50257
    tensor_model_parallel_size: 4     # the TMP domain T
    data_parallel_size: 8             # or world_size
    global_batch_size: 128

Sections (``model:``, ``parallel:``, ``training:`` …) are flattened. A file holding several models
under ``models:`` is addressed as ``PATH:NAME``. Keys ``oases train`` does not know are rejected.
"""

import os

import yaml

from ..errors import OasesConfigError

# Keys that are ours, not Megatron-LM flags.
_EXTRA_KEYS = ("data_parallel_size", "world_size", "name", "description", "paper", "notes")
# Fields of the validated args that define the shape of one transformer layer and the model ends.
SHAPE_FIELDS = (
    "num_layers",
    "hidden_size",
    "ffn_hidden_size",
    "num_attention_heads",
    "num_query_groups",
    "kv_channels",
    "seq_length",
    "padded_vocab_size",
    "swiglu",
    "normalization",
    "disable_bias_linear",
    "untie_embeddings_and_output_weights",
    "position_embedding_type",
    "hidden_dropout",
    "attention_dropout",
)


def _flatten(raw, out=None):
    out = {} if out is None else out
    for key, value in raw.items():
        if isinstance(value, dict):
            _flatten(value, out)
        else:
            out[str(key).replace("-", "_")] = value
    return out


def read_model_file(spec):
    """``PATH`` or ``PATH:NAME`` → flat dict of argument names (underscored)."""
    path, name = spec, None
    if not os.path.exists(path) and ":" in spec:
        path, name = spec.rsplit(":", 1)
    if not os.path.exists(path):
        raise OasesConfigError(f"model file {spec!r} not found; pass --model PATH.yaml[:NAME]")
    with open(path) as f:
        raw = yaml.safe_load(f) or {}
    if not isinstance(raw, dict):
        raise OasesConfigError(
            f"model file {path} must hold a mapping of Megatron-LM argument names"
        )
    if "models" in raw:
        models = raw["models"]
        if name is None:
            raise OasesConfigError(
                f"{path} holds several models; pick one with --model {path}:NAME "
                f"(one of {', '.join(models)})"
            )
        if name not in models:
            raise OasesConfigError(
                f"no model {name!r} in {path}; choose one of {', '.join(models)}"
            )
        raw = models[name]
    elif name is not None:
        raise OasesConfigError(f"{path} holds one model; drop ':{name}'")
    flat = _flatten(raw)
    flat.setdefault("name", name or os.path.splitext(os.path.basename(path))[0])
    return flat


def model_args(flat, overrides=None):
    """Validate a flat mapping through ``oases train``'s parser; returns Megatron-style args."""
    from ..arguments import build_parser, validate_args

    flat = dict(flat)
    flat.update({k: v for k, v in (overrides or {}).items() if v is not None})
    parser = build_parser("oases profile")
    known = {a.dest for a in parser._actions}
    argv = []
    for key, value in flat.items():
        if key in _EXTRA_KEYS:
            continue
        if key not in known:
            raise OasesConfigError(
                f"unknown model setting {key!r} (use Megatron-LM argument names)"
            )
        flag = "--" + key.replace("_", "-")
        if isinstance(value, bool):
            if value:
                argv.append(flag)
        elif value is not None:
            argv += [flag, str(value)]
    args = parser.parse_args(argv)
    tp = args.tensor_model_parallel_size
    dp = flat.get("data_parallel_size")
    world = flat.get("world_size")
    if dp is None:
        dp = (int(world) // (tp * args.pipeline_model_parallel_size)) if world else 1
    args = validate_args(
        args, world_size=int(dp) * tp * args.pipeline_model_parallel_size, cuda_available=True
    )
    args.name = flat.get("name")
    return args


def shape_of(args):
    return {f: getattr(args, f) for f in SHAPE_FIELDS}
