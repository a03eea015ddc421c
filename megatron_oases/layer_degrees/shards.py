"""Tensor-parallel shards of a parameter: its global name, full tensor and a given degree's shard.

Used to give a re-built degree-d layer exactly the weights of the degree-T layer it replaces (a plan
changes the layout, never the model) and by tests to compare gradients across layouts.
"""

import torch
import torch.distributed as dist
from megatron.core import parallel_state


def global_param_names(model):
    """Yield (global name, param), layer indices made global (pipeline-stage independent)."""
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


def _is_gated(name, config):
    return "linear_fc1" in name and getattr(config, "gated_linear_unit", False)


def tp_layout(param):
    """(degree, group) the parameter is sharded over (the plan's, else Megatron's TP)."""
    layout = getattr(param, "_oases_tp_layout", None)
    if layout is not None:
        return layout
    return (
        parallel_state.get_tensor_model_parallel_world_size(),
        parallel_state.get_tensor_model_parallel_group(),
    )


def take_shard(full, dim, rank, size, gated=False):
    """Shard ``rank`` of ``size`` of a full tensor; gated fc1 shards gate and up halves apart."""
    if dim is None or size == 1:
        return full
    if gated:
        halves = torch.chunk(full, 2, dim=dim)
        return torch.cat([torch.chunk(h, size, dim=dim)[rank] for h in halves], dim=dim)
    return torch.chunk(full, size, dim=dim)[rank]


def full_tensor(t, param, name, config, size=None, group=None):
    """All-gather a TP-sharded tensor of ``param`` (value, grad, optimizer state) to full size."""
    if size is None:
        size, group = tp_layout(param)
    if not getattr(param, "tensor_model_parallel", False) or size == 1:
        return t
    dim = param.partition_dim
    parts = [torch.empty_like(t) for _ in range(size)]
    dist.all_gather(parts, t.contiguous(), group=group)
    if _is_gated(name, config):
        halves = [torch.chunk(p, 2, dim=dim) for p in parts]
        return torch.cat([torch.cat([h[k] for h in halves], dim=dim) for k in range(2)], dim=dim)
    return torch.cat(parts, dim=dim)
