"""Platform layer: what it takes to run Megatron-Core on the host at hand (CPU/gloo or CUDA/NCCL)."""

from .cpu import install as install_cpu_shims
from .cpu import is_active as cpu_shims_active
from .cpu import uninstall as uninstall_cpu_shims


def default_backend():
    """``nccl`` with CUDA, else ``gloo``."""
    import torch

    return "nccl" if torch.cuda.is_available() else "gloo"


__all__ = ["install_cpu_shims", "uninstall_cpu_shims", "cpu_shims_active", "default_backend"]
