"""Megatron ``torch_dist`` checkpoints of a per-layer plan, written in the stock (degree-T) layout.

Megatron stacks the layers of a stage into one tensor per parameter name and requires every shard
of such a tensor to have the same shape, so a plan's mix of degrees cannot be saved as it is. At
save time (after Megatron applied its sharded-tensor factories, before it validates), every
sharded tensor of a degree-d layer — parameters and optimizer states alike — is rewritten into the
degree-T shard that this rank covers: the d-shard ``k`` of a rank holds T-shards
``k·T/d … (k+1)·T/d − 1``, and the rank with replica index ``g`` (of T/d) writes T-shard
``k·T/d + g``; replicated tensors (norms, row-parallel biases) get one main replica per TMP domain.
The file is then a stock checkpoint: stock Megatron, another plan or another TP size loads it.
Loading needs no rewrite: torch_dist reads each rank's own (d-layout) slices of the stored tensors.
"""

from dataclasses import replace

import torch

from ..compat import require_symbol

LAYERS = "decoder.layers."


def _planned(model, plans):
    """(decoder, its :class:`~.runtime.LayerDegrees`) of each model chunk that has a plan
    (``plans``: the run's :class:`~.runtime.AttachedPlans`)."""
    out = []
    for chunk in model if isinstance(model, (list, tuple)) else [model]:
        module = chunk
        while hasattr(module, "module"):
            module = module.module
        layer_degrees = plans.of(getattr(module, "decoder", None))
        if layer_degrees is not None:
            out.append((module.decoder, layer_degrees))
    return out


def _param_of(decoder, layer_degrees, layer, key):
    """(degree, param) for the sharded tensor ``key`` of global ``layer``, or None."""
    name = key[key.index(LAYERS) + len(LAYERS) :]
    for local, module in enumerate(decoder.layers):
        if module.layer_number - 1 == layer:
            params = dict(module.named_parameters())
            # Megatron renames some keys in checkpoints (e.g. the local spec's input_layernorm.
            # is saved as TE's self_attention.linear_qkv.layer_norm_): map them back.
            keys_map = getattr(module.submodules_config, "sharded_state_dict_keys_map", None)
            for ours, saved in (keys_map or {}).items():
                if name not in params and name.startswith(saved):
                    name = ours + name[len(saved) :]
            if name not in params:
                raise RuntimeError(
                    f"megatron-oases: checkpoint key {key} matches no parameter of layer {layer}; "
                    "this Megatron's checkpoint layout is not supported for per-layer plans"
                )
            return layer_degrees.degrees[local], params[name]
    return None


def to_stock_layout(sh_ten, degree, param, groups):
    """The degree-T shard of ``sh_ten`` (a shard of a degree-d layer) that this rank writes."""
    T = groups.domain_size
    n, g = T // degree, groups.group_index(degree)
    if not getattr(param, "tensor_model_parallel", False):  # replicated: one main copy per domain
        return _one_main_replica(sh_ten, degree, groups)
    axis = param.partition_dim + sh_ten.prepend_axis_num
    frag = sh_ten.axis_fragmentations[axis]
    index = sh_ten.global_offset[axis] // sh_ten.local_shape[param.partition_dim]
    data = torch.chunk(sh_ten.data, n, dim=param.partition_dim)[g].contiguous()
    offsets = list(sh_ten.global_offset)
    offsets[axis] = (index * n + g) * data.shape[param.partition_dim]
    frags = list(sh_ten.axis_fragmentations)
    frags[axis] = frag * n
    return replace(
        sh_ten,
        data=data,
        local_shape=tuple(data.shape),
        global_offset=tuple(offsets),
        axis_fragmentations=tuple(frags),
    )


def _one_main_replica(sharded, degree, groups):
    """Replica id of a tensor/object all ranks of a degree-d group hold: main on one rank only."""
    rid = tuple(sharded.replica_id) if isinstance(sharded.replica_id, tuple) else (0,)
    first = groups.tp_rank(degree) + degree * groups.group_index(degree)
    return replace(sharded, replica_id=(first,) + rid[1:])


def _degree_of(decoder, layer_degrees, layer):
    for local, module in enumerate(decoder.layers):
        if module.layer_number - 1 == layer:
            return layer_degrees.degrees[local]
    return None


def _locate(state, planned):
    """(degree, param, groups) of a sharded tensor/object of a degree-d (< T) layer, else None."""
    if LAYERS not in state.key or not state.global_offset:
        return None
    for decoder, layer_degrees in planned:
        degree = _degree_of(decoder, layer_degrees, state.global_offset[0])
        if degree is None:  # the layer lives in another model chunk
            continue
        if degree == layer_degrees.groups.domain_size:
            return None
        param = None
        if hasattr(state, "axis_fragmentations"):  # a tensor: which parameter, to find its TP axis
            param = _param_of(decoder, layer_degrees, state.global_offset[0], state.key)[1]
        return degree, param, layer_degrees.groups
    return None


