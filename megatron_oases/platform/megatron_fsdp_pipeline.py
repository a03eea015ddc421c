"""``megatron-fsdp-pipeline``: stock Megatron-FSDP (``--use-megatron-fsdp``) with pipeline stages
(``--pipeline-model-parallel-size > 1``), on any device.

megatron-core 0.19.2's Megatron-FSDP fails there in two places, neither of them in what it
computes; each replacement builds the same object another way:

* **Its device mesh.** ``FullyShardedDataParallel._init_dist_index`` lays its data-parallel x
  tensor-parallel mesh out with ``_get_dp_tp_mesh``, which splits ``arange(world_size)`` as
  ``(dp_cp ep tp)``: with pipeline stages the world is DP x TP x PP, and that rearrange fails on
  every rank. The replacement builds the same mesh from the groups themselves: row ``i`` is the
  tensor-parallel group of the data-parallel group's rank ``i`` (one ``all_gather_object`` over
  the data-parallel group, once, while the model is wrapped), checked as the original checks its
  own (this rank's row is its tensor-parallel group, its column its data-parallel group). Without
  pipeline stages both give the same mesh.
* **The stage output.** Megatron-FSDP's forward hooks return each root module's output as
  ``output.view_as(output)`` (a distinct tensor to hang its pre-backward hook on), and the
  pipeline schedule's ``deallocate_output_tensor`` refuses a view ("counter-productive to free a
  view of another tensor"). The adapter's ``forward`` returns instead an alias of the same
  storage that is not a view (an identity autograd node): the gradient flows through it into the
  view, so the hook still fires; freeing the alias's data frees the storage, as for DDP.

* **The tied embedding's gradient.** With ``--untie-embeddings-and-output-weights`` off, the first
  and last stages each hold a copy of the word embedding, and ``finalize_model_grads`` sums their
  gradients over the embedding group through ``_allreduce_embedding_grad``. Under Megatron-FSDP
  that takes the gradient's local shard, all-reduces it, and assigns the shard back as the
  parameter's whole ``.grad``, which torch refuses (a shard's shape); and a shard's rows on one
  stage need not be the other stage's (each stage's buffer lays its parameters out its own way).
  The replacement keeps Megatron's choice of module, weight and group (it runs the original with
  a getter that only records the weight) and sums the gradient in place: the local shards as they
  are where every rank's shard covers the same rows as its partner's on the other stage
  (agreed over the data-parallel group, so all take the same path), else the whole gradient,
  gathered over the data-parallel group, summed, and this rank's rows kept. Three small
  collectives a step (the shards' rows, the agreement), on the embedding ranks only.

The engine needs nothing else: each stage's layers are gathered and their gradients handed over by
the split schedules as without pipeline stages (``schedule/megatron/fsdp_params.py``).
"""

import functools
import importlib
import math

import torch

from ..compat import require_call, require_symbol
from ..patching import Patch

PATCH_NAME = "megatron-fsdp-pipeline"


def dp_tp_mesh_of_groups(dp_cp_group, tp_group, ep_size=1):
    """The ``[dp, tp]`` rank mesh of this rank's data-parallel and tensor-parallel groups (the
    signature of the adapter's ``_get_dp_tp_mesh``; ``ep_size`` needs no use: the groups given
    are already the expert ones where the adapter asks for an expert mesh)."""
    dist = torch.distributed
    rank = dist.get_rank()
    tp_ranks = dist.get_process_group_ranks(tp_group) if tp_group is not None else [rank]
    rows = [None] * dp_cp_group.size()
    dist.all_gather_object(rows, tp_ranks, group=dp_cp_group)
    mesh = torch.tensor(rows, dtype=torch.long)
    column = tp_ranks.index(rank)
    dp_ranks = dist.get_process_group_ranks(dp_cp_group)
    if mesh[:, column].tolist() != dp_ranks or rank not in mesh[dp_ranks.index(rank)].tolist():
        raise RuntimeError(
            f"Megatron-FSDP's mesh from the groups {mesh.tolist()} does not hold rank {rank}'s "
            f"data-parallel group {dp_ranks} as a column and its tensor-parallel group "
            f"{tp_ranks} as a row: these groups are not a data x tensor-parallel grid"
        )
    return mesh


class _NotAView(torch.autograd.Function):
    """Identity whose output shares the input's storage without being a view of it."""

    @staticmethod
    def forward(ctx, x):
        return x.detach()

    @staticmethod
    def backward(ctx, grad):
        return grad


def not_a_view(output):
    """``output`` as is, unless it is a tensor that is a view: then an alias that is not one."""
    if isinstance(output, torch.Tensor) and output._base is not None:
        return _NotAView.apply(output)
    return output


def make_forward(original):
    """The adapter's ``forward``, its output handed to the pipeline as no view (docstring)."""

    @functools.wraps(original)
    def forward(self, *inputs, **kwargs):
        return not_a_view(original(self, *inputs, **kwargs))

    return forward


