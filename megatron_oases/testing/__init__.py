"""Test helpers shared by our tests and by users validating their own set-ups."""

from .distributed import find_free_port, run_distributed, run_torchrun

__all__ = ["find_free_port", "run_distributed", "run_torchrun"]
