"""Unit tests of LayerDegreeGroups: which ranks form which groups for a per-layer TMP plan.

In-process: ``groups.dist`` and ``groups.parallel_state`` are replaced by a recorder, so every rank
of a world of 8 can be constructed in turn and its groups read back as rank lists. Real gloo groups
built by the same rule are exercised in tests/e2e/test_reshard.py.
"""

from types import SimpleNamespace

import pytest

from megatron_oases.errors import OasesConfigError
from megatron_oases.layer_degrees import groups as groups_mod
from megatron_oases.layer_degrees.groups import LayerDegreeGroups


class FakeGroup:
    def __init__(self, ranks):
        self.ranks = list(ranks)


class FakeDist:
    """``torch.distributed`` as seen by one rank: records every ``new_group`` call in order."""

    def __init__(self, rank, world, tp_ranks):
        self.rank, self.world, self.tp_ranks = rank, world, tp_ranks
        self.group = SimpleNamespace(WORLD=FakeGroup(range(world)))
        self.created = []

    def get_rank(self):
        return self.rank

    def get_world_size(self, group=None):
        return self.world if group is None else len(group.ranks)

    def get_process_group_ranks(self, group):
        return list(group.ranks)

    def new_group(self, ranks):
        self.created.append(list(ranks))
        return FakeGroup(ranks)


def build(monkeypatch, rank, world, T, degrees, tp_ranks=None):
    """LayerDegreeGroups on ``rank``; TP group = its T consecutive ranks unless ``tp_ranks`` given."""
    if tp_ranks is None:
        first = rank // T * T
        tp_ranks = list(range(first, first + T))
    fake = FakeDist(rank, world, tp_ranks)
    monkeypatch.setattr(groups_mod, "dist", fake)
    monkeypatch.setattr(
        groups_mod,
        "parallel_state",
        SimpleNamespace(get_tensor_model_parallel_group=lambda: FakeGroup(tp_ranks)),
    )
    return LayerDegreeGroups(T, degrees), fake


def ranks_of(group):
    return None if group is None else group.ranks


# Expected per rank of a world of 8, by (T, degree): tp group, and by (T, small, big): pair group.
TP_GROUPS = {
    (4, 1): [[r] for r in range(8)],
    (4, 2): [[0, 1], [0, 1], [2, 3], [2, 3], [4, 5], [4, 5], [6, 7], [6, 7]],
    (4, 4): [[0, 1, 2, 3]] * 4 + [[4, 5, 6, 7]] * 4,
    (2, 1): [[r] for r in range(8)],
    (2, 2): [[0, 1], [0, 1], [2, 3], [2, 3], [4, 5], [4, 5], [6, 7], [6, 7]],
}
PAIR_GROUPS = {
    (4, 1, 2): [[0, 1], [0, 1], [2, 3], [2, 3], [4, 5], [4, 5], [6, 7], [6, 7]],
    (4, 1, 4): [[0, 1, 2, 3]] * 4 + [[4, 5, 6, 7]] * 4,
    (4, 2, 4): [[0, 2], [1, 3], [0, 2], [1, 3], [4, 6], [5, 7], [4, 6], [5, 7]],
    (2, 1, 2): [[0, 1], [0, 1], [2, 3], [2, 3], [4, 5], [4, 5], [6, 7], [6, 7]],
}


@pytest.mark.parametrize(
    "T,degrees", [(4, [1, 2, 4]), (4, [2, 1]), (4, [1]), (4, [2]), (4, [4]), (2, [1, 2]), (2, [1])]
)
def test_tp_and_pair_groups_for_every_rank(monkeypatch, T, degrees):
    """Degree-d groups are d consecutive ranks; pair (small, big) groups share a big group and
    ``local % small``; only the pairs of the plan's degrees (plus T) are built."""
    wanted = sorted(set(degrees) | {T})
    for rank in range(8):
        g, _ = build(monkeypatch, rank, 8, T, degrees)
        assert (g.first, g.local) == (rank // T * T, rank % T)
        assert sorted(g.degree_groups) == wanted
        for d in wanted:
            assert ranks_of(g.tp_group(d)) == TP_GROUPS[(T, d)][rank], (T, d, rank)
            assert g.tp_rank(d) == TP_GROUPS[(T, d)][rank].index(rank)
            assert g.group_index(d) == (rank % T) // d
        pairs = [(s, b) for s in wanted for b in wanted if s < b]
        assert sorted(g.pair_groups) == pairs
        for s, b in pairs:
            assert ranks_of(g.pair_group(s, b)) == PAIR_GROUPS[(T, s, b)][rank], (s, b, rank)
            assert g.pair_group(b, s) is g.pair_group(s, b)


@pytest.mark.parametrize("T", [2, 4])
def test_replica_groups_hold_the_same_shard(monkeypatch, T):
    """A degree-d layer's replica group: the T/d ranks with the same TP rank of d (same shard)."""
    for rank in range(8):
        g, _ = build(monkeypatch, rank, 8, T, [1, 2])
        assert g.replica_group(T) is None
        for d in [d for d in (1, 2) if d < T]:
            expected = [r for r in range(rank // T * T, rank // T * T + T) if r % d == rank % d]
            replicas = ranks_of(g.replica_group(d))
            assert replicas == expected
            assert len(replicas) == T // d
            assert {r % d for r in replicas} == {g.tp_rank(d)}


def test_every_rank_creates_the_same_groups_in_the_same_order(monkeypatch):
    """``new_group`` is collective: a rank creating a different sequence would hang the job."""
    sequences = [build(monkeypatch, r, 8, 4, [2, 1])[1].created for r in range(8)]
    assert all(s == sequences[0] for s in sequences)
    # degree 1 (8 groups), 2 (4), 4 (2), pairs (1,2) (4), (1,4) (2), (2,4) (4)
    assert len(sequences[0]) == 8 + 4 + 2 + 4 + 2 + 4
    assert sequences[0][:8] == [[r] for r in range(8)]
    assert sequences[0][-4:] == [[0, 2], [1, 3], [4, 6], [5, 7]]


def test_whole_world_group_is_world(monkeypatch):
    """A group spanning the whole world (T = world) reuses WORLD instead of a new group."""
    for rank in range(4):
        g, fake = build(monkeypatch, rank, 4, 4, [1, 2])
        assert g.tp_group(4) is fake.group.WORLD
        assert g.pair_group(1, 4) is fake.group.WORLD
        assert [0, 1, 2, 3] not in fake.created
        assert ranks_of(g.pair_group(2, 4)) == [[0, 2], [1, 3]][rank % 2]


@pytest.mark.parametrize("degrees", [[3], [0], [8], [1, 6], [-2]])
def test_bad_degrees_are_config_errors(monkeypatch, degrees):
    with pytest.raises(OasesConfigError, match="powers of two dividing 4"):
        build(monkeypatch, 0, 8, 4, degrees)


def test_world_not_divisible_by_domain(monkeypatch):
    with pytest.raises(OasesConfigError, match="world size 6 is not divisible by the TMP domain 4"):
        build(monkeypatch, 0, 6, 4, [1])


def test_non_consecutive_tp_ranks(monkeypatch):
    """TP not innermost (e.g. ranks 0, 2 in one TP group) cannot host per-layer degrees."""
    with pytest.raises(OasesConfigError, match="consecutive TP ranks"):
        build(monkeypatch, 0, 4, 2, [1], tp_ranks=[0, 2])
