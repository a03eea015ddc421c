"""A Megatron ``TransformerLayer`` seen as two blocks (paper §4.1: computation then all-reduce).

Block ``j`` of a stage is one layer's attention or MLP half, in layer order: a GPT layer gives
two (block ``j`` is layer ``j // 2``'s attention for even j, MLP for odd j); a ``HybridModel``
layer of ``--hybrid-layer-pattern`` gives one (``*`` its attention, ``-`` its MLP; the other
half is Megatron's ``IdentityOp``):

    H_j ──ln_j──▶ L_j ──main_j──▶ partial_j ══all-reduce══▶ R_j ──bda_j(R_j, bias_j, H_j)──▶ H_{j+1}

``main_j`` is ``self_attention`` or ``mlp`` with TMP communication deferred (see :mod:`.linears`):
its forward all-reduce follows it, and its backward all-reduce is on the gradient of ``L_j``.
Under sequence parallelism H_j, R_j and the ln output hold s/t of the sequence, and the one
all-reduce becomes two collectives (Korthikanti et al. 2022)::

    H_j ──ln_j──▶ ══all-gather══▶ L_j ──main_j──▶ partial_j ══reduce-scatter══▶ R_j ──bda_j──▶ H_{j+1}

with a reduce-scatter of L_j's gradient and an all-gather of R_j's gradient in backward.
Everything is called through the layer's own submodules, so Megatron's numerics (fused or not,
LayerNorm/RMSNorm, SwiGLU, GQA, RoPE, dropout) are unchanged.
"""

import contextlib
import functools
import weakref

import torch
from megatron.core.tensor_parallel import CheckpointWithoutOutput
from megatron.core.transformer.identity_op import IdentityFuncOp, IdentityOp

from ...errors import OasesConfigError
from ...validation import check_transformer_impl
from ..engine.blocks import BlockTable


class LayerBlocks(BlockTable):
    """The blocks of a stage's Megatron layers plus the per-forward arguments (mask, RoPE); the
    table's lookups are :class:`..engine.blocks.BlockTable`'s; ``graphs``: a
    :class:`.graphs.BlockGraphs` replaying each main op from a CUDA graph, or None (eager);
    ``deferral``: the :class:`..engine.deferral.Deferral` the layers' linears hold."""

    def __init__(
        self,
        layers,
        attention_mask=None,
        rotary_pos_emb=None,
        attention_bias=None,
        graphs=None,
        deferral=None,
    ):
        self.layers = list(layers)
        self.deferral = deferral  # the stage's (.deferral): a graph's capture defers to it
        self.table = self.table_of(self.layers, _checked)
        self.graphs = graphs
        self.attention_mask = attention_mask
        self.rotary_pos_emb = rotary_pos_emb
        self.attention_bias = attention_bias

    @property
    def sequence_parallel(self):
        return bool(self.layers) and self.layers[0].config.sequence_parallel

    def tp_group(self, j):
        layer, kind, _ = self.table[j]
        owner = layer.self_attention.linear_proj if kind == "attention" else layer.mlp.linear_fc2
        return owner.tp_group

    def ln(self, j, h):
        layer, kind, _ = self.table[j]
        return layer.input_layernorm(h) if kind == "attention" else layer.pre_mlp_layernorm(h)

    def ln_discardable(self, j, h):
        """``ln(j, h)`` and, where Megatron recomputes this norm (``--recompute-modules
        layernorm``), the :class:`CheckpointWithoutOutput` that ran it: the schedule frees the
        output once main_j has consumed it and registers its recomputation on the gradient of
        R_j, as ``TransformerLayer`` does on the gradient of the attention / MLP output. None
        otherwise."""
        layer, kind, _ = self.table[j]
        if kind == "attention":
            norm, recompute = layer.input_layernorm, layer.recompute_input_layernorm
        else:
            norm, recompute = layer.pre_mlp_layernorm, layer.recompute_pre_mlp_layernorm
        if not recompute:
            return norm(h), None
        checkpoint = CheckpointWithoutOutput()
        return checkpoint.checkpoint(norm, h), checkpoint

    @contextlib.contextmanager
    def yield_points(self, callback):
        """``callback()`` inside main_j, where the other sub-batch's short ops may run (see
        :class:`.executor.Interleave`). Forward (and recompute): the MLP's after fc1 (half its
        FLOPs); attention's after core attention, before the output projection: a yield must
        follow every RNG draw of main_j (attention dropout), or the other sub-batch's dropout
        would move main_j's masks off what its recomputation replays. Backward: when the first
        GEMM's (QKV, fc1) output gradient is ready, about halfway. The gradient hook stays on
        the graph after this context ends; ``callback`` decides what is active then."""

        def on_grad(grad):
            callback()

        def backward_yield(module, args, output):  # on the first GEMM's output gradient
            out = output[0] if isinstance(output, tuple) else output
            if torch.is_grad_enabled() and out.requires_grad:
                out.register_hook(on_grad)

        def both(module, args, output):
            backward_yield(module, args, output)
            callback()

        handles = []
        for layer in self.layers:
            qkv = getattr(layer.self_attention, "linear_qkv", None)
            proj = getattr(layer.self_attention, "linear_proj", None)
            fc1 = getattr(layer.mlp, "linear_fc1", None)
            if qkv is not None and proj is not None:
                handles.append(qkv.register_forward_hook(backward_yield))
                handles.append(proj.register_forward_pre_hook(lambda module, args: callback()))
            if fc1 is not None:
                handles.append(fc1.register_forward_hook(both))
        try:
            yield
        finally:
            for handle in handles:
                handle.remove()

    def main(self, j, x, mask=None, rotary_pos_emb=None):
        """Partial (pre-all-reduce) output and bias of the attention / MLP block; ``mask`` and
        ``rotary_pos_emb``: the sub-batch's (:mod:`.split`)."""
        layer, kind, _ = self.table[j]
        attention = kind == "attention"
        owner = layer.self_attention if attention else layer.mlp
        if self.graphs is not None:
            args = (x, mask, rotary_pos_emb, self.attention_bias)
            # the graphs keep the callable: one that holds no micro-batch's LayerBlocks
            call = functools.partial(LayerBlocks._main, owner, attention)
            return self.graphs.run(owner, call, args, self.deferral)
        return self._main(owner, attention, x, mask, rotary_pos_emb, self.attention_bias)

    @staticmethod
    def _main(owner, attention, x, mask, rotary_pos_emb, attention_bias):
        if attention:
            return owner(
                x, attention_mask=mask, rotary_pos_emb=rotary_pos_emb, attention_bias=attention_bias
            )
        return owner(x)

    def bda(self, j, reduced, bias, residual):
        """Bias-dropout-add: residual + dropout(reduced + bias) — affine in (reduced, residual)."""
        layer, kind, _ = self.table[j]
        fn = layer.self_attn_bda if kind == "attention" else layer.mlp_bda
        return fn(layer.training, layer.config.bias_dropout_fusion)(
            (reduced, bias), residual, layer.hidden_dropout
        )


