"""Distributed start-up the way Megatron-LM does it: process group, model-parallel groups, seeds."""

import os
from datetime import timedelta

import torch
import torch.distributed as dist
from megatron.core import parallel_state, tensor_parallel

from .. import platform


def initialize_distributed(args):
    """Init the default process group from torchrun's env (or a 1-rank group) and Megatron's groups."""
    platform.install_cpu_shims()
    if not dist.is_initialized():
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", "29500")
        os.environ.setdefault("RANK", "0")
        os.environ.setdefault("WORLD_SIZE", "1")
        if torch.cuda.is_available():
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group(
            backend=args.distributed_backend,
            timeout=timedelta(minutes=args.distributed_timeout_minutes),
        )
    parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=args.tensor_model_parallel_size,
        pipeline_model_parallel_size=args.pipeline_model_parallel_size,
        distributed_timeout_minutes=int(max(1, args.distributed_timeout_minutes)),
    )
    set_random_seed(args.seed)


def set_random_seed(seed):
    """Same seed on every rank; the TP-rank offset lives in Megatron's RNG tracker."""
    import random

    import numpy as np

    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    tensor_parallel.model_parallel_cuda_manual_seed(seed)


def destroy():
    parallel_state.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()
