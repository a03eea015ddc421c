"""A stage's sharded parameters around the engine's passes: the work of the sharded data-parallel
wrappers' hooks, which the engine bypasses (it runs a layer's attention and MLP halves and the
embedding's submodules itself, and its own backward programs), done by the engine.

One layer at a time (:class:`PerLayer` over a :class:`ShardedLayers`): each pass (forward;
backward with its recomputation, all its rounds) gathers a layer before the first op that reads
its parameters and starts the next layer's gather then (one layer ahead), and once every
sub-batch has run its last op of that layer (its forward; its recomputation and backward) hands
the layer's gradients over, once, and releases it. A stage then holds two or three layers'
gathered parameters at a time (the one running, the one prefetched, and at a layer boundary the
one before), as stock does, whatever its depth. The :class:`ShardedLayers` is

- the adapter's for Megatron-FSDP (``--use-megatron-fsdp``: ``schedule/megatron/fsdp_params.py``,
  passed as ``ScheduledLayers(sharded=...)``);
- else, where every layer of the stage is FSDP2-wrapped (``--use-torch-fsdp2``: Megatron's FSDP2
  wrapper calls ``fully_shard`` on each ``TransformerLayer`` and on the embedding, and FSDP2
  gathers a module's parameters in hooks around its ``forward`` and reduce-scatters their
  gradients from a hook on its inputs' gradients), :class:`Fsdp2Layers`: FSDP2's public
  ``unshard()`` / ``reshard()`` (kept gathered from forward to backward under
  ``--torch-fsdp2-no-reshard-after-forward``) and, as the layer's hand-over, its parameter groups'
  ``post_backward`` (what that hook runs: reduce-scatter, reshard). The embedding is gathered for
  a whole pass; its gradients are reduce-scattered by FSDP2's end-of-backward callback (queued by
  the root module's own hook on the model's output), as is any group no hand-over finished.

Otherwise :class:`ShardedParams`: the FSDP2 modules among the layers and the embedding (if any)
gathered around each whole pass, left to that callback after backward.

Which layers an op reads is known when the programs are built (:class:`TaggedOps`): an op of
block j reads block j's layer, and in forward the first op of a layer's first block also runs
the previous block's bias-dropout-add (its bias is that layer's). The embedding and the output
layer are the wrapper's own modules, gathered by their own hooks.
"""

import collections
import contextlib

from torch.distributed.fsdp import FSDPModule

from .ops import BlockOps


class ShardedParams:
    """The FSDP2-wrapped ones among ``modules`` (a stage's layers, the embedding), gathered
    around each whole pass; empty, and every call a no-op, without ``--use-torch-fsdp2``."""

    tags = False  # the ops need no layer tags

    def __init__(self, modules):
        self.modules = [m for m in modules if isinstance(m, FSDPModule)]

    def gather(self):
        """All-gather every module's parameters (issued together, then waited on)."""
        handles = [m.unshard(async_op=True) for m in self.modules]
        for handle in handles:
            handle.wait()

    def reshard_after_forward(self):
        """Free the gathered parameters after forward, as FSDP2's post-forward hook would."""
        for m in self.modules:
            if _reshards_after_forward(m):
                m.reshard()

    @contextlib.contextmanager
    def running(self, rounds, ops, backward):
        """Around one pass (``rounds`` of programs; see :class:`PerLayer.running`)."""
        self.gather()  # backward: FSDP2's root post-backward callback reduce-scatters, reshards
        yield
        if not backward:
            self.reshard_after_forward()


def _reshards_after_forward(module):
    """FSDP2's ``reshard_after_forward`` of ``module`` (Megatron: True unless
    ``--torch-fsdp2-no-reshard-after-forward``). FSDP2 has a setter but no getter: its parameter
    groups hold it (``_reshard_after_forward``); True where they do not say."""
    groups = getattr(module._get_fsdp_state(), "_fsdp_param_groups", None) or []
    return not groups or any(getattr(g, "_reshard_after_forward", True) for g in groups)


class ShardedLayers:
    """What :class:`PerLayer` drives, by the stage position ``i`` of a layer: the adapter's
    (Megatron-FSDP: ``schedule/megatron/fsdp_params.py``). Called in this order per pass and
    layer: ``gather`` (start the all-gather; may return at once), ``wait`` (the parameters are
    there), ``release`` (free them); in backward ``hand_over`` (the layer's accumulated gradients
    to the wrapper, once) right before ``release``; ``finish`` once after each pass. Nothing here:
    parameters that are always whole."""

    def start(self, backward):
        """Before each pass (the modules the programs run besides the layers)."""

    def gather(self, i, backward):
        pass

    def wait(self, i, backward):
        pass

    def release(self, i, backward):
        pass

    def hand_over(self, i):
        pass

    def finish(self, backward):
        pass


class Fsdp2Layers(ShardedLayers):
    """A stage's FSDP2-wrapped ``layers`` one at a time, through FSDP2's ``unshard()`` /
    ``reshard()`` and, once a layer's backward is done, its parameter groups' ``post_backward``
    (what FSDP2's own post-backward hook on the layer's inputs runs: the accumulated unsharded
    gradients reduce-scattered, the layer resharded). ``ends``: FSDP2 modules the programs run
    besides the layers (the embedding), gathered for a whole pass; FSDP2's end-of-backward
    callback reduce-scatters their gradients."""

    def __init__(self, layers, ends=()):
        self.layers, self.ends = list(layers), list(ends)
        self.handles = {}

    def start(self, backward):
        for handle in [m.unshard(async_op=True) for m in self.ends]:
            handle.wait()

    def gather(self, i, backward):
        self.handles[i] = self.layers[i].unshard(async_op=True)

    def wait(self, i, backward):
        handle = self.handles.pop(i, None)
        if handle is not None:
            handle.wait()

    def release(self, i, backward):
        if not backward and _reshards_after_forward(self.layers[i]):
            self.layers[i].reshard()  # after backward: post_backward resharded it

    def hand_over(self, i):
        for group in _param_groups(self.layers[i]):
            group.post_backward()

    def finish(self, backward):
        if not backward:
            for m in self.ends:
                if _reshards_after_forward(m):
                    m.reshard()


