"""In-process runs of Megatron-LM's own ``pretrain()`` that report losses and gradients per variant:
what the test suite's multi-rank tests and the GPU check (``benchmarks/gpu/``) both run.

:func:`variants_worker` is meant to be the ``fn`` of :func:`megatron_oases.launch.run_distributed`
(the default gloo group is already up; Megatron's ``initialize_megatron`` keeps it). Several
variants run one after another in the same processes (:func:`.pretrain.run_in_process` tears
Megatron's global state and the patches down after each), so each variant is a fresh Megatron job
apart from the process start-up.

Per iteration the loss is what Megatron's ``train_step`` returns (reduced over micro-batches and
data-parallel ranks, last pipeline stage); gradients are read from DDP's ``main_grad`` buffers at
the first ``optimizer.step()``, i.e. after ``finalize_model_grads`` and before clipping.
"""

import os

from ..patching import Patch
from .pretrain import run_in_process

#: A directory for Megatron's mock-data indices shared by a session's runs (the test suite's
#: ``tests/conftest.py`` and the GPU check's driver set it); unset, each run builds its own.
DATA_CACHE_ENV = "OASES_TEST_DATA_CACHE"


def with_data_cache(argv):
    """``argv`` (a string or a list) with Megatron's own ``--data-cache-path`` where it uses
    ``--mock-data``: the mock dataset's shuffled indices (about two million samples per split at
    the tests' sequence lengths, 1.5 s per run) are built once per session and loaded by every
    later run of the same shape. :data:`DATA_CACHE_ENV` names the directory."""
    cache = os.environ.get(DATA_CACHE_ENV)
    flags = argv.split() if isinstance(argv, str) else list(argv)
    if not cache or "--mock-data" not in flags or "--data-cache-path" in flags:
        return argv
    extra = ["--data-cache-path", cache]
    return f"{argv} {' '.join(extra)}" if isinstance(argv, str) else flags + extra


def cache_megatron_field_docstrings():
    """Megatron's argument parser re-reads and re-parses the source of each of its config
    dataclasses on every parse, for the help texts (``ArgumentGroupFactory._get_field_docstrings``:
    ~0.45 s a parse, two parses a run). A process that runs many jobs keeps them per class (the
    sources do not change while it runs). Idempotent; nothing else changes."""
    from megatron.training.argument_utils import ArgumentGroupFactory

    original = ArgumentGroupFactory._get_field_docstrings
    if getattr(original, "oases_cached", False):
        return
    cache = {}

    def get_field_docstrings(self, src_cfg_class):
        if src_cfg_class not in cache:
            cache[src_cfg_class] = original(self, src_cfg_class)
        return dict(cache[src_cfg_class])

    get_field_docstrings.oases_cached = True
    ArgumentGroupFactory._get_field_docstrings = get_field_docstrings


def prepared(argv):
    """``argv`` as every in-process run takes it: Megatron's parser with its dataclass docstrings
    cached (:func:`cache_megatron_field_docstrings`) and the session's mock-data cache
    (:func:`with_data_cache`). Together ~1.3 s of a ~2.6 s run on each rank (two parses a run,
    three splits' shuffled indices)."""
    cache_megatron_field_docstrings()
    return with_data_cache(argv)


def capture_patch(record, grads):
    """Wrap ``train_step`` (by name in ``megatron.training.training``) to append each iteration's
    loss to ``record['losses']`` and (``grads``) store the first step's gradients in
    ``record['grads']`` (``"full"``: all-gathered to full tensors)."""
    import torch
    from megatron.training import training
    from torch.distributed.tensor import DTensor

    from ..layer_degrees.shards import full_tensor, global_param_names

    original = training.train_step

    def capture_grads(model):
        out = {}
        for chunk in model:
            if is_megatron_fsdp(chunk):
                out.update(megatron_fsdp_grads(chunk, grads))
                continue
            module = chunk.module if hasattr(chunk, "module") else chunk
            for name, p in global_param_names(module):
                g = getattr(p, "main_grad", None)
                g = (g if g is not None else p.grad).detach()
                if isinstance(g, DTensor):  # --use-torch-fsdp2: this rank's shard of the average
                    g = g.full_tensor()
                g = g.clone()
                out[name] = full_tensor(g, p, name, module.config) if grads == "full" else g
        return out

    def train_step(forward_step_func, data_iterator, model, optimizer, *rest, **kwargs):
        if grads and "grads" not in record:
            step = optimizer.step

            def step_capturing():
                record["grads"] = capture_grads(model)
                return step()

            optimizer.step = step_capturing
            try:
                out = original(forward_step_func, data_iterator, model, optimizer, *rest, **kwargs)
            finally:
                optimizer.step = step
        else:
            out = original(forward_step_func, data_iterator, model, optimizer, *rest, **kwargs)
        loss = out[0].get("lm loss") if out[0] else None
        record["losses"].append(
            None if loss is None else float(torch.as_tensor(loss).reshape(-1)[0])
        )
        return out

    return Patch("inprocess-capture", [(training, "train_step", train_step)])


