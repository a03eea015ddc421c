"""Model shapes for profiling: a YAML file of Megatron-LM argument names, validated the Megatron way.

The project's model configs (``configs/models/*.yaml``: flag sections ``model``, ``parallel``,
``training`` and an informational ``paper`` section) are read as they are — by path or by name
(``--model h2048-l24``); the data-parallel degree comes from ``paper.data-parallel-size`` (or
``paper.gpus``). Otherwise a model file is a flat mapping of ``pretrain_gpt.py`` argument names, with
dashes or underscores (``num_layers`` / ``num-layers``)::

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
_EXTRA_KEYS = ("data_parallel_size", "world_size", "name", "description", "notes", "source")
FLAG_SECTIONS = ("model", "parallel", "training")
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


def _project_config(raw):
    """A ``configs/models`` file: flags from its flag sections, DP from its ``paper`` section."""
    flat = {}
    for section in FLAG_SECTIONS:
        _flatten(raw.get(section) or {}, flat)
    paper = {str(k).replace("-", "_"): v for k, v in (raw.get("paper") or {}).items()}
    if "data_parallel_size" not in flat:
        if paper.get("data_parallel_size"):
            flat["data_parallel_size"] = int(paper["data_parallel_size"])
        elif paper.get("gpus"):
            flat["world_size"] = int(paper["gpus"])
    return flat


def read_model_file(spec):
    """``PATH``, ``PATH:NAME`` or a ``configs/models`` name → flat dict of argument names."""
    path, name = spec, None
    if not os.path.exists(path) and ":" in spec:
        path, name = spec.rsplit(":", 1)
    if not os.path.exists(path) and name is None:
        from ..megatron_lm.configs import MODELS_DIR

        candidate = os.path.join(MODELS_DIR, f"{spec}.yaml")
        if os.path.exists(candidate):
            path = candidate
    if not os.path.exists(path):
        raise OasesConfigError(
            f"model file {spec!r} not found; pass --model PATH.yaml[:NAME] or a name under "
            "configs/models/"
        )
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
    if any(isinstance(raw.get(sec), dict) for sec in FLAG_SECTIONS):
        flat = _project_config(raw)
        for key, value in raw.items():  # top-level settings next to the sections
            if not isinstance(value, dict) and key not in ("name", "source", "description"):
                flat[str(key).replace("-", "_")] = value
        flat["name"] = raw.get("name") or name or os.path.splitext(os.path.basename(path))[0]
        return flat
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
