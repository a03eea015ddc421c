"""Megatron-Core versions: the supported range and every version-dependent check in one place.

Supported: megatron-core 0.18–0.20.x on Python ≥ 3.12 (0.20: Megatron-LM main at d98e8a64dd,
the whole suite passed there; the wheels ship ``megatron.training``,
i.e. Megatron-LM's own ``pretrain()`` loop, which is our only training driver; 0.16 and older have
no such loop, and 0.17's loop parses the command line itself — see below — so neither is
supported).

The patches replace Megatron symbols by name. :func:`require_symbol` is how each of them checks, at
install time, that the symbol still exists and is the one Megatron calls, so that a Megatron
release which moves or renames it fails with one line instead of silently doing nothing.

Differences between the releases, each handled here and nowhere else:

- 0.18: ``pretrain()`` takes ``model_provider`` before ``model_type`` (0.19: after
  ``forward_step_func``) -- :func:`pretrain_kwargs` passes them by name; the wheel has no GPT model
  builder (0.19: ``megatron.training.models.gpt``) -- :func:`build_gpt_model`.
- torch FSDP2 checkpoints (0.19.2 with torch >= 2.14): ``torch_dist``'s save maps optimizer state
  to parameters by ``id(DTensor.to_local())``, a new tensor each call, so it finds none; its
  in-place load skips ``optimizer.load_state_dict``, which restores the optimizer's step;
  ``torch_dcp``'s load calls ``optimizer.state_dict(is_loading=True)``, which ``ChainedOptimizer``
  does not take -- the ``fsdp2-checkpoint`` patch closes the three, each where it is still open
  (:mod:`megatron_oases.platform.fsdp2_checkpoint`; a release that moved what it replaces stops
  that run at install time with one line, :func:`require_symbol`).
- 0.17 is not handled: its ``pretrain()`` has no ``cfg_container`` and parses the command line
  itself (``initialize_megatron`` -> ``parse_args``/``validate_args``/``set_global_variables``),
  so the parse-then-``pretrain()`` order of :mod:`megatron_oases.training.pretrain` does not fit it.
"""

import functools
import inspect
import os
from importlib import metadata

from .errors import OasesConfigError

#: (lowest, first unsupported) major.minor.
SUPPORTED = ((0, 18), (0, 21))
SUPPORTED_SPEC = ">=0.18,<0.21"
#: The release after the newest admitted one, whose development branch (Megatron-LM main, once it
#: moves past 0.20) ``tests/megatron_main.sh`` checks before it is released, with
#: ``OASES_CHECK_MEGATRON_MAIN=1``: not for training. 0.20 is admitted on the strength of the
#: whole suite passing on Megatron-LM main at d98e8a64dd (0.20.0-dev, docs/megatron-lm.md).
NEXT, NEXT_ENV = (0, 21), "OASES_CHECK_MEGATRON_MAIN"


def megatron_core_version():
    """The version of the megatron-core Python imports: its ``package_info`` (a Megatron-LM
    checkout on ``PYTHONPATH`` shadows an installed wheel, whose metadata would then name the
    wrong release), else the installed distribution's."""
    try:
        from megatron.core.package_info import __version__

        return str(__version__).split("+")[0]  # the release, without the local git tag
    except ImportError:
        pass
    try:
        return metadata.version("megatron-core")
    except metadata.PackageNotFoundError:
        return None


def version_tuple(version=None):
    version = version if version is not None else megatron_core_version()
    try:
        return tuple(int(p) for p in version.split(".")[:2])
    except (AttributeError, ValueError) as exc:
        raise OasesConfigError(f"cannot parse megatron-core version {version!r}") from exc


def check_megatron_core(version=None):
    """Raise :class:`OasesConfigError` unless megatron-core is installed and supported."""
    version = version if version is not None else megatron_core_version()
    if version is None:
        raise OasesConfigError(
            f"megatron-core is not installed; pip install 'megatron-core{SUPPORTED_SPEC}' "
            "(Python >= 3.12)"
        )
    low, high = SUPPORTED
    if version_tuple(version) == NEXT and os.environ.get(NEXT_ENV) == "1":
        return version  # tests/megatron_main.sh: the next release's development branch
    if not (low <= version_tuple(version) < high):
        raise OasesConfigError(
            f"megatron-core {version} is not supported (supported: {SUPPORTED_SPEC}, the releases "
            f"that ship Megatron-LM's training loop); pip install 'megatron-core{SUPPORTED_SPEC}' "
            "on Python >= 3.12"
        )
    return version


