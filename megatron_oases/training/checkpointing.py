"""Per-rank checkpoints in Megatron-LM's legacy layout.

``<dir>/iter_XXXXXXX/mp_rank_TT[_PPP]/model_optim_rng.pt`` plus ``latest_checkpointed_iteration.txt``;
each file holds the model and optimizer state dicts of one (TP, PP) rank, the iteration and RNG
states, so ``--load`` resumes with the identical next-iteration loss.
"""

import os
import random

import numpy as np
import torch
import torch.distributed as dist
from megatron.core import parallel_state, tensor_parallel

TRACKER = "latest_checkpointed_iteration.txt"


def _rank_dir(root, iteration):
    tp = parallel_state.get_tensor_model_parallel_rank()
    name = f"mp_rank_{tp:02d}"
    if parallel_state.get_pipeline_model_parallel_world_size() > 1:
        name += f"_{parallel_state.get_pipeline_model_parallel_rank():03d}"
    return os.path.join(root, f"iter_{iteration:07d}", name)


def _rng_state():
    return {
        "random": random.getstate(),
        "np": np.random.get_state(),
        "torch": torch.get_rng_state(),
        "tracker": {k: v.clone() for k, v in tensor_parallel.get_cuda_rng_tracker().get_states().items()},
    }


def save_checkpoint(root, iteration, model, optimizer, args):
    path = _rank_dir(root, iteration)
    if parallel_state.get_data_parallel_rank() == 0:
        os.makedirs(path, exist_ok=True)
        torch.save(
            {
                "iteration": iteration,
                "model": model.state_dict(),
                "optimizer": optimizer.state_dict(),
                "rng_state": _rng_state(),
                "args": {k: v for k, v in vars(args).items() if isinstance(v, (int, float, str, bool))},
            },
            os.path.join(path, "model_optim_rng.pt"),
        )
    dist.barrier()
    if dist.get_rank() == 0:
        with open(os.path.join(root, TRACKER), "w") as f:
            f.write(str(iteration))
    dist.barrier()


def load_checkpoint(root, model, optimizer):
    """Load the latest checkpoint under ``root``; returns its iteration (0 if none)."""
    tracker = os.path.join(root, TRACKER)
    if not os.path.exists(tracker):
        return 0
    with open(tracker) as f:
        iteration = int(f.read().strip())
    path = os.path.join(_rank_dir(root, iteration), "model_optim_rng.pt")
    if not os.path.exists(path):
        from ..errors import OasesConfigError

        raise OasesConfigError(
            f"{path} is missing: --load must use the TP/PP layout the checkpoint was saved with"
        )
    state = torch.load(path, map_location="cpu", weights_only=False)
    model.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    rng = state["rng_state"]
    random.setstate(rng["random"])
    np.random.set_state(rng["np"])
    torch.set_rng_state(rng["torch"])
    tensor_parallel.get_cuda_rng_tracker().set_states(rng["tracker"])
    return iteration