def whole_of(dtensor, offsets):
    """The whole tensor of ``dtensor``, its shards possibly uneven (Megatron-FSDP's are: each
    parameter's rows are where its bucket's shard boundaries fall), gathered over each sharded
    mesh dimension in turn, each rank's piece padded to the largest (collectives take equal
    sizes). ``offsets``: this rank's piece's place in the whole."""
    from torch.distributed.tensor.placement_types import Shard

    dist = torch.distributed
    pieces = [(tuple(offsets), dtensor._local_tensor.detach().contiguous())]
    for dim, placement in enumerate(dtensor.placements):
        if not isinstance(placement, Shard):  # Replicate (a _StridedShard is a Shard)
            continue
        group = dtensor.device_mesh.get_group(dim)
        layouts = [None] * dist.get_world_size(group)
        dist.all_gather_object(layouts, [(o, tuple(t.shape)) for o, t in pieces], group=group)
        size = max(sum(math.prod(shape) for _, shape in layout) for layout in layouts)
        flat = torch.cat([t.reshape(-1) for _, t in pieces])
        mine = flat.new_zeros(size)
        mine[: flat.numel()] = flat
        gathered = [torch.empty_like(mine) for _ in layouts]
        dist.all_gather(gathered, mine, group=group)
        pieces = []
        for layout, buffer in zip(layouts, gathered):
            start = 0
            for offset, shape in layout:
                pieces.append((offset, buffer[start : start + math.prod(shape)].view(shape)))
                start += math.prod(shape)
    whole = pieces[0][1].new_zeros(dtensor.shape)
    for offset, piece in pieces:
        whole[tuple(slice(o, o + n) for o, n in zip(offset, piece.shape))] = piece
    return whole


def sum_sharded_grad(weight, group):
    """Sum ``weight``'s gradient over ``group`` in place, shard by shard where the shards of the
    group's ranks cover the same rows, else whole (module docstring)."""
    from megatron.core.distributed.fsdp.src.megatron_fsdp import uneven_dtensor
    from torch.distributed.tensor import DTensor

    dist = torch.distributed
    grad = weight.main_grad if hasattr(weight, "main_grad") else weight.grad
    if grad is None:
        return
    if not isinstance(grad, DTensor):
        dist.all_reduce(grad, group=group)
        return
    local = grad._local_tensor
    chunk = uneven_dtensor.gather_and_compute_chunk_metadata(grad)
    mine = (tuple(chunk.offsets), tuple(chunk.sizes))
    partners = [None] * dist.get_world_size(group)
    dist.all_gather_object(partners, mine, group=group)
    aligned = torch.tensor([int(all(p == mine for p in partners))], device=local.device)
    for mesh_dim in range(grad.device_mesh.ndim):
        dist.all_reduce(aligned, op=dist.ReduceOp.MIN, group=grad.device_mesh.get_group(mesh_dim))
    if aligned.item():
        dist.all_reduce(local, group=group)
        return
    whole = whole_of(grad, mine[0])
    dist.all_reduce(whole, group=group)
    local.copy_(whole[tuple(slice(o, o + n) for o, n in zip(*mine))])


def _uses_megatron_fsdp(model):
    return bool(getattr(getattr(model[0], "ddp_config", None), "use_megatron_fsdp", False))


def make_allreduce_embedding_grad(original):
    """``finalize_model_grads._allreduce_embedding_grad`` summing Megatron-FSDP's sharded
    gradients (module docstring); the original itself otherwise."""

    @functools.wraps(original)
    def _allreduce_embedding_grad(
        model, embd_group, pp_group, weight_getter, skip_if_none=True, config=None
    ):
        if not _uses_megatron_fsdp(model):
            return original(model, embd_group, pp_group, weight_getter, skip_if_none, config)
        found = []

        def recording(module):
            found.append(weight_getter(module))
            return None

        # Megatron's selection of stage, module and weight, and its membership test, alone
        original(model, embd_group, pp_group, recording, True, config)
        if not found:
            return None
        if found[0] is None:
            if skip_if_none:
                return None
            return original(model, embd_group, pp_group, weight_getter, skip_if_none, config)
        sum_sharded_grad(found[0], embd_group)
        return None

    return _allreduce_embedding_grad


def replacements():
    """``[(owner, attr, replacement)]``, each checked against what Megatron calls."""
    from megatron.core.distributed.fsdp import mcore_fsdp_adapter as adapter

    # the module (``megatron.core.distributed`` exports its function of the same name)
    finalize = importlib.import_module("megatron.core.distributed.finalize_model_grads")
    from megatron.core.pipeline_parallel import schedules

    wrapper = require_symbol(adapter, "FullyShardedDataParallel")
    require_symbol(
        adapter,
        "_get_dp_tp_mesh",
        parameters=("dp_cp_group", "tp_group", "ep_size"),
        called_by=(wrapper._init_dist_index,),
    )
    require_call(adapter._get_dp_tp_mesh, "torch.arange(world_size)")
    require_call(schedules.deallocate_output_tensor, "out._base is None")
    forward = require_symbol(wrapper, "forward")
    allreduce = require_symbol(
        finalize,
        "_allreduce_embedding_grad",
        parameters=("model", "embd_group", "pp_group", "weight_getter", "skip_if_none", "config"),
        called_by=(finalize._allreduce_word_embedding_grads,),
    )
    require_call(allreduce, "weight = weight_getter(model_module)")
    require_call(allreduce, "orig_grad = orig_grad._local_tensor")
    return [
        (finalize, "_allreduce_embedding_grad", make_allreduce_embedding_grad(allreduce)),
        (adapter, "_get_dp_tp_mesh", dp_tp_mesh_of_groups),
        (wrapper, "forward", make_forward(forward)),
    ]


def needed(args):
    """``--use-megatron-fsdp`` with pipeline stages."""
    return bool(getattr(args, "use_megatron_fsdp", False)) and (
        (getattr(args, "pipeline_model_parallel_size", 1) or 1) > 1
    )


def make_patch(args):
    """The ``megatron-fsdp-pipeline`` patch for ``args``, else None."""
    if not needed(args):
        return None
    return Patch(PATCH_NAME, replacements=replacements())
