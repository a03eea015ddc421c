"""Megatron-Core's ``HybridModel`` as Megatron-LM's ``pretrain_hybrid.py`` builds it, for the layer
families the schedules know: ``*`` (self-attention) and ``-`` (dense MLP) of
``--hybrid-layer-pattern``.

Megatron's own hybrid stack spec is Transformer Engine only (its comment: the non-TE spec did not
work for them), and ``HybridStack`` builds its final norm as ``TENorm`` whatever the spec. Without
TE (``--transformer-impl local``) the model here is built from the same local modules as the GPT
path (:func:`local_hybrid_stack_spec`: each GPT local layer cut into its attention half and its
MLP half) and the final norm from the local norm (the ``hybrid-local-norm`` patch, in place only
while the model is built). With TE and no ``--spec`` it is Megatron's default stack, unchanged.
"""

from megatron.core.models.hybrid import hybrid_block

from ..errors import OasesConfigError
from ..patching import Patch


def _local_layer_spec(config):
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    return get_gpt_layer_local_spec(
        qk_layernorm=config.qk_layernorm, normalization=config.normalization
    )


def local_hybrid_stack_spec(config):
    """``HybridStack``'s spec from local (non-TE) modules: ``*`` is a GPT local layer without its
    MLP, ``-`` an ``MLPLayer`` with the GPT local layer's pre-MLP norm and MLP."""
    from megatron.core.models.hybrid.hybrid_block import HybridStack, HybridStackSubmodules
    from megatron.core.ssm.mlp_layer import MLPLayer
    from megatron.core.transformer.spec_utils import ModuleSpec
    from megatron.core.transformer.transformer_layer import (
        TransformerLayer,
        TransformerLayerSubmodules,
    )

    gpt = _local_layer_spec(config).submodules
    # the GPT local layer's checkpoint keys (its norms saved where TE's fused linears keep
    # them), so that GPT and hybrid checkpoints share their layout
    keys = dict(gpt.sharded_state_dict_keys_map)
    attention = TransformerLayerSubmodules(
        input_layernorm=gpt.input_layernorm,
        self_attention=gpt.self_attention,
        self_attn_bda=gpt.self_attn_bda,
        sharded_state_dict_keys_map=keys,
    )
    mlp = TransformerLayerSubmodules(
        pre_mlp_layernorm=gpt.pre_mlp_layernorm,
        mlp=gpt.mlp,
        mlp_bda=gpt.mlp_bda,
        sharded_state_dict_keys_map=keys,
    )
    return ModuleSpec(
        module=HybridStack,
        submodules=HybridStackSubmodules(
            attention_layer=ModuleSpec(module=TransformerLayer, submodules=attention),
            mlp_layer=ModuleSpec(module=MLPLayer, submodules=mlp),
        ),
    )


def local_norm_patch(config):
    """``hybrid_block.TENorm`` → the GPT local spec's norm class (``HybridStack`` hard-codes
    ``TENorm`` for its final norm, which raises without Transformer Engine)."""
    norm_cls = _local_layer_spec(config).submodules.input_layernorm

    def local_norm(config, hidden_size, eps=1e-5, has_residual=False):
        return norm_cls(config=config, hidden_size=hidden_size, eps=eps)

    if not hasattr(hybrid_block, "TENorm"):
        raise OasesConfigError(
            "megatron.core.models.hybrid.hybrid_block.TENorm is gone (Megatron changed); "
            "run HybridModel with Transformer Engine or report it"
        )
    return Patch("hybrid-local-norm", [(hybrid_block, "TENorm", local_norm)])


def build_hybrid_model(args, pg_collection, pre_process=True, post_process=True, vp_stage=None,
                       config=None):  # fmt: skip
    """One ``HybridModel`` stage through Megatron's ``HybridModelBuilder`` (local modules without
    Transformer Engine, see the module docstring)."""
    from megatron.training.argument_utils import hybrid_config_from_args
    from megatron.training.models.hybrid import HybridModelBuilder

    model_config = hybrid_config_from_args(args, config=config)
    local = model_config.transformer.transformer_impl == "local" and args.spec is None
    if local:
        model_config.hybrid_stack_spec = local_hybrid_stack_spec(model_config.transformer)
    builder = HybridModelBuilder(model_config)
    if not local:
        return builder.build_model(
            pg_collection, pre_process=pre_process, post_process=post_process, vp_stage=vp_stage
        )
    patch = local_norm_patch(model_config.transformer)
    patch.install()
    try:
        return builder.build_model(
            pg_collection, pre_process=pre_process, post_process=post_process, vp_stage=vp_stage
        )
    finally:
        patch.uninstall()