# Megatron-Core modules that bind torch collectives to module globals at import time (patching
# ``torch.distributed`` alone misses them): the TP mappings and linears, and DDP's buffers.
MEGATRON_ALIASES = (
    (
        "megatron.core.tensor_parallel.mappings",
        ("dist_all_gather_func", "dist_reduce_scatter_func"),
    ),
    ("megatron.core.tensor_parallel.layers", ("dist_all_gather_func", "dist_reduce_scatter_func")),
    (
        "megatron.core.distributed.param_and_grad_buffer",
        ("dist_all_gather_func", "dist_reduce_scatter_func"),
    ),
)

#: Megatron modules that bind ``torch.distributed._coalescing_manager`` at import time (DDP's
#: bucket groups, Megatron-FSDP's gradient reduction and parameter gathers).
COALESCING_ALIASES = (
    "megatron.core.distributed.param_and_grad_buffer",
    "megatron.core.distributed.fsdp.src.megatron_fsdp.param_and_grad_buffer",
)


def _source(fn):
    """``fn``'s source (unwrapped), or None where Python has none (builtins)."""
    return _read_source(getattr(fn, "__wrapped__", fn))


@functools.lru_cache(maxsize=None)
def _read_source(fn):
    """Read once per function and process: every job's patches check the same ~100 functions,
    and a process that runs many jobs (measurement ranks, ``oases compare``'s passes) paid ~75 ms
    a job re-reading them."""
    try:
        return inspect.getsource(fn)
    except (OSError, TypeError):
        return None


def require_call(fn, text):
    """Check that Megatron's ``fn`` still contains ``text`` (the call or statement a patch relies
    on); one line naming both and the supported range otherwise."""
    source = _source(fn)
    if source is not None and text not in source:
        raise OasesConfigError(
            f"this megatron-core ({megatron_core_version()}) no longer has {text!r} in "
            f"{fn.__qualname__}; megatron-oases supports megatron-core {SUPPORTED_SPEC}"
        )


def require_symbol(owner, name, called_by=(), parameters=()):
    """Return ``owner.name`` after checking it is what Megatron calls.

    ``called_by``: functions whose source must mention ``name`` (the replaced symbol is still what
    they call). ``parameters``: names the symbol's signature must have (our replacement forwards
    them). Raises :class:`OasesConfigError` naming the symbol and the supported range.
    """
    where = f"{getattr(owner, '__module__', '')}.{getattr(owner, '__name__', owner)}.{name}"
    where = where.lstrip(".")

    def fail(why):
        raise OasesConfigError(
            f"this megatron-core ({megatron_core_version()}) {why}: {where}; megatron-oases "
            f"supports megatron-core {SUPPORTED_SPEC}"
        )

    value = getattr(owner, name, None)
    if value is None:
        fail("has no")
    for caller in called_by:
        source = _source(caller)
        if source is not None and name not in source:
            fail(f"no longer calls it from {caller.__qualname__}")
    if parameters:
        target = getattr(value, "__wrapped__", value)
        present = set(inspect.signature(target).parameters)
        missing = [p for p in parameters if p not in present]
        if missing:
            fail(f"changed the signature (missing {', '.join(missing)})")
    return value


#: Where ``TransformerLayer`` builds its norms' ``CheckpointWithoutOutput`` (selective recompute of
#: ``layernorm``), newest first: Megatron-LM main (0.20-dev) moved the input norm's from
#: ``_forward_attention`` (0.18, 0.19) into ``_run_input_layernorm``.
NORM_CHECKPOINT_CALLERS = (
    ("0.20-dev", ("_run_input_layernorm", "_forward_pre_mlp_layernorm")),
    ("0.18-0.19", ("_forward_attention", "_forward_pre_mlp_layernorm")),
)


def norm_checkpoint_callers(layer_cls):
    """The ``TransformerLayer`` methods that checkpoint its two norms, for this megatron-core."""
    for _, names in NORM_CHECKPOINT_CALLERS:
        if all(hasattr(layer_cls, n) for n in names):
            return tuple(getattr(layer_cls, n) for n in names)
    expected = "; ".join(f"{v}: {', '.join(n)}" for v, n in NORM_CHECKPOINT_CALLERS)
    raise OasesConfigError(
        f"this megatron-core ({megatron_core_version()}) has none of the TransformerLayer methods "
        f"that checkpoint its norms (expected {expected}); megatron-oases supports "
        f"megatron-core {SUPPORTED_SPEC}"
    )


def pretrain_kwargs(cfg_container, datasets_provider, model_type, forward_step, model_provider):
    """Arguments of ``megatron.training.pretrain`` by name: 0.18 takes ``model_provider`` third
    (before ``model_type``), 0.19 takes it after ``forward_step_func`` and optional; the names are
    the same in both."""
    return dict(
        cfg_container=cfg_container,
        train_valid_test_dataset_provider=datasets_provider,
        model_type=model_type,
        forward_step_func=forward_step,
        model_provider=model_provider,
    )


