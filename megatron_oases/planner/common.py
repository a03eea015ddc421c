"""Solver result type shared by the ILP, the DP and brute force."""

from dataclasses import dataclass, field


@dataclass
class Solution:
    """``ks``: degree index per layer (None when infeasible); ``objective``: seconds per iteration,
    recomputed exactly from ``ks``; ``status``: 'optimal', 'feasible' (time limit hit with an
    incumbent), 'infeasible'."""

    solver: str
    status: str
    ks: list = None
    objective: float = None
    solve_time_s: float = 0.0
    info: dict = field(default_factory=dict)

    @property
    def feasible(self):
        return self.ks is not None
