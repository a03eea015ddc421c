"""A stage's deferral of Megatron's own TMP communication to the schedule: one object, held by
the stage's deferring linears (:mod:`.linears`) and switched on by the engine around its compute
ops.

While the engine runs a compute op, the stage's tensor-parallel linears skip the collectives the
schedule's programs issue asynchronously; a column linear starts its input-gradient reduction
itself, on its own group, and hands it to :attr:`Deferral.early` (:class:`.comm.EarlyReductions`),
where the program's next collective of that sub-batch adopts it. Outside the engine the linears are
Megatron's. Why and how: ``docs/schedules.md`` (deferred communication).

Who sets and who reads each field of :class:`Deferral`:

======  ==========================================  ===========================================
field   set by                                      read by
======  ==========================================  ===========================================
active  :meth:`Deferral.deferring` (the engine's    every deferring linear (:mod:`.linears`):
        compute context; ``graphs`` at capture)     Megatron's forward, or the deferred one
early   the same, with the micro-batch's            the column linears' backward
        ``EarlyReductions`` (None: not started)     (:func:`.linears.linear_with_early_dgrad`)
supply  :meth:`Deferral.supplied`, in               the embedding's lookup
        ``stage_ends.EmbeddingEnd._finish``         (:class:`.linears.DeferringEmbedding`)
cuts    :meth:`Deferral.cut_at_scatter`, in         the embedding's reduce-scatter, and the
        ``stage_ends.EmbeddingEnd.                  one process-wide replacement,
        _backward_to_scatter``                      :func:`make_scatter`
======  ==========================================  ===========================================
"""

import torch

#: The cuts in progress (:meth:`Deferral.cut_at_scatter`), innermost last: what the one
#: process-wide replacement, :func:`make_scatter`, reads. Empty outside a stage end's backward.
_CUTTING = []


class Deferral:
    """One model stage's switch and hand-offs (the table above). The engine enters
    :meth:`deferring` around every compute op (nested where a yield point runs another sub-batch's
    ops); a plain object, not per thread: Megatron never runs two of a stage's passes at once."""

    __slots__ = ("active", "early", "supply", "cuts", "_outer")

    def __init__(self):
        self.active, self.early, self.supply, self.cuts = False, None, None, None
        self._outer = []

    def deferring(self, enabled=True, early=None):
        """Context: the stage's linears defer their communication (``enabled``); ``early``: the
        :class:`.comm.EarlyReductions` the column linears hand their input-gradient reduction to
        (None: the engine issues it after the backward op). Reusable and reentrant."""
        return _Deferring(self, enabled, early)

    def supplied(self, reduced):
        """Context: the embedding's next deferred lookup returns ``reduced`` (its reduction,
        computed by the schedule) instead of the partial sum; used exactly once."""
        return _Supplied(self, reduced)

    def take_supplied(self):
        reduced, self.supply = self.supply, None
        return reduced

    def cut_at_scatter(self):
        """Context: the embedding's split along the sequence (Megatron's
        ``scatter_to_sequence_parallel_region``, or with RoPE its own reduce-scatter), whose
        backward all-gathers, returns its local shard as a new autograd leaf and records
        ``(input, leaf)`` in the yielded list: a backward through the output then stops at the
        leaf, and the schedule all-gathers ``leaf.grad`` itself before continuing from
        ``input``. Used exactly once (else Megatron changed)."""
        return _Cut(self)

    def cut(self, input_, local):
        """``local`` (``input_``'s shard) as the leaf a cut records."""
        leaf = local.detach().requires_grad_(input_.requires_grad)
        self.cuts.append((input_, leaf))
        return leaf


class _Deferring:
    __slots__ = ("deferral", "enabled", "early")

    def __init__(self, deferral, enabled, early):
        self.deferral, self.enabled, self.early = deferral, enabled, early

    def __enter__(self):
        d = self.deferral
        d._outer.append((d.active, d.early))
        d.active, d.early = self.enabled, self.early
        return d

    def __exit__(self, *exc):
        d = self.deferral
        d.active, d.early = d._outer.pop()
        return False


class _Supplied:
    def __init__(self, deferral, reduced):
        self.deferral, self.reduced, self.outer = deferral, reduced, None

    def __enter__(self):
        self.outer, self.deferral.supply = self.deferral.supply, self.reduced

    def __exit__(self, *exc):
        unused = self.deferral.supply is not None
        self.deferral.supply = self.outer
        if unused and exc[0] is None:
            raise RuntimeError("oases: a supplied reduction was not consumed (Megatron changed?)")
        return False


class _Cut:
    def __init__(self, deferral):
        self.deferral, self.outer = deferral, None

    def __enter__(self):
        d = self.deferral
        self.outer, d.cuts = d.cuts, []
        _CUTTING.append(d)
        return d.cuts

    def __exit__(self, *exc):
        d = self.deferral
        cuts, d.cuts = d.cuts, self.outer
        _CUTTING.remove(d)
        if exc[0] is None and len(cuts) != 1:
            raise RuntimeError(
                f"oases: the embedding scattered its output {len(cuts)} times, expected once "
                "(Megatron changed?); run with --oases-schedule off and report it"
            )
        return False


def make_scatter(original):
    """Replacement for ``tensor_parallel.scatter_to_sequence_parallel_region`` (the one
    process-wide symbol the schedule replaces: Megatron's ``LanguageModelEmbedding`` calls it
    through the module) honouring a stage end's :meth:`Deferral.cut_at_scatter`; stock outside
    it."""

    def scatter(input_, *args, **kwargs):
        if not _CUTTING:
            return original(input_, *args, **kwargs)
        with torch.no_grad():
            local = original(input_.detach(), *args, **kwargs)
        return _CUTTING[-1].cut(input_, local)

    scatter.__name__ = scatter.__qualname__ = original.__name__
    scatter.__wrapped__ = original
    return scatter