def _rewrite(state, planned, gathers=None, path=()):
    """Every sharded tensor/object of a degree-d layer in the stock layout (see module doc).

    With ``gathers`` (loading), records the path of each rewritten TP-sharded entry and how to
    re-assemble this rank's d-shard from the T-shards its replicas load."""
    from megatron.core.dist_checkpointing.mapping import (
        ShardedObject,
        ShardedTensor,
        ShardedTensorFactory,
    )

    if isinstance(state, dict):
        return {k: _rewrite(v, planned, gathers, path + (k,)) for k, v in state.items()}
    if isinstance(state, list):
        return [_rewrite(v, planned, gathers, path + (i,)) for i, v in enumerate(state)]
    if isinstance(state, ShardedTensorFactory):
        built = state.build()
        built = built if isinstance(built, (list, tuple)) else [built]
        found = _locate(built[0], planned)
        if found is None:
            return state
        degree, param, groups = found
        original_build = state.build_fn

        def build_fn(key, t, replica_id, flattened_range):
            pieces = original_build(key, t, replica_id, flattened_range)
            return [to_stock_layout(p, degree, param, groups) for p in pieces]

        if gathers is not None and getattr(param, "tensor_model_parallel", False):
            gathers.append((path, degree, param, groups, len(built)))
        return replace(state, build_fn=build_fn)
    if isinstance(state, (ShardedTensor, ShardedObject)):
        found = _locate(state, planned)
        if found is None:
            return state
        degree, param, groups = found
        if isinstance(state, ShardedObject):
            return _one_main_replica(state, degree, groups)
        if gathers is not None and getattr(param, "tensor_model_parallel", False):
            gathers.append((path, degree, param, groups, 1))
        return to_stock_layout(state, degree, param, groups)
    return state


def _gather_d_shard(t_shard, degree, param, groups, halves):
    """This rank's d-shard from the T-shards loaded by its T/d replicas (in replica order)."""
    import torch.distributed as dist

    group = groups.replica_group(degree)
    parts = [torch.empty_like(t_shard) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, t_shard.contiguous(), group=group)
    dim = param.partition_dim
    if halves == 1:
        return torch.cat(parts, dim=dim)
    pieces = [torch.chunk(p, halves, dim=dim) for p in parts]  # gated: [gate; up] per shard
    return torch.cat([torch.cat([p[h] for p in pieces], dim=dim) for h in range(halves)], dim=dim)


def _set_path(state, path, value):
    for key in path[:-1]:
        state = state[key]
    state[path[-1]] = value


def _get_path(state, path):
    for key in path:
        state = state[key]
    return state


def make_checkpoint_replacements(plans):
    """Replacements for the ``oases-schedule`` patch when a plan is given; ``plans``: the run's
    :class:`~.runtime.AttachedPlans`, where ``prepare_model`` records each stage's degrees."""
    from megatron.core.dist_checkpointing import serialization
    from megatron.training import training

    # Megatron-LM's loop calls the name it imported into megatron.training.training.
    original_save = require_symbol(
        training, "save_checkpoint", called_by=[training.save_checkpoint_and_time]
    )
    original_pre = require_symbol(serialization, "save_preprocess", called_by=[serialization.save])
    context = {"model": None}

    def save_checkpoint(iteration, model, *args, **kwargs):
        context["model"] = model
        try:
            return original_save(iteration, model, *args, **kwargs)
        finally:
            context["model"] = None

    def save_preprocess(sharded_state_dict, *args, **kwargs):
        planned = _planned(context["model"], plans) if context["model"] is not None else []
        if planned:
            rewritten = _rewrite(sharded_state_dict, planned)
            sharded_state_dict.clear()
            sharded_state_dict.update(rewritten)
        return original_pre(sharded_state_dict, *args, **kwargs)

    import megatron.core.dist_checkpointing as dist_ckpt
    from megatron.training import checkpointing

    original_load = require_symbol(
        dist_ckpt, "load", called_by=[checkpointing._load_global_dist_base_checkpoint]
    )

    def load(sharded_state_dict, checkpoint_dir, *args, **kwargs):
        planned = _planned(context["model"], plans) if context["model"] is not None else []
        if not planned:
            return original_load(sharded_state_dict, checkpoint_dir, *args, **kwargs)
        gathers = []
        request = _rewrite(sharded_state_dict, planned, gathers)
        loaded = original_load(request, checkpoint_dir, *args, **kwargs)
        state = loaded[0] if isinstance(loaded, tuple) else loaded
        for path, degree, param, groups, halves in gathers:
            t_shard = _get_path(state, path)
            _set_path(state, path, _gather_d_shard(t_shard, degree, param, groups, halves))
        return loaded

    original_load_ckpt = require_symbol(
        training, "load_checkpoint", called_by=[training.setup_model_and_optimizer]
    )

    def load_checkpoint(model, *args, **kwargs):
        context["model"] = model
        try:
            return original_load_ckpt(model, *args, **kwargs)
        finally:
            context["model"] = None

    return [
        (training, "save_checkpoint", save_checkpoint),
        (serialization, "save_preprocess", save_preprocess),
        (dist_ckpt, "load", load),
        (training, "load_checkpoint", load_checkpoint),
    ]
