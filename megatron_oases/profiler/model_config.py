"""Model shapes for profiling: a YAML file of Megatron-LM argument names, validated the Megatron way.

The project's model configs (``megatron_oases/configs/models/*.yaml``: flag sections ``model``, ``parallel``,
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
under ``models:`` is addressed as ``PATH:NAME``. Keys that name no Megatron-LM (or ``--oases-*``)
flag are rejected. The mapping becomes a command line checked by Megatron-LM's own ``parse_args`` and
``validate_args`` as for a GPU job of DP × TP × PP ranks (so ``bf16`` and the like are accepted);
a shape needs no tokenizer files (``NullTokenizer``), and ``max_position_embeddings`` (the sequence
length), ``vocab_size`` (512) and ``micro_batch_size`` (2) are filled in when absent.
"""

import contextlib
import copy
import io
import os
import warnings

from ..errors import OasesConfigError
from ..resources import available_models, model_config

# Keys that are ours, not Megatron-LM flags.
_EXTRA_KEYS = ("data_parallel_size", "world_size", "name", "description", "notes", "source")
FLAG_SECTIONS = ("model", "parallel", "training")
#: Micro-batch of a model file that gives none (Megatron requires one; measured profiles use it).
DEFAULT_MICRO_BATCH = 2
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
    """A model config file: flags from its flag sections, DP from its ``paper`` section."""
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
    """``PATH``, ``PATH:NAME`` or a packaged model name → flat dict of argument names."""
    path, name = spec, None
    if not os.path.exists(path) and ":" in spec:
        path, name = spec.rsplit(":", 1)
    if not os.path.exists(path) and name is None:
        path = model_config(spec) or path
    if not os.path.exists(path):
        raise OasesConfigError(
            f"model file {spec!r} not found; pass --model PATH.yaml[:NAME] or a packaged model "
            f"({', '.join(available_models())})"
        )
    from ..megatron_lm.configs import check_flag_values, read_yaml

    raw = read_yaml(path, "model file") or {}
    if not isinstance(raw, dict):
        raise OasesConfigError(
            f"model file {path} must hold a mapping of Megatron-LM argument names"
        )
    if "models" in raw:
        models = raw["models"]
        if not isinstance(models, dict) or not models:
            raise OasesConfigError(f"model file {path}: 'models' must map names to models")
        models = {str(k): v for k, v in models.items()}
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
        if not isinstance(raw, dict):
            raise OasesConfigError(
                f"model file {path}: model {name!r} must be a mapping of Megatron-LM argument names"
            )
    elif name is not None:
        raise OasesConfigError(f"{path} holds one model; drop ':{name}'")
    if any(isinstance(raw.get(sec), dict) for sec in FLAG_SECTIONS):
        flat = _project_config(raw)
        for key, value in raw.items():  # top-level settings next to the sections
            if not isinstance(value, dict) and key not in ("name", "source", "description"):
                flat[str(key).replace("-", "_")] = value
        flat["name"] = raw.get("name") or name or os.path.splitext(os.path.basename(path))[0]
    else:
        flat = _flatten(raw)
        flat.setdefault("name", name or os.path.splitext(os.path.basename(path))[0])
    check_flag_values(flat, f"model file {path}")
    return flat


@contextlib.contextmanager
def _offline():
    """Megatron's parse and validation outside a job leave nothing behind: its argument dump on
    stdout and its warnings are swallowed (the job prints them), and ``WORLD_SIZE`` is restored
    (``parse_megatron_args`` defaults it; the measured profiler reads it to detect torchrun)."""
    saved_env = os.environ.get("WORLD_SIZE")
    try:
        with contextlib.redirect_stdout(io.StringIO()), warnings.catch_warnings():
            warnings.simplefilter("ignore")  # e.g. the tokenizer default we override
            yield
    finally:
        if saved_env is None:
            os.environ.pop("WORLD_SIZE", None)
        else:
            os.environ["WORLD_SIZE"] = saved_env


def derive(args):
    """What ``pretrain()`` derives after ``validate_args`` (``set_global_variables``), without
    setting anything global: the padded vocabulary (tokenizer vocabulary padded to a multiple of
    ``make_vocab_size_divisible_by`` × TP) and the number of micro-batches per iteration."""
    if getattr(args, "padded_vocab_size", None) is None:
        from megatron.core.tokenizers.utils.build_tokenizer import (
            build_tokenizer,
            vocab_size_with_padding,
        )

        if args.vocab_size is not None:  # NullTokenizer's vocabulary is --vocab-size
            args.padded_vocab_size = vocab_size_with_padding(
                args.vocab_size, args, logging_enabled=False
            )
        else:
            tok = copy.copy(args)  # the tokenizer reads its vocabulary files
            build_tokenizer(tok)
            args.padded_vocab_size = tok.padded_vocab_size
    if getattr(args, "num_microbatches", None) is None:
        args.num_microbatches = args.global_batch_size // (
            args.micro_batch_size * args.data_parallel_size
        )
    if not getattr(args, "group_query_attention", False):  # Megatron: one group per head
        args.num_query_groups = args.num_attention_heads
    args.disable_bias_linear = not args.add_bias_linear  # the flag's name, as in the shapes
    return args


