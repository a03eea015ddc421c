"""Apply a per-layer TMP plan to a built GPTModel: rebuild layers whose degree differs from T.

A layer of degree d is rebuilt by Megatron's own ``build_module`` from the block's layer spec with a
``ProcessGroupCollection`` whose ``tp`` is this rank's degree-d group, so its linears shard over d
ranks and communicate on that group. Its parameters are tagged for initialisation, gradient
synchronisation over the replicas and grad-norm de-duplication.
"""

from dataclasses import fields

import torch
import torch.distributed as dist
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.tensor_parallel.random import _fork_rng
from megatron.core.transformer.spec_utils import build_module

from .shards import full_tensor, take_shard


def _with_tp(pgc, tp_group):
    kwargs = {f.name: getattr(pgc, f.name) for f in fields(pgc) if hasattr(pgc, f.name)}
    kwargs["tp"] = tp_group
    if "tp_cp" in kwargs and dist.get_world_size(kwargs.get("cp")) == 1:
        kwargs["tp_cp"] = tp_group
    return ProcessGroupCollection(**kwargs)


@torch.no_grad()
def _copy_weights(old, new, degree, groups, config):
    """Give the degree-d layer the weights of the degree-T layer it replaces (same model)."""
    from megatron.core import parallel_state

    T, tp_group = groups.domain_size, parallel_state.get_tensor_model_parallel_group()
    old_params = dict(old.named_parameters())
    for name, p in new.named_parameters():
        src = old_params[name]
        full = full_tensor(src.data, src, name, config, size=T, group=tp_group)
        dim = p.partition_dim if getattr(p, "tensor_model_parallel", False) else None
        gated = "linear_fc1" in name and getattr(config, "gated_linear_unit", False)
        p.copy_(take_shard(full, dim, groups.tp_rank(degree), degree, gated))


def apply_plan(model, degrees, groups):
    """Rebuild this stage's layers with their planned degree; returns the layer degrees.

    A rebuilt layer gets the weights of the layer Megatron built (all-gathered over the TMP
    domain and re-sharded), so a plan changes the layout, never the model.
    """
    decoder = model.decoder
    stage_degrees = []
    for i, layer in enumerate(decoder.layers):
        d = degrees[layer.layer_number - 1]
        stage_degrees.append(d)
        if d != groups.domain_size:
            # Megatron's RNG states put back after: the rebuilt layer's initialisation is
            # overwritten by the copied weights, and must not shift what Megatron draws for the
            # model chunks built after this one (the interleaved pipeline builds a rank's
            # chunks one after another, each prepared before the next is built)
            with _fork_rng():
                new = build_module(
                    decoder.submodules.layer_specs[i],
                    config=decoder.config,
                    layer_number=i + 1,
                    pg_collection=_with_tp(layer.pg_collection, groups.tp_group(d)),
                    vp_stage=decoder.vp_stage,
                )
            assert new.layer_number == layer.layer_number
            _copy_weights(layer, new, d, groups, decoder.config)
            decoder.layers[i] = new
            layer = new
        for p in layer.parameters():
            p._oases_degree = d
            p._oases_tp_layout = (d, groups.tp_group(d))
            p._oases_replica_index = groups.group_index(d)
    return stage_degrees


def _contiguous_runs(grads):
    """Group gradient tensors into runs that are exactly adjacent in one storage (DDP's main_grad
    buffer lays a layer's parameters out back to back), each returned as one 1-D view. Reducing the
    views in place avoids a flattened copy of every replicated gradient (a transient as large as all
    degree-<T layers' parameters, which would dominate peak memory under recomputation)."""
    runs = []
    for g in sorted(grads, key=lambda t: t.data_ptr()):
        last = runs[-1] if runs else None
        if (
            last is not None
            and g.is_contiguous()
            and g.dtype == last[0].dtype
            and g.untyped_storage().data_ptr() == last[0].untyped_storage().data_ptr()
            and g.data_ptr() == last[0].data_ptr() + last[1] * g.element_size()
        ):
            last[1] += g.numel()
        elif g.is_contiguous():
            runs.append([g, g.numel()])
        else:
            runs.append([g, None])
    out = []
    for first, numel in runs:
        if numel is None:  # not contiguous: reduce it on its own
            out.append(first)
        else:
            out.append(first.as_strided((numel,), (1,), first.storage_offset()))
    return out


def sync_replica_grads(model, groups):
    """Sum the gradients of replicated (degree < T) parameters over their replicas, in place."""
    by_degree = {}
    for p in model.parameters():
        d = getattr(p, "_oases_degree", groups.domain_size)
        if d != groups.domain_size and p.requires_grad:
            g = p.main_grad if hasattr(p, "main_grad") else p.grad
            if g is not None:
                by_degree.setdefault(d, []).append(g)
    for d, grads in sorted(by_degree.items()):
        for view in _contiguous_runs(grads):
            dist.all_reduce(view, group=groups.replica_group(d))


def make_param_is_not_tp_duplicate(original):
    """Grad-norm clipping counts each replica of a degree-d shard once (replica index 0)."""

    def param_is_not_tensor_parallel_duplicate(param, *args, **kwargs):
        if getattr(param, "_oases_replica_index", 0) > 0 and getattr(
            param, "tensor_model_parallel", False
        ):
            return False
        return original(param, *args, **kwargs)

    param_is_not_tensor_parallel_duplicate.__wrapped__ = original
    return param_is_not_tensor_parallel_duplicate
