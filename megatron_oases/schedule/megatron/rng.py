"""RNG snapshots for recomputation: an op that may run again (recompute, or a backward that re-runs
its forward) snapshots Megatron's RNG states (CPU, device and the model-parallel tracker) before it
runs, and the re-run restores exactly that snapshot, so its dropout masks equal the forward's."""

from megatron.core.tensor_parallel.random import _get_all_rng_states, _set_all_rng_states

from ..engine.ops import RngStates


def snapshot():
    cpu, dev, tracker = _get_all_rng_states()
    return cpu, dev, dict(tracker)


class replay:  # noqa: N801 (a context manager, like contextlib's)
    """Run with a saved RNG snapshot, then return to the current RNG state. A class, not a
    generator context: one is entered around every recomputed op."""

    __slots__ = ("state", "current")

    def __init__(self, state):
        self.state, self.current = state, None

    def __enter__(self):
        self.current = snapshot()
        cpu, dev, tracker = self.state
        _set_all_rng_states(cpu, dev, dict(tracker))
        return self

    def __exit__(self, *exc):
        (cpu, dev, tracker), self.current = self.current, None
        _set_all_rng_states(cpu, dev, dict(tracker))
        return False


#: Megatron's RNG states, as the engine takes them (:class:`..engine.ops.RngStates`)
STATES = RngStates(snapshot, replay)
