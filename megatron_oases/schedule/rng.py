"""RNG snapshots for recomputation: an op that may run again (recompute, or a backward that re-runs
its forward) snapshots Megatron's RNG states (CPU, device and the model-parallel tracker) before it
runs, and the re-run restores exactly that snapshot, so its dropout masks equal the forward's."""

import contextlib

from megatron.core.tensor_parallel.random import _get_all_rng_states, _set_all_rng_states


def snapshot():
    cpu, dev, tracker = _get_all_rng_states()
    return cpu, dev, dict(tracker)


@contextlib.contextmanager
def replay(state):
    """Run with a saved RNG snapshot, then return to the current RNG state."""
    current = snapshot()
    cpu, dev, tracker = state
    _set_all_rng_states(cpu, dev, dict(tracker))
    try:
        yield
    finally:
        cpu, dev, tracker = current
        _set_all_rng_states(cpu, dev, dict(tracker))