def build_gpt_model(
    args, pg_collection, pre_process=True, post_process=True, vp_stage=None, config=None
):
    """One GPT model stage, as Megatron-LM's ``pretrain_gpt.py`` builds it (local layer spec).

    0.19+: ``megatron.training.models.gpt.GPTModelBuilder`` on ``gpt_config_from_args``. 0.18's
    wheel has neither (the builder was Megatron-LM's ``gpt_builders.py``, outside the wheel): its
    dense local-spec branch is reproduced here; models it would build otherwise (MoE, MTP, a
    ``--spec``, experimental attention, heterogeneous layers) need 0.19.
    """
    try:
        from megatron.training.argument_utils import gpt_config_from_args
        from megatron.training.models.gpt import GPTModelBuilder
    except ImportError:
        pass
    else:
        return GPTModelBuilder(gpt_config_from_args(args, config=config)).build_model(
            pg_collection, pre_process=pre_process, post_process=post_process, vp_stage=vp_stage
        )
    return local_gpt_model(args, pg_collection, pre_process, post_process, vp_stage, config)


def local_gpt_model(
    args, pg_collection, pre_process=True, post_process=True, vp_stage=None, config=None
):
    """0.18's path of :func:`build_gpt_model` (also run on 0.19 by the tests, against the
    builder, so that it keeps building the same model)."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.training.argument_utils import core_transformer_config_from_args

    for flag in (
        "num_experts",
        "mtp_num_layers",
        "spec",
        "experimental_attention_variant",
        "heterogeneous_layers_config_path",
        "yaml_cfg",
    ):
        if getattr(args, flag, None):
            raise OasesConfigError(
                f"--{flag.replace('_', '-')} needs megatron-core >= 0.19 (Megatron's GPT model "
                f"builder); this is {megatron_core_version()}"
            )
    config = config if config is not None else core_transformer_config_from_args(args)
    vocab_size = args.padded_vocab_size
    if vocab_size is None:  # set with Megatron's globals; as the 0.19 builder does without them
        from megatron.training.vocab_utils import calculate_padded_vocab_size

        vocab_size = calculate_padded_vocab_size(
            args.vocab_size, args.make_vocab_size_divisible_by, args.tensor_model_parallel_size
        )
    spec = get_gpt_layer_local_spec(
        args.num_experts,
        args.moe_grouped_gemm,
        args.qk_layernorm,
        args.multi_latent_attention,
        normalization=args.normalization,
        qk_l2_norm=getattr(args, "qk_l2_norm", False),
        use_kitchen=config.use_kitchen,
        use_kitchen_attention=config.use_kitchen_attention,
        kitchen_attention_backend=config.kitchen_attention_backend,
    )
    return GPTModel(
        config=config,
        transformer_layer_spec=spec,
        vocab_size=vocab_size,
        max_sequence_length=args.max_position_embeddings,
        pre_process=pre_process,
        post_process=post_process,
        fp16_lm_cross_entropy=args.fp16_lm_cross_entropy,
        parallel_output=True,
        share_embeddings_and_output_weights=not args.untie_embeddings_and_output_weights,
        position_embedding_type=args.position_embedding_type,
        rotary_percent=args.rotary_percent,
        rotary_base=args.rotary_base,
        rope_scaling=args.use_rope_scaling,
        rope_scaling_factor=args.rope_scaling_factor,
        seq_len_interpolation_factor=args.rotary_seq_len_interpolation_factor,
        pg_collection=pg_collection,
        vp_stage=vp_stage,
    )


#: Where :func:`set_finalize_model_grads` keeps the hook for releases that drop it.
_FINALIZE_STASH = "_oases_finalize_model_grads_func"


def set_finalize_model_grads(config, func):
    """Set a model builder's ``finalize_model_grads_func`` on the model ``config``.

    0.19's ``train()`` keeps a hook the builder set (it defaults it only when unset); 0.17/0.18's
    ``train()`` overwrites it with ``finalize_model_grads`` unconditionally. The hook is also kept
    aside here, for :func:`finalize_model_grads_replacements` to call it there.
    """
    config.finalize_model_grads_func = func
    setattr(config, _FINALIZE_STASH, func)


def finalize_model_grads_replacements():
    """Before 0.19: a replacement of ``finalize_model_grads`` as ``megatron.training.training``
    names it (what ``train()`` sets on the config) that runs the hook set by
    :func:`set_finalize_model_grads`, if any, else Megatron's; none from 0.19 on."""
    if version_tuple() >= (0, 19):
        return []
    from megatron.core.utils import get_model_config
    from megatron.training import training

    original = require_symbol(training, "finalize_model_grads", called_by=[training.train])

    def finalize_model_grads(model, *args, **kwargs):
        hook = getattr(get_model_config(model[0]), _FINALIZE_STASH, None)
        return (hook or original)(model, *args, **kwargs)

    finalize_model_grads.__wrapped__ = original
    return [(training, "finalize_model_grads", finalize_model_grads)]