#: layer -> its halves, for the layers :func:`check_layer` accepted (a layer's structure does not
#: change after the model is built; checked once, not at every micro-batch's forward)
_CHECKED = weakref.WeakKeyDictionary()


def _checked(layer):
    kinds = _CHECKED.get(layer)
    if kinds is None:
        check_layer(layer)
        kinds = _CHECKED[layer] = halves(layer)
    return kinds


def halves(layer):
    """The blocks a layer has: ``("attention", "mlp")`` for a GPT layer, one of them for a
    ``HybridModel`` layer (the other half is an ``IdentityOp``)."""
    kinds = tuple(
        kind
        for kind, module in (("attention", layer.self_attention), ("mlp", layer.mlp))
        if not isinstance(module, (IdentityOp, IdentityFuncOp))
    )
    if not kinds:
        raise OasesConfigError(
            f"{type(layer).__name__} has neither self-attention nor an MLP; "
            "use --oases-schedule off"
        )
    return kinds


def check_layer(layer):
    """Reject layer structures the schedule does not model, with the fix in the message."""
    from megatron.core.transformer.transformer_layer import TransformerLayer

    if not isinstance(layer, TransformerLayer):
        raise OasesConfigError(
            f"--oases-schedule supports Megatron TransformerLayer only, got {type(layer).__name__}; "
            "use --oases-schedule off"
        )
    if getattr(layer, "is_moe_layer", False):
        raise OasesConfigError("MoE layers are not supported by --oases-schedule; use off")
    for name in ("pre_cross_attn_layernorm", "cross_attention"):
        if not isinstance(getattr(layer, name), (IdentityOp, IdentityFuncOp)):
            raise OasesConfigError(
                "cross-attention layers are not supported by --oases-schedule; use off"
            )
    config = layer.config
    check_transformer_impl(getattr(config, "transformer_impl", "local"))
    kinds = halves(layer)
    owners = [layer.self_attention.linear_proj] if "attention" in kinds else []
    owners += [layer.mlp.linear_fc2] if "mlp" in kinds else []
    for lin in owners:
        if not getattr(lin, "skip_bias_add", True) and lin.bias is not None:
            raise OasesConfigError(
                "row-parallel linears must use skip_bias_add (Megatron's "
                "default); cannot defer their all-reduce otherwise"
            )
