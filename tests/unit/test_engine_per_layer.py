"""Issue 61.3: the engine's per-layer rhythm for sharded parameters (``schedule/engine/fsdp.py``,
:class:`PerLayer`), over the stand-in block table (no Megatron, no process group).

The stand-in wrapper (:class:`Freeing`) frees a layer's parameters when released (their data an
empty tensor: any op reading them fails) and puts them back when waited on; it hands a layer's
gradients over as Megatron-FSDP's hook does (copied out of ``.grad``, which is dropped), and
fails on a second hand-over in one backward. So each case checks that the engine gathers every
layer before any op reads it and releases it only after the last (forward, recomputation and
backward, every schedule and what forward keeps), that each layer's gradient is complete when
handed over (both sub-batches summed) and handed over once, one layer ahead (no more than three
layers gathered at once of four), and that the result equals plain autograd's.
"""

import pytest
import torch
from helpers.blocks import make_blocks, parameters, reference
from test_engine import CPU_RNG, KEEPS

from megatron_oases.schedule.engine.fsdp import PerLayer, ShardedLayers
from megatron_oases.schedule.engine.node import ScheduledLayers, run_scheduled
from megatron_oases.schedule.engine.split import BatchSplit
from megatron_oases.validation import SPLIT_SCHEDULES

LAYERS = 4


class Freeing(ShardedLayers):
    """A stage's stand-in layers sharded to nothing between uses (module docstring). ``want``:
    each parameter's complete gradient (plain autograd's), checked at its hand-over."""

    def __init__(self, layers, want):
        self.layers, self.want = layers, want
        self.whole = {p: p.data for layer in layers for p in layer.parameters()}
        self.events, self.main_grads, self.handed = [], {}, set()
        for i in range(len(layers)):
            self._free(i)

    def _free(self, i):
        for p in self.layers[i].parameters():
            p.data = torch.empty(0, dtype=p.dtype)

    def gather(self, i, backward):
        self.events.append(("gather", i, backward))

    def wait(self, i, backward):
        assert ("gather", i, backward) in self.events, f"layer {i} waited on before its gather"
        self.events.append(("wait", i, backward))
        for p in self.layers[i].parameters():
            p.data = self.whole[p]

    def release(self, i, backward):
        self.events.append(("release", i, backward))
        self._free(i)

    def hand_over(self, i):
        if i in self.handed:
            raise RuntimeError(f"layer {i}'s gradients handed over twice in one backward")
        self.handed.add(i)
        self.events.append(("hand_over", i, True))
        for p in self.layers[i].parameters():
            torch.testing.assert_close(p.grad, self.want[p], rtol=1e-12, atol=1e-12)
            self.main_grads[p] = p.grad.clone()  # Megatron-FSDP copies it into its bucket
            p.grad = None

    def finish(self, backward):
        self.events.append(("finish", None, backward))


