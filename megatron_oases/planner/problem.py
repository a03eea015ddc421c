"""The planning instance: a chain of TMP blocks with their costs at every candidate degree.

A :class:`ChainProblem` holds, for one pipeline stage, every block's compute and communication
seconds per sub-batch and candidate degree, the re-shard all-gathers between adjacent layers, the
per-layer memory terms and the constraints (allowed degrees, switches, device memory). It is built
from a profile by :mod:`.build`, timed by :mod:`.time_model` and solved by the ILP and the DP (the
tests add brute force); it is kept apart from the builder so that the solvers and the tests' random
instances depend on this data type and the time model only, never on a profile.

Solvers see memory in integer *granules* (rounded up, so never optimistic); the DP and the ILP share
those integers and therefore the same feasible set.
"""

import itertools
import math
from dataclasses import dataclass, field
from typing import Optional

import numpy as np

from ..errors import OasesConfigError

DEFAULT_MARGIN = 0.10
DEFAULT_GRANULE = 1 << 20  # 1 MiB
#: The most memory granules a solver counts (a peak's sum stays within a signed 64-bit integer).
MAX_GRANULES = float(1 << 62)


@dataclass
class Block:
    """One block in a pass chain: ``comp[sub][k]`` and ``comm[sub][k]`` seconds at degree index k.
    ``tail[k]``: what stays exposed after it where it ends a segment (None: the last sub-batch's
    whole ``comm[1][k]``; the forward's last block runs in pieces, see ``TAIL_PIECES``)."""

    layer: int
    name: str
    comp: np.ndarray
    comm: np.ndarray
    tail: Optional[np.ndarray] = None

    def exposed_tail(self):
        return self.comm[1] if self.tail is None else self.tail


@dataclass
class ChainProblem:
    """A planning instance: costs of every block for every candidate degree, memory, constraints."""

    degrees: list  # candidate degrees (K of them)
    num_layers: int
    subs: int  # sub-batches per micro-batch: 2 (overlapped schedules) or 1 (off)
    forward: list  # segments: lists of Block in processing order
    backward: list
    gather_fwd: np.ndarray  # (L-1, K, K) all-gather seconds at boundary l→l+1 if used in forward
    gather_bwd: np.ndarray  # (L-1, K, K) … in backward
    boundary: np.ndarray  # (L, K) extra unary seconds (embedding/output re-shards)
    repeats: int  # micro-batches per iteration
    mem_add: np.ndarray  # (L, K) bytes per layer, additive
    mem_runtime: np.ndarray  # (L, K) bytes, max over layers
    mem_fixed: float  # bytes
    memory_bytes: float = math.inf  # device memory
    margin: float = DEFAULT_MARGIN
    granule: float = DEFAULT_GRANULE
    allowed: np.ndarray = None  # (L, K) bool
    max_switches: int = None
    fixed_forward_s: float = 0.0  # per micro-batch, degree-independent (output layer, embedding AR)
    fixed_backward_s: float = 0.0
    grad_sync: np.ndarray = None  # (L, K) seconds per iteration: DP gradient all-reduce per layer
    include_grad_sync: bool = False
    # (L, K) seconds per iteration: the per-layer TMP runtime sums a degree-d layer's gradients
    # over its T/d replicas inside the TMP domain (layer_degrees.model.sync_replica_grads);
    # always paid, and part of grad_sync when that is included.
    replica_sync: np.ndarray = None
    # (L, K) seconds per micro-batch: the exposed all-gathers and reduce-scatters of sharded data
    # parallelism (FSDP; :mod:`.sharding`), zero without
    sharding: np.ndarray = None
    # what the builder derived (micro-batches, pipeline stage, memory parts, excluded degrees …)
    meta: dict = field(default_factory=dict)
    # the run it was built for (a :class:`~.settings.PlanSettings`; None for hand-made instances)
    settings: object = None

    def __post_init__(self):
        if self.allowed is None:
            self.allowed = np.ones((self.num_layers, len(self.degrees)), dtype=bool)
        if self.grad_sync is None:
            self.grad_sync = np.zeros((self.num_layers, len(self.degrees)))
        if self.replica_sync is None:
            self.replica_sync = np.zeros((self.num_layers, len(self.degrees)))
        if self.sharding is None:
            self.sharding = np.zeros((self.num_layers, len(self.degrees)))

    @property
    def per_iteration(self):
        """(L, K) seconds paid once per iteration (not per micro-batch)."""
        return self.grad_sync if self.include_grad_sync else self.replica_sync

    # ------------------------------------------------------------ memory (granules)
    @property
    def budget_bytes(self):
        return self.memory_bytes / (1.0 + self.margin)

    def quantized(self):
        """(A_q, R_q, fixed_q, budget_q): integer granules, usage rounded up, budget down. A run
        whose memory does not fit the solvers' 64-bit counts (a model of absurd sizes) is one
        line: it fits no device, and a wrapped count would say it does."""
        g = self.granule
        most = self.mem_fixed + self.mem_add.max(axis=1).sum() + self.mem_runtime.max()
        if not most / g < MAX_GRANULES:  # NaN included
            raise OasesConfigError(
                f"this run needs up to {most / 1e9:.3g} GB per rank, beyond what the planner "
                "counts; check the model's sizes"
            )
        A = np.ceil(self.mem_add / g - 1e-9).astype(np.int64)
        R = np.ceil(self.mem_runtime / g - 1e-9).astype(np.int64)
        fixed = int(math.ceil(self.mem_fixed / g - 1e-9))
        if math.isinf(self.memory_bytes):
            budget = None
        else:
            budget = int(math.floor(self.budget_bytes / g + 1e-9))
        return A, R, fixed, budget

    def index(self, degrees):
        try:
            return [self.degrees.index(int(d)) for d in degrees]
        except ValueError:
            raise OasesConfigError(
                f"plan uses a degree outside the candidates {self.degrees}: {list(degrees)}"
            ) from None

    def peak_memory_bytes(self, ks):
        ks = list(ks)
        rows = range(self.num_layers)
        return (
            self.mem_fixed
            + float(sum(self.mem_add[l, k] for l, k in zip(rows, ks)))
            + float(max(self.mem_runtime[l, k] for l, k in zip(rows, ks)))
        )

    def peak_memory_granules(self, ks):
        A, R, fixed, _ = self.quantized()
        rows = range(self.num_layers)
        return (
            fixed
            + int(sum(A[l, k] for l, k in zip(rows, ks)))
            + int(max(R[l, k] for l, k in zip(rows, ks)))
        )

    def switches(self, ks):
        return sum(1 for a, b in zip(ks, ks[1:]) if a != b)

    def feasible(self, ks):
        """Every constraint the solvers enforce: allowed degrees, switches, quantized memory."""
        if any(not self.allowed[l, k] for l, k in enumerate(ks)):
            return False
        if self.max_switches is not None and self.switches(ks) > self.max_switches:
            return False
        budget = self.quantized()[3]
        return budget is None or self.peak_memory_granules(ks) <= budget


def enumerate_assignments(problem):
    K = len(problem.degrees)
    choices = [[k for k in range(K) if problem.allowed[l, k]] for l in range(problem.num_layers)]
    return itertools.product(*choices)