def _param_groups(module):
    """FSDP2's parameter groups of ``module`` (a list since torch 2.10, one group before)."""
    state = module._get_fsdp_state()
    groups = getattr(state, "_fsdp_param_groups", None)
    if groups is None:
        group = getattr(state, "_fsdp_param_group", None)
        groups = [] if group is None else [group]
    return groups


def default_sharded(layers, ends):
    """The engine's own choice without an adapter's: FSDP2 one layer at a time where every layer
    of the stage is FSDP2-wrapped, else the FSDP2 modules among them gathered around each pass
    (none: no-op)."""
    if layers and all(isinstance(m, FSDPModule) for m in layers):
        return PerLayer(Fsdp2Layers(layers, [m for m in ends if isinstance(m, FSDPModule)]))
    return ShardedParams(list(layers) + list(ends))


class TaggedOps(BlockOps):
    """:class:`.ops.BlockOps` that records, for each compute op it makes, the stage positions of
    the layers whose parameters it reads (``touches``: op -> tuple)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.touches = {}

    def compute(self, fn, j, pass_, early=False, light=False):
        op = super().compute(fn, j, pass_, early, light)
        blocks, layer = self.blocks, self.blocks.layer_index(j)
        if pass_ == "forward" and j > 0 and blocks.starts_layer(j):
            # the layer's first op runs bda_{j-1} (its bias: the previous layer's) before ln_j;
            # the block's other forward ops are tagged the same (a little longer, never shorter)
            self.touches[op] = (blocks.layer_index(j - 1), layer)
        else:
            self.touches[op] = (layer,)
        return op


class PerLayer:
    """``layers`` (a :class:`ShardedLayers`) one layer at a time around each pass of the engine
    (the module docstring). ``peak``: the most layers gathered at once so far."""

    tags = True

    def __init__(self, layers):
        self.layers = layers
        self.peak = 0
        self._held = set()

    @contextlib.contextmanager
    def running(self, rounds, ops, backward):
        """Around one pass: ``rounds``, each a list of sub-batch programs, run in that order;
        ``ops``: the :class:`TaggedOps` that made them. Wraps every op that reads a layer's
        parameters; after the pass, every layer has been released (and in backward handed over)
        exactly once, else this raises."""
        self.layers.start(backward)
        pass_ = _Pass(self, backward)
        wrapped = set()
        for programs in rounds:
            for program in programs:
                for op in program:
                    touched = ops.touches.get(op)
                    if touched is None:
                        continue
                    for i in touched:
                        pass_.count(i)
                    if op not in wrapped:
                        wrapped.add(op)
                        op.fn = pass_.wrap(op.fn, touched)
        yield
        pass_.check()
        self.layers.finish(backward)

    def _gather(self, i, backward):
        self.layers.gather(i, backward)
        self._held.add(i)
        self.peak = max(self.peak, len(self._held))

    def _release(self, i, backward):
        if backward:
            self.layers.hand_over(i)
        self.layers.release(i, backward)
        self._held.discard(i)


class _Pass:
    """One pass's bookkeeping for :class:`PerLayer`: how many ops of each layer are still to
    run, which layers are gathered (issued) and waited on (ready), the order of first use."""

    def __init__(self, owner, backward):
        self.owner, self.backward = owner, backward
        self.remaining = collections.Counter()
        self.order = []  # layers by first use, the prefetch order
        self.next = None
        self.issued, self.ready, self.done = set(), set(), set()

    def count(self, i):
        if i not in self.remaining:
            self.order.append(i)
        self.remaining[i] += 1

    def wrap(self, fn, touched):
        def run():
            for i in touched:
                if i not in self.ready:
                    self.need(i)
            fn()
            for i in touched:
                self.used(i)

        return run

    def need(self, i):
        """Layer ``i`` gathered and waited on; the next layer's gather started."""
        if i in self.done:
            raise RuntimeError(
                f"oases: layer {i} of the stage ran an op after its parameters were released "
                "in this pass (an engine bug); run with --oases-schedule off and report it"
            )
        owner, backward = self.owner, self.backward
        if i not in self.issued:
            self.issued.add(i)
            owner._gather(i, backward)
        owner.layers.wait(i, backward)
        self.ready.add(i)
        if self.next is None:
            self.next = dict(zip(self.order, self.order[1:]))
        after = self.next.get(i)
        if after is not None and after not in self.issued:
            self.issued.add(after)
            owner._gather(after, backward)

    def used(self, i):
        self.remaining[i] -= 1
        if self.remaining[i] == 0:
            self.ready.discard(i)
            self.done.add(i)
            self.owner._release(i, self.backward)

    def check(self):
        """Every layer's ops ran, and each layer was released once."""
        left = sorted(i for i, n in self.remaining.items() if n)
        if left or self.issued != self.done:
            raise RuntimeError(
                f"oases: after a pass the stage's layers {left or sorted(self.issued - self.done)}"
                " still hold gathered parameters (an engine bug); run with --oases-schedule off "
                "and report it"
            )