def is_megatron_fsdp(chunk):
    """Whether ``chunk`` is Megatron-FSDP's wrapper (``--use-megatron-fsdp``)."""
    try:
        from megatron.core.distributed.fsdp.mcore_fsdp_adapter import FullyShardedDataParallel
    except ImportError:
        return False
    return isinstance(chunk, FullyShardedDataParallel)


def uneven_to_full(dtensor):
    """The whole tensor of Megatron-FSDP's unevenly sharded ``dtensor``, on every rank of its
    mesh: each rank's chunk placed at its offset in zeros, then summed over each sharded mesh
    dimension (disjoint chunks: exact). Megatron-FSDP's own ``uneven_dtensor_to_full_tensor``
    all-gathers chunks of different sizes, which gloo refuses."""
    import torch
    import torch.distributed as dist
    from megatron.core.distributed.fsdp.src.megatron_fsdp.uneven_dtensor import (
        update_uneven_dtensor_chunk_metadata,
    )
    from torch.distributed.tensor import Shard

    if not hasattr(dtensor._local_tensor, "__create_chunk_list__"):
        update_uneven_dtensor_chunk_metadata(dtensor)
    (chunk,) = dtensor.__create_chunk_list__()
    local = dtensor.to_local()
    full = torch.zeros(dtensor.shape, dtype=dtensor.dtype, device=local.device)
    full[tuple(slice(o, o + n) for o, n in zip(chunk.offsets, local.shape))] = local
    for mesh_dim, placement in enumerate(dtensor.placements):
        if isinstance(placement, Shard):
            dist.all_reduce(full, group=dtensor.device_mesh.get_group(mesh_dim))
    return full


def megatron_fsdp_grads(chunk, grads):
    """``{global name: gradient}`` of a Megatron-FSDP chunk after ``finish_grad_sync``: each
    parameter's reduced gradient (its ``dist_main_grad``, an unevenly sharded DTensor over the
    data-parallel and tensor-parallel ranks, present on every rank even where its local shard is
    empty) gathered whole (:func:`uneven_to_full`), then this rank's tensor-parallel
    shard of it, as DDP's ``main_grad`` holds (``grads="full"``: gathered as DDP's are)."""
    from megatron.core import parallel_state

    from ..layer_degrees.shards import full_tensor, global_param_names

    fsdp = chunk.module
    model, buffer = fsdp.module, fsdp.param_and_grad_buffer
    originals = {name: p.orig_param for name, p in buffer.optimizer_named_parameters}
    tp = parallel_state.get_tensor_model_parallel_world_size()
    tp_rank = parallel_state.get_tensor_model_parallel_rank()
    out = {}
    for (local, _), (name, _) in zip(model.named_parameters(), global_param_names(model)):
        param = originals[local]
        g = uneven_to_full(buffer.dist_main_grad[local])
        if getattr(param, "tensor_model_parallel", False) and tp > 1:
            g = g.chunk(tp, dim=param.partition_dim)[tp_rank]
        g = g.clone()
        out[name] = full_tensor(g, param, name, model.config) if grads == "full" else g
    return out


def pretrain_and_capture(argv, grads=False, demo=True):
    """Run Megatron's ``pretrain()`` on ``argv``; return {'losses', 'grads', 'installed',
    'exit_code', 'compiled_graphs'}. ``grads=True`` captures this rank's shards; ``grads="full"``
    all-gathers every gradient to its full tensor (to compare different TP layouts or per-layer
    plans). ``compiled_graphs``: graphs ``torch.compile`` built in this process so far (0 where
    the suite runs Megatron's fused functions eagerly, see ``tests/conftest.py``)."""
    from torch._dynamo.utils import counters

    record = {"losses": []}
    patches = [capture_patch(record, grads)]
    record.update(run_in_process(prepared(argv), demo=demo, extra_patches=patches))
    record.setdefault("grads", {})
    record["compiled_graphs"] = counters["stats"]["unique_graphs"]
    return record


def variants_worker(base, variants, grads=True):
    """Run each (name, extra flags) variant of ``base`` in turn in this process group."""
    return {name: pretrain_and_capture(f"{base} {extra}", grads=grads) for name, extra in variants}


def max_rel_diff(a, b):
    """Largest absolute difference of ``a`` from ``b``, relative to ``b``'s largest magnitude."""
    import torch

    a, b = torch.as_tensor(a, dtype=torch.float64), torch.as_tensor(b, dtype=torch.float64)
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-12)).item()