def parse_offline(argv, world_size, demo=False, cuda=None):
    """Megatron's parse + validate (+ the Oases rules) of an ``oases train`` /
    ``oases-pretrain-gpt`` command line for ``world_size`` ranks, without launching or setting any
    global state; plus :func:`derive`. ``cuda=True`` checks it as for a GPU job (no CPU defaults:
    bf16 and the fused kernels are allowed), otherwise as for this machine. Raises
    :class:`OasesConfigError`."""
    from ..arguments import parse_megatron_args, with_defaults

    argv = with_defaults(list(argv), demo=demo, cuda=cuda)
    with _offline():
        args = parse_megatron_args(argv, prog="oases", world_size=world_size)
    return derive(args)


def megatron_dests():
    """Names (``num_layers``, ``disable_bias_linear``) of every Megatron-LM flag and of the
    ``oases`` group."""
    import argparse

    from megatron.training.arguments import add_megatron_arguments

    from ..arguments import add_oases_args

    parser = add_oases_args(add_megatron_arguments(argparse.ArgumentParser(allow_abbrev=False)))
    names = set()
    for action in parser._actions:  # dest, and the flag's own name (--disable-bias-linear)
        names.add(action.dest)
        names.update(s[2:].replace("-", "_") for s in action.option_strings if s.startswith("--"))
    return names


#: The keys of a model file that say how to run it rather than what it is.
LAYOUT_KEYS = (
    "tensor_model_parallel_size",
    "pipeline_model_parallel_size",
    "data_parallel_size",
    "world_size",
    "micro_batch_size",
    "global_batch_size",
)


def model_argv(flat, shape_only=False):
    """A flat mapping of Megatron-LM argument names as Megatron's flags (checked against its
    parser); ``shape_only``: without :data:`LAYOUT_KEYS` and the defaults that fill them."""
    known = megatron_dests()
    argv = []
    for key, value in flat.items():
        if key in _EXTRA_KEYS or (shape_only and key in LAYOUT_KEYS):
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
    if flat.get("max_position_embeddings") is None and flat.get("seq_length") is not None:
        argv += ["--max-position-embeddings", str(flat["seq_length"])]  # shapes only
    if flat.get("vocab_size") is None and not flat.get("vocab_file"):
        argv += ["--vocab-size", "512"]
    if flat.get("micro_batch_size") is None and not shape_only:
        argv += ["--micro-batch-size", str(DEFAULT_MICRO_BATCH)]
    if not flat.get("tokenizer_type"):
        argv += ["--tokenizer-type", "NullTokenizer"]  # no vocabulary files for a shape
    return argv


def model_args(flat, overrides=None):
    """Validate a flat mapping the Megatron-LM way (its parser and ``validate_args``, as for a GPU
    job of ``data_parallel_size`` × TP × PP ranks); returns Megatron's args."""
    flat = dict(flat)
    flat.update({k: v for k, v in (overrides or {}).items() if v is not None})
    argv = model_argv(flat)
    tp = int(flat.get("tensor_model_parallel_size") or 1)
    pp = int(flat.get("pipeline_model_parallel_size") or 1)
    dp = flat.get("data_parallel_size")
    world = flat.get("world_size")
    if dp is None:
        dp = (int(world) // (tp * pp)) if world else 1
    try:
        args = parse_offline(argv, world_size=int(dp) * tp * pp, cuda=True)
    except OasesConfigError as exc:  # name the model whose settings Megatron refused
        raise OasesConfigError(f"model {flat.get('name')}: {exc}") from None
    args.name = flat.get("name")
    return args


def shape_of(args):
    return {f: getattr(args, f) for f in SHAPE_FIELDS}


def set_overrides(items):
    """``--set KEY=VALUE ...`` → ``{key: YAML value}`` (dashes in keys become underscores)."""
    import yaml

    out = {}
    for item in items:
        if "=" not in item:
            raise OasesConfigError(f"bad --set {item!r}; use KEY=VALUE")
        k, v = item.split("=", 1)
        try:
            out[k.strip().replace("-", "_")] = yaml.safe_load(v)
        except yaml.YAMLError:
            raise OasesConfigError(f"bad --set {item!r}: {v!r} is not a YAML value") from None
    return out
