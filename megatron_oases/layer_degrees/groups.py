"""Process groups of a per-layer TMP plan, created once at start-up on every rank.

Inside a TMP domain of T consecutive ranks (Megatron's default rank order puts TP innermost), local
index ``i`` = rank − first rank of the domain:

- degree group of size d:   ranks with the same ``i // d`` (the layer's tensor-parallel group);
- pair group (small, big):  ranks in the same ``big``-group with the same ``i % small``
  (big/small ranks). Resharding between degrees all-gathers over it, and for (d, T) it is also the
  *replica group* of a degree-d layer: the ranks holding the same shard of its parameters.
"""

import torch.distributed as dist
from megatron.core import parallel_state

from ..errors import OasesConfigError
from ..formats.plan import degree_fault


class LayerDegreeGroups:
    """This rank's process groups for a plan's degrees in its TMP domain of ``T`` ranks
    (``domain_size``), every rank creating every group in the same order (see module doc)."""

    def __init__(self, T, degrees):
        self.domain_size = T  # the TMP domain: --tensor-model-parallel-size
        if any(degree_fault(d, T) for d in degrees):
            raise OasesConfigError(f"TMP degrees must be powers of two dividing {T}: {degrees}")
        self.rank = dist.get_rank()
        world = dist.get_world_size()
        if world % T:
            raise OasesConfigError(f"world size {world} is not divisible by the TMP domain {T}")
        tp_ranks = dist.get_process_group_ranks(parallel_state.get_tensor_model_parallel_group())
        if tp_ranks != list(range(tp_ranks[0], tp_ranks[0] + T)):
            raise OasesConfigError(
                "per-layer TMP needs consecutive TP ranks (Megatron's default "
                "order tp-cp-ep-dp-pp)"
            )
        self.first = tp_ranks[0]
        self.local = self.rank - self.first
        self.degree_groups, self.pair_groups = {}, {}
        needed_pairs = set()
        degrees = sorted(set(degrees) | {T})
        for small in degrees:
            for big in degrees:
                if small < big:
                    needed_pairs.add((small, big))
        domains = [list(range(s, s + T)) for s in range(0, world, T)]
        for d in degrees:  # every rank creates every group, in the same order
            for domain in domains:
                for g in range(T // d):
                    ranks = domain[g * d : (g + 1) * d]
                    group = self._new_group(ranks, d)
                    if self.rank in ranks:
                        self.degree_groups[d] = group
        for small, big in sorted(needed_pairs):
            for domain in domains:
                for g in range(T // big):
                    for off in range(small):
                        ranks = [domain[g * big + k * small + off] for k in range(big // small)]
                        group = self._new_group(ranks, big // small)
                        if self.rank in ranks:
                            self.pair_groups[(small, big)] = group

    @staticmethod
    def _new_group(ranks, size):
        if size == dist.get_world_size() and ranks == list(range(size)):
            return dist.group.WORLD
        return dist.new_group(ranks)

    def tp_group(self, d):
        return self.degree_groups[d]

    def tp_rank(self, d):
        return self.local % d

    def group_index(self, d):
        """Which of the T/d groups (and batch shares) this rank belongs to."""
        return self.local // d

    def pair_group(self, a, b):
        return self.pair_groups[(min(a, b), max(a, b))]

    def replica_group(self, d):
        return None if d == self.domain_size else self.pair_groups[(d, self.domain_size)]
