"""Layout-independent checkpoints: full (unsharded) tensors keyed by global parameter name.

``<dir>/iter_XXXXXXX/stage_PPP.pt`` holds, for every parameter of pipeline stage PPP, the full
parameter and its full Adam moments (gathered over the parameter's own TP group — the layer's
degree under a per-layer plan), written by the stage's first TP/DP rank. Loading takes each rank's
shard again, so a checkpoint saved under one TP/PP layout or per-layer plan loads under any other
(e.g. a hetero plan ⇄ stock uniform TP=T) with bit-identical parameters. Per-rank RNG states are
kept in ``rng/rank_R.pt`` and restored when the layout is unchanged (exact resume).
``latest_checkpointed_iteration.txt`` names the newest iteration, as in Megatron-LM.
"""

import glob
import os
import random

import numpy as np
import torch
import torch.distributed as dist
from megatron.core import parallel_state, tensor_parallel

from ..errors import OasesConfigError
from .model import full_tensor, global_param_names, shard_spec, take_shard

TRACKER = "latest_checkpointed_iteration.txt"
MOMENTS = ("exp_avg", "exp_avg_sq")


def _layout(args):
    return {
        "world_size": dist.get_world_size(),
        "tp": args.tensor_model_parallel_size,
        "pp": args.pipeline_model_parallel_size,
        "plan": getattr(args, "oases_plan", None),
    }


def _torch_optimizer(optimizer):
    return getattr(optimizer, "optimizer", optimizer)


def save_checkpoint(root, iteration, model, optimizer, args):
    module = getattr(model, "module", model)
    state = _torch_optimizer(optimizer).state
    entries = {}
    for name, p in global_param_names(module):
        st = state.get(p, {})
        entry = {"param": full_tensor(p.detach(), p, name)}
        for key in MOMENTS:
            if key in st:
                entry[key] = full_tensor(st[key], p, name)
        if "step" in st:
            entry["step"] = st["step"].clone() if torch.is_tensor(st["step"]) else st["step"]
        entries[name] = entry
    it_dir = os.path.join(root, f"iter_{iteration:07d}")
    writer = (
        parallel_state.get_tensor_model_parallel_rank() == 0
        and parallel_state.get_data_parallel_rank() == 0
    )
    os.makedirs(os.path.join(it_dir, "rng"), exist_ok=True)
    if writer:
        stage = parallel_state.get_pipeline_model_parallel_rank()
        torch.save(
            {"iteration": iteration, "params": entries},
            os.path.join(it_dir, f"stage_{stage:03d}.pt"),
        )
    torch.save(
        {"layout": _layout(args), "rng": _rng_state()},
        os.path.join(it_dir, "rng", f"rank_{dist.get_rank()}.pt"),
    )
    dist.barrier()
    if dist.get_rank() == 0:
        with open(os.path.join(root, TRACKER), "w") as f:
            f.write(str(iteration))
    dist.barrier()


def read_checkpoint(root):
    """(iteration, {global name: entry}) of the newest checkpoint under ``root``."""
    tracker = os.path.join(root, TRACKER)
    if not os.path.exists(tracker):
        raise OasesConfigError(f"no checkpoint under {root} ({TRACKER} missing); check --load")
    with open(tracker) as f:
        iteration = int(f.read().strip())
    files = sorted(glob.glob(os.path.join(root, f"iter_{iteration:07d}", "stage_*.pt")))
    if not files:
        raise OasesConfigError(f"checkpoint iteration {iteration} under {root} has no stage files")
    params = {}
    for path in files:
        params.update(torch.load(path, map_location="cpu", weights_only=False)["params"])
    return iteration, params


def load_checkpoint(root, model, optimizer, args):
    """Load the newest checkpoint into this rank's shards; returns its iteration."""
    iteration, entries = read_checkpoint(root)
    module = getattr(model, "module", model)
    opt = _torch_optimizer(optimizer)
    tp_size = parallel_state.get_tensor_model_parallel_world_size()
    tp_rank = parallel_state.get_tensor_model_parallel_rank()
    with torch.no_grad():
        for name, p in global_param_names(module):
            if name not in entries:
                raise OasesConfigError(
                    f"checkpoint under {root} has no parameter {name}; it was "
                    "saved from a different model shape"
                )
            entry = entries[name]
            size, rank = getattr(p, "_oases_tp", (tp_size, tp_rank))
            dim, full_shape, gated = shard_spec(p, name, size)
            if tuple(entry["param"].shape) != tuple(full_shape):
                raise OasesConfigError(
                    f"{name}: checkpoint shape {tuple(entry['param'].shape)} "
                    f"≠ model shape {tuple(full_shape)}"
                )
            p.copy_(take_shard(entry["param"], dim, rank, size, gated))
            if "step" in entry:
                st = {k: take_shard(entry[k], dim, rank, size, gated).clone() for k in MOMENTS}
                st["step"] = (
                    entry["step"].clone() if torch.is_tensor(entry["step"]) else entry["step"]
                )
                opt.state[p] = st
    rng_path = os.path.join(root, f"iter_{iteration:07d}", "rng", f"rank_{dist.get_rank()}.pt")
    if os.path.exists(rng_path):
        saved = torch.load(rng_path, map_location="cpu", weights_only=False)
        if saved["layout"] == _layout(args):
            _set_rng_state(saved["rng"])
    return iteration


def _rng_state():
    return {
        "random": random.getstate(),
        "np": np.random.get_state(),
        "torch": torch.get_rng_state(),
        "tracker": {
            k: v.clone() for k, v in tensor_parallel.get_cuda_rng_tracker().get_states().items()
        },
    }


def _set_rng_state(rng):
    random.setstate(rng["random"])
    np.random.set_state(rng["np"])
    torch.set_rng_state(rng["torch"])
    tensor_parallel.get_cuda_rng_tracker().set_states(rng["tracker"])