def _run(schedule, keeps, layout="gpt", sp=False):
    blocks = make_blocks(layout, layers=LAYERS, sequence_parallel=sp)
    params = parameters(blocks)
    x = torch.randn(8, 6, 8, dtype=torch.float64)
    g = torch.randn_like(x)
    x_ref = x.clone().requires_grad_()
    out_ref = reference(blocks, x_ref)
    out_ref.backward(g)
    want = {p: p.grad.clone() for p in params}
    for p in params:
        p.grad = None

    freeing = Freeing(blocks.layers, want)
    sharded = PerLayer(freeing)
    run = ScheduledLayers(
        blocks,
        schedule,
        split=lambda hidden: BatchSplit(hidden.shape, 2),
        rng=CPU_RNG,
        recomputed_layers=KEEPS[keeps](LAYERS),
        sharded=sharded,
    )
    x_run = x.clone().requires_grad_()
    out = run_scheduled(run, x_run)
    out.backward(g)
    torch.testing.assert_close(out, out_ref, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(x_run.grad, x_ref.grad, rtol=1e-12, atol=1e-12)
    assert set(freeing.main_grads) == set(params)
    for p in params:
        assert p.grad is None
        torch.testing.assert_close(freeing.main_grads[p], want[p], rtol=1e-12, atol=1e-12)
    return freeing, sharded, len(blocks.layers)


def _per_pass(events, backward):
    return [(kind, i) for kind, i, b in events if b == backward and kind != "finish"]


@pytest.mark.parametrize("keeps", list(KEEPS))
@pytest.mark.parametrize("schedule", SPLIT_SCHEDULES)
def test_each_layer_gathered_one_ahead_released_after_use_handed_over_once(schedule, keeps):
    freeing, sharded, n = _run(schedule, keeps)
    assert sharded.peak <= 3  # the running layer, the next one, at a boundary the one before
    for backward in (False, True):
        events = _per_pass(freeing.events, backward)
        order = list(range(n)) if not backward else list(reversed(range(n)))
        gathers = [i for kind, i in events if kind == "gather"]
        releases = [i for kind, i in events if kind == "release"]
        assert gathers == order and releases == order, events
        for a, b in zip(order, order[1:]):  # b's gather starts when a is waited on, a running
            assert events.index(("gather", b)) == events.index(("wait", a)) + 1, events
            assert events.index(("gather", b)) < events.index(("release", a))
        if backward:
            handed = [i for kind, i in events if kind == "hand_over"]
            assert handed == order
            for i in order:  # the hand-over right before its release
                assert events.index(("hand_over", i)) + 1 == events.index(("release", i))
    assert [e for e in freeing.events if e[0] == "finish"] == [
        ("finish", None, False),
        ("finish", None, True),
    ]


@pytest.mark.parametrize("layout,sp", [("gpt", True), ("hybrid", False)])
@pytest.mark.parametrize("schedule", SPLIT_SCHEDULES)
def test_per_layer_under_sp_and_hybrid_layers(schedule, layout, sp):
    """Sequence parallelism (all-gathers, re-gathers, yield points) and one-block layers."""
    _run(schedule, "none", layout, sp)
    _run(schedule, "graphs", layout, sp)


def test_a_second_hand_over_fails_loudly():
    """The engine hands each layer over once; the stand-in refuses a second (the check the
    Megatron-FSDP adapter makes against Megatron-FSDP's own record of what it still awaits)."""
    freeing, _, _ = _run("overlap", "graphs")
    freeing.handed = {0}
    with pytest.raises(RuntimeError, match="handed over twice"):
        freeing.hand_over(0)


def test_an_op_after_release_is_caught(monkeypatch):
    """Were an op's layer tags too short, the freed parameters would fail the op itself; a layer
    needed again after its release fails the pass with one line instead of re-gathering it."""
    from megatron_oases.schedule.engine import fsdp

    original = fsdp.TaggedOps.compute

    def short(self, fn, j, pass_, early=False, light=False):  # forward: no bda_{j-1} tag
        op = original(self, fn, j, pass_, early, light)
        self.touches[op] = self.touches[op][-1:]
        return op

    monkeypatch.setattr(fsdp.TaggedOps, "compute", short)
    with pytest.raises(RuntimeError):
        _run("overlap", "graphs")


def test_fsdp2_layers_one_at_a_time(monkeypatch):
    """Without an adapter's, the engine runs FSDP2-wrapped layers the same way (``Fsdp2Layers``):
    ``unshard()`` one layer ahead, ``reshard()`` after its forward, after its backward FSDP2's own
    ``post_backward`` (reduce-scatter, reshard), on a one-rank gloo group, under a root FSDP2
    module as Megatron's; the gradients are plain autograd's."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from megatron_oases.schedule.engine import fsdp

    # a test before this one left its process group up: a leak to fix there, not a reason to skip
    assert not dist.is_initialized(), "a process group is already up in this process"
    blocks = make_blocks("gpt", layers=LAYERS)
    x = torch.randn(8, 6, 8, dtype=torch.float64)
    g = torch.randn_like(x)
    reference(blocks, x.clone().requires_grad_()).backward(g)
    want = [p.grad.clone() for p in parameters(blocks)]
    handed = []
    hand_over = fsdp.Fsdp2Layers.hand_over
    monkeypatch.setattr(
        fsdp.Fsdp2Layers, "hand_over", lambda self, i: (handed.append(i), hand_over(self, i))
    )

    class Root(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = torch.nn.ModuleList(blocks.layers)
            self.run = None

        def forward(self, hidden):
            split = lambda h: BatchSplit(h.shape, 2)  # noqa: E731
            self.run = ScheduledLayers(blocks, "overlap", split=split, rng=CPU_RNG)
            return run_scheduled(self.run, hidden)

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,))
        root = Root()
        for p in parameters(blocks):
            p.grad = None
        for layer in blocks.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(root, mesh=mesh)
        out = root(x.clone().requires_grad_())
        assert isinstance(root.run.sharded, PerLayer) and root.run.sharded.peak == 3
        out.backward(g)
        assert handed == list(reversed(range(LAYERS)))
        for p, ref in zip(parameters(blocks), want):
            torch.testing.assert_close(p.grad.full_tensor(), ref, rtol=1e-12, atol=1e-12)
    finally:
        dist.destroy_process_group()
