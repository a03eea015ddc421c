"""Build Megatron-Core's GPTModel (local layer spec) from Megatron-LM style arguments.

Weights are initialised *layout-invariantly*: every parameter is drawn as its full, unsharded tensor
from a generator keyed by (seed, global parameter name) and this rank keeps its shard. The same seed
therefore gives the same model under any TP × PP × DP layout (the basis of every parity test), and
different layouts can exchange checkpoints.
"""

import math
import zlib

import torch
from megatron.core import parallel_state
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.transformer import TransformerConfig


def transformer_config_from_args(args):
    import torch.nn.functional as F

    kwargs = dict(
        num_layers=args.num_layers,
        hidden_size=args.hidden_size,
        ffn_hidden_size=args.ffn_hidden_size,
        num_attention_heads=args.num_attention_heads,
        num_query_groups=args.num_query_groups,
        kv_channels=args.kv_channels,
        hidden_dropout=args.hidden_dropout,
        attention_dropout=args.attention_dropout,
        normalization=args.normalization,
        add_bias_linear=not args.disable_bias_linear,
        gated_linear_unit=args.swiglu,
        activation_func=F.silu if args.swiglu else F.gelu,
        bias_activation_fusion=False,
        masked_softmax_fusion=False,
        persist_layer_norm=False,
        bias_dropout_fusion=False,
        apply_rope_fusion=False,
        gradient_accumulation_fusion=False,
        tensor_model_parallel_size=args.tensor_model_parallel_size,
        pipeline_model_parallel_size=args.pipeline_model_parallel_size,
        pipeline_dtype=torch.float32,
        params_dtype=torch.float32,
        use_cpu_initialization=True,
        perform_initialization=True,
        init_method_std=args.init_method_std,
        transformer_impl="local",
        recompute_granularity=args.recompute_granularity,
        recompute_method=args.recompute_method,
        recompute_num_layers=args.recompute_num_layers,
    )
    return TransformerConfig(**kwargs)


def build_model(args, config=None):
    """GPTModel for this pipeline stage (not yet wrapped in DDP)."""
    config = config or transformer_config_from_args(args)
    spec = get_gpt_layer_local_spec(normalization=args.normalization)
    model = GPTModel(
        config=config,
        transformer_layer_spec=spec,
        vocab_size=args.padded_vocab_size,
        max_sequence_length=args.max_position_embeddings,
        pre_process=parallel_state.is_pipeline_first_stage(),
        post_process=parallel_state.is_pipeline_last_stage(),
        parallel_output=True,
        share_embeddings_and_output_weights=not args.untie_embeddings_and_output_weights,
        position_embedding_type=args.position_embedding_type,
    )
    if getattr(args, "oases_plan", None):  # per-layer TMP degrees (megatron_oases.hetero)
        from ..hetero.runtime import attach_plan

        attach_plan(model, args)
    layout_invariant_init_(model, args)
    return model


def global_param_names(model):
    """Yield (global name, param) with layer indices made global (pipeline-stage independent)."""
    layer_of = {}
    decoder = getattr(model, "decoder", None)
    if decoder is not None:
        for local_idx, layer in enumerate(decoder.layers):
            layer_of[f"decoder.layers.{local_idx}."] = f"decoder.layers.{layer.layer_number - 1}."
    for name, param in model.named_parameters():
        for local, glob in layer_of.items():
            if name.startswith(local):
                name = glob + name[len(local) :]
                break
        if getattr(param, "shared_embedding", False) and name == "output_layer.weight":
            name = "embedding.word_embeddings.weight"
        yield name, param


def shard_spec(param, name, tp_size):
    """(partition dim or None, full shape, gated) for a possibly tensor-parallel parameter."""
    if not getattr(param, "tensor_model_parallel", False) or tp_size == 1:
        return None, tuple(param.shape), False
    dim = param.partition_dim
    full = list(param.shape)
    full[dim] *= tp_size
    gated = "linear_fc1" in name and getattr(param, "_oases_gated", False)
    return dim, tuple(full), gated


def take_shard(full, dim, tp_rank, tp_size, gated=False):
    """This rank's shard of a full tensor; SwiGLU fc1 shards gate and up halves separately."""
    if dim is None:
        return full
    if gated:
        halves = torch.chunk(full, 2, dim=dim)
        return torch.cat([torch.chunk(h, tp_size, dim=dim)[tp_rank] for h in halves], dim=dim)
    return torch.chunk(full, tp_size, dim=dim)[tp_rank]


def mark_gated(model, args):
    if args.swiglu:
        for name, param in model.named_parameters():
            if "linear_fc1" in name:
                param._oases_gated = True


@torch.no_grad()
def layout_invariant_init_(model, args):
    """Re-draw weights as full tensors keyed by global name; keep this rank's TP shard."""
    mark_gated(model, args)
    tp_size = parallel_state.get_tensor_model_parallel_world_size()
    tp_rank = parallel_state.get_tensor_model_parallel_rank()
    std = args.init_method_std
    out_std = std / math.sqrt(2.0 * args.num_layers)
    for name, param in global_param_names(model):
        if param.dim() < 2:  # biases and norm weights: Megatron's deterministic init (0 / 1)
            continue
        size, rank = getattr(param, "_oases_tp", (tp_size, tp_rank))
        dim, full_shape, gated = shard_spec(param, name, size)
        gen = torch.Generator().manual_seed(args.seed * 1000003 + zlib.crc32(name.encode()))
        s = out_std if name.endswith(("linear_proj.weight", "linear_fc2.weight")) else std
        full = torch.empty(full_shape, dtype=torch.float32).normal_(0.0, s, generator=gen)
        param.copy_(take_shard(full, dim, rank, size, gated))


def full_tensor(t, param, name):
    """Gather a TP-sharded tensor of ``param`` (its value, grad or optimizer state) to full size."""
    import torch.distributed as dist

    size, _ = getattr(
        param, "_oases_tp", (parallel_state.get_tensor_model_parallel_world_size(), None)
    )
    dim, _, gated = shard_spec(param, name, size)
    if dim is None:
        return t
    group = getattr(param, "_oases_tp_group", parallel_state.get_tensor_model_parallel_group())
    parts = [torch.empty_like(t) for _ in range(size)]
    dist.all_gather(parts, t.contiguous(), group=group)
    if gated:
        halves = [torch.chunk(p, 2, dim=dim) for p in parts]
        return torch.cat([torch.cat([h[k] for h in halves], dim=dim) for k in range(2)], dim=dim)
    return torch.cat(parts, dim=dim)
