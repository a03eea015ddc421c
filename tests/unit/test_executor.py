"""Unit tests of the two-sub-batch executor (Alg. 1/2) and of the deferred TMP communication.

No process group: ``torch.distributed`` in the executor and in :mod:`.comm` (where collectives
start) is replaced by a recorder whose all-reduce only completes (sums
over its ``size`` identical ranks) when waited, so a result used before its wait shows up as a wrong
value, and every issue / wait / compute lands in one log whose order the tests pin down.
"""

import weakref

import pytest
import torch

from megatron_oases.instrument import trace as trace_mod
from megatron_oases.schedule.engine import comm, deferral
from megatron_oases.schedule.engine import executor as ex
from megatron_oases.schedule.engine.executor import Comm, Compute, run_programs


class FakeGroup:
    """A process group of ``n`` ranks (``size()`` as ``ProcessGroup``'s)."""

    def __init__(self, n):
        self.n = n

    def size(self):
        return self.n


class FakeWork:
    def __init__(self, channel, tensor, name, size):
        self.channel, self.tensor, self.name, self.size = channel, tensor, name, size
        self.waits = 0

    def wait(self):
        self.waits += 1
        self.channel.log.append(("wait", self.name))
        if self.channel.fail_wait:
            raise RuntimeError(f"collective {self.name} failed")
        self.tensor.mul_(self.size)  # the all-reduce (sum over `size` equal ranks) completes here
        self.channel.in_flight.remove(self)
        self.tensor = None  # a completed work holds no buffer (as the executor must not)


class FakeDist:
    """Stands in for ``torch.distributed`` inside the executor: one queue of collectives, recorded."""

    def __init__(self):
        self.log, self.in_flight, self.works, self.calls = [], [], [], []
        self.max_in_flight = 0
        self.fail_wait = False
        self.name_of = {}  # id(tensor) -> op name, set by the programs' get()
        self.reductions = {}  # op name -> the reduction it was issued with

    def get_world_size(self, group=None):
        return group.size()

    def all_reduce(self, tensor, op=None, group=None, async_op=False):  # completes as a sum
        name = self.name_of[id(tensor)]
        self.reductions[name] = op
        self.calls.append((name, group, async_op))
        self.log.append(("issue", name))
        work = FakeWork(self, tensor, name, group.size())
        self.in_flight.append(work)
        self.works.append(work)
        self.max_in_flight = max(self.max_in_flight, len(self.in_flight))
        return work


@pytest.fixture
def fake(monkeypatch):
    d = FakeDist()
    monkeypatch.setattr(comm, "dist", d)
    return d


def test_a_comm_passes_its_reduction(fake):
    """The loss's max all-reduce (``reduce_op``) reaches ``torch.distributed`` as given; every
    other collective is issued as a sum (the only reduction a column linear starts early)."""
    import torch.distributed

    g, got = FakeGroup(2), {}
    keep = lambda name: lambda t: got.__setitem__(name, t)  # noqa: E731
    tensors = {"max": torch.ones(1), "sum": torch.ones(1)}
    for name, t in tensors.items():
        fake.name_of[id(t)] = name
    prog = [
        Compute(lambda: None),
        Comm(get=lambda: tensors["max"], done=keep("max"), group=g, reduce_op="MAX"),
        Compute(lambda: None),
        Comm(get=lambda: tensors["sum"], done=keep("sum"), group=g),
        Compute(lambda: None),
    ]
    run_programs([prog])
    assert fake.reductions == {"max": "MAX", "sum": torch.distributed.ReduceOp.SUM}
    assert set(got) == {"max", "sum"}
    with pytest.raises(AssertionError):
        Comm(get=None, done=None, group=g, kind="all_gather", reduce_op="MAX")


#: the stage deferral the test programs record (the engine's compute context switches it)
STAGE = deferral.Deferral()


def program(fake, name, n_comms, group, state=None):
    """A layer-like program ``c0 C0 c1 C1 ... c_n``: compute k reads the result of comm k-1.

    Compute k records the value it sees; comm k all-reduces a fresh tensor (k+1) and its ``done``
    stores the reduced value where compute k+1 reads it.
    """
    state = {} if state is None else state
    ops = []
    for k in range(n_comms + 1):

        def fn(k=k):
            fake.log.append(("compute", f"{name}{k}"))
            state.setdefault("seen", []).append(state.get(k - 1))
            state.setdefault("deferring", []).append(STAGE.active)

        ops.append(Compute(fn, block=f"{name}{k}"))
        if k == n_comms:
            break

        def get(k=k):
            t = torch.full((2,), float(k + 1))
            fake.name_of[id(t)] = f"{name.upper()}{k}"
            state.setdefault("get_deferring", []).append(STAGE.active)
            return t

        def done(t, k=k):
            fake.log.append(("done", f"{name.upper()}{k}"))
            state[k] = t.clone()
            state.setdefault("done_deferring", []).append(STAGE.active)

        ops.append(Comm(get, done, group, block=f"{name.upper()}{k}"))
    return ops, state


def test_two_programs_interleave_in_documented_order(fake):
    """Alg. 1: run x's computes to its next comm, issue it async, switch; wait only when x
    resumes (its own pending result first). Issuing never waits: the link queues collectives."""
    g = FakeGroup(2)
    a, _ = program(fake, "a", 2, g)
    b, _ = program(fake, "b", 2, g)
    run_programs([a, b])
    assert fake.log == [
        ("compute", "a0"),
        ("issue", "A0"),
        ("compute", "b0"),  # hides A0
        ("issue", "B0"),  # queued behind A0: the host does not wait for A0 here
        ("wait", "A0"),  # a resumes: its own result first (data dependence)
        ("done", "A0"),
        ("compute", "a1"),  # hides B0
        ("issue", "A1"),
        ("wait", "B0"),
        ("done", "B0"),
        ("compute", "b1"),  # hides A1
        ("issue", "B1"),
        ("wait", "A1"),
        ("done", "A1"),
        ("compute", "a2"),  # hides B1; A is done afterwards
        ("wait", "B1"),
        ("done", "B1"),
        ("compute", "b2"),
    ]


def test_collectives_queue_in_issue_order(fake):
    """At most one collective in flight per sub-batch (so at most one per program in all),
    issued async on the op's group, alternating sub-batches, each waited exactly once, in issue
    order."""
    g = FakeGroup(4)
    a, _ = program(fake, "a", 3, g)
    b, _ = program(fake, "b", 3, g)
    run_programs([a, b])
    assert fake.max_in_flight == 2
    assert fake.in_flight == []
    assert [c[0] for c in fake.calls] == ["A0", "B0", "A1", "B1", "A2", "B2"]
    assert all(group is g and async_op is True for _, group, async_op in fake.calls)
    assert [w.waits for w in fake.works] == [1] * 6
    waits = [e[1] for e in fake.log if e[0] == "wait"]
    assert waits == ["A0", "B0", "A1", "B1", "A2", "B2"]
    for sub_batch in "AB":  # a sub-batch never has two collectives in flight
        mine = [e for e in fake.log if e[0] in ("issue", "wait") and e[1][0] == sub_batch]
        assert [e[0] for e in mine] == ["issue", "wait"] * 3


def test_a_comm_that_does_not_switch_lets_its_sub_batch_go_on(fake):
    """``Comm(switch=False)`` (a block's output in runs of tokens): the sub-batch issues it and
    goes on with its next compute, switching only at its next ordinary collective; when it
    resumes it takes all its results in issue order, each waited once, before its next compute
    reads them."""
    g, got = FakeGroup(2), {}
    b, _ = program(fake, "b", 1, g)

    def piece(name, value):
        def get():
            t = torch.full((2,), value)
            fake.name_of[id(t)] = name
            return t

        def done(t):
            fake.log.append(("done", name))
            got[name] = t.clone()

        return get, done

    def step(name):
        return Compute(lambda: fake.log.append(("compute", name)))

    def read():
        fake.log.append(("compute", "a-tail"))
        got["seen"] = got["P0"] + got["P1"]

    a = [step("a-run0")]
    a.append(Comm(*piece("P0", 1.0), g, switch=False))
    a.append(step("a-run1"))
    a.append(Comm(*piece("P1", 2.0), g))
    a.append(Compute(read))
    run_programs([a, b])
    assert fake.log == [
        ("compute", "a-run0"),
        ("issue", "P0"),
        ("compute", "a-run1"),  # no switch: the same sub-batch goes on
        ("issue", "P1"),
        ("compute", "b0"),  # switched after P1: b hides both
        ("issue", "B0"),
        ("wait", "P0"),
        ("done", "P0"),
        ("wait", "P1"),
        ("done", "P1"),
        ("compute", "a-tail"),
        ("wait", "B0"),
        ("done", "B0"),
        ("compute", "b1"),
    ]
    torch.testing.assert_close(got["seen"], torch.full((2,), 6.0))
    assert [w.waits for w in fake.works] == [1, 1, 1]


def test_a_finished_collective_leaves_its_buffer_to_the_program(fake):
    """Once ``done`` has taken a result, nothing in the executor refers to the collective's
    buffer while the sub-batch's next computes run: a ``done`` that drops it frees it. (The
    executor's loop variable once kept the last finished collective, holding a gathered buffer
    through a whole backward op: +24 MiB per rank at H=2048 under SP.)"""
    g, refs, freed = FakeGroup(2), [], []

    def get(name):
        t = torch.ones(2)
        fake.name_of[id(t)] = name
        refs.append(weakref.ref(t))
        return t

    for pieces in (1, 2):  # a whole block's collective, and one in runs (switch=False)
        refs.clear()
        prog = [Compute(lambda: None)]
        prog += [
            Comm(lambda i=i: get(f"X{i}"), lambda t: None, g, switch=i == pieces - 1)
            for i in range(pieces)
        ]
        prog.append(Compute(lambda: freed.append([r() is None for r in refs])))
        run_programs([prog])
        assert freed.pop() == [True] * pieces


def test_results_are_waited_before_use(fake):
    """A compute after a comm sees the all-reduced value (the fake only reduces on wait)."""
    a, sa = program(fake, "a", 2, FakeGroup(3))
    b, sb = program(fake, "b", 2, FakeGroup(3))
    run_programs([a, b])
    for state in (sa, sb):
        assert state["seen"][0] is None
        torch.testing.assert_close(state["seen"][1], torch.full((2,), 1.0 * 3))
        torch.testing.assert_close(state["seen"][2], torch.full((2,), 2.0 * 3))


def test_single_program_waits_its_own_comm_before_the_next_compute(fake):
    """With nothing to switch to, each comm is waited before the program goes on."""
    a, sa = program(fake, "a", 2, FakeGroup(2))
    run_programs([a])
    assert fake.log == [
        ("compute", "a0"),
        ("issue", "A0"),
        ("wait", "A0"),
        ("done", "A0"),
        ("compute", "a1"),
        ("issue", "A1"),
        ("wait", "A1"),
        ("done", "A1"),
        ("compute", "a2"),
    ]
    torch.testing.assert_close(sa["seen"][2], torch.full((2,), 4.0))


def test_unequal_and_empty_programs(fake):
    """Programs of different length (and an empty one) all finish; order inside each is kept."""
    g = FakeGroup(2)
    a, _ = program(fake, "a", 3, g)
    b, _ = program(fake, "b", 1, g)
    run_programs([a, b, []])
    computes = [e[1] for e in fake.log if e[0] == "compute"]
    assert [c for c in computes if c[0] == "a"] == ["a0", "a1", "a2", "a3"]
    assert [c for c in computes if c[0] == "b"] == ["b0", "b1"]
    assert fake.max_in_flight == 2 and fake.in_flight == []
    assert [e[1] for e in fake.log if e[0] == "done"] == ["A0", "B0", "A1", "A2"]
    fake.log.clear()
    run_programs([[], []])
    assert fake.log == []


def test_three_programs_run_every_op_once(fake):
    """More than two programs: each op once, program order kept, one collective in flight per
    program at most."""
    g = FakeGroup(2)
    progs = [program(fake, n, 2, g)[0] for n in "abc"]
    run_programs(progs)
    computes = [e[1] for e in fake.log if e[0] == "compute"]
    assert sorted(computes) == sorted(f"{n}{k}" for n in "abc" for k in range(3))
    for n in "abc":
        assert [c for c in computes if c[0] == n] == [f"{n}0", f"{n}1", f"{n}2"]
    assert fake.max_in_flight == 3
    assert sorted(w.name for w in fake.works) == sorted(f"{n}{k}" for n in "ABC" for k in range(2))


@pytest.mark.parametrize("group", [None, FakeGroup(1)], ids=["no-group", "size-1"])
def test_trivial_group_skips_the_collective(fake, group):
    """No all-reduce for a missing or size-1 group; ``done`` still runs, before the value's use."""
    a, sa = program(fake, "a", 1, group)
    b, sb = program(fake, "b", 1, group)
    run_programs([a, b])
    assert fake.calls == []
    assert fake.log == [
        ("compute", "a0"),
        ("compute", "b0"),
        ("done", "A0"),
        ("compute", "a1"),
        ("done", "B0"),
        ("compute", "b1"),
    ]
    torch.testing.assert_close(sa["seen"][1], torch.full((2,), 1.0))
    torch.testing.assert_close(sb["seen"][1], torch.full((2,), 1.0))


def test_run_executes_with_tmp_comm_deferred(fake):
    """The run executes in the engine's compute context (deferring Megatron's own TP
    all-reduces), entered once: computes, and the schedule's get/done, which call no Megatron
    layer; the caller's state is back afterwards."""
    a, sa = program(fake, "a", 2, FakeGroup(2))
    b, _ = program(fake, "b", 2, FakeGroup(2))
    assert not STAGE.active
    run_programs([a, b], compute_context=STAGE.deferring())
    assert sa["deferring"] == [True, True, True]
    assert sa["get_deferring"] == [True, True]
    assert sa["done_deferring"] == [True, True]
    assert not STAGE.active


def test_compute_error_propagates_and_restores_deferral(fake):
    def boom():
        raise ValueError("compute failed")

    a, _ = program(fake, "a", 1, FakeGroup(2))
    with pytest.raises(ValueError, match="compute failed"):
        run_programs([a, [Compute(boom)]], compute_context=STAGE.deferring())
    assert not STAGE.active
    assert ("compute", "a0") in fake.log


def test_comm_errors_propagate(fake):
    def bad_get():
        raise KeyError("no tensor")

    with pytest.raises(KeyError, match="no tensor"):
        run_programs([[Comm(bad_get, lambda t: None, FakeGroup(2))]])

    fake.fail_wait = True
    a, sa = program(fake, "a", 1, FakeGroup(2))
    with pytest.raises(RuntimeError, match="collective A0 failed"):
        run_programs([a])
    assert 0 not in sa  # done never ran on a failed collective
    assert ("compute", "a1") not in fake.log


def test_tracer_sees_sub_batch_and_labels(fake, monkeypatch):
    """Computes and collectives are traced under their sub-batch, op labels and ``labels``."""
    tracer = trace_mod.Tracer()
    seen = []
    orig = fake.all_reduce

    def all_reduce(tensor, op=None, group=None, async_op=False):
        seen.append(dict(tracer.current))
        return orig(tensor, op=op, group=group, async_op=async_op)

    fake.all_reduce = all_reduce
    a, _ = program(fake, "a", 1, FakeGroup(2))
    b, _ = program(fake, "b", 1, FakeGroup(2))
    depth = len(tracer._ctx)
    run_programs([a, b], labels={"pass": "backward", "layer": 7}, tracer=tracer)
    assert len(tracer._ctx) == depth
    computes = [(e["args"]["block"], e["args"]["sub_batch"]) for e in tracer.events]
    assert computes == [("a0", 0), ("b0", 1), ("a1", 0), ("b1", 1)]
    assert all(e["args"]["pass"] == "backward" and e["args"]["layer"] == 7 for e in tracer.events)
    assert [(s["block"], s["sub_batch"], s["layer"]) for s in seen] == [("A0", 0, 7), ("B0", 1, 7)]


class TestDeferral:
    """A stage's :class:`~megatron_oases.schedule.engine.deferral.Deferral`: off outside the engine's
    context, on inside, each exit restoring what its enter found."""

    def test_context_nests_and_restores(self):
        d = deferral.Deferral()
        assert not d.active
        with d.deferring(early="e") as entered:
            assert entered is d and d.active and d.early == "e"
            with d.deferring(enabled=False):
                assert not d.active and d.early is None
            assert d.active and d.early == "e"
        assert not d.active and d.early is None
        with pytest.raises(ZeroDivisionError):
            with d.deferring():
                1 / 0
        assert not d.active

    def test_a_supplied_reduction_is_used_once(self):
        d = deferral.Deferral()
        with d.supplied("r"):
            assert d.take_supplied() == "r" and d.take_supplied() is None
        with pytest.raises(RuntimeError, match="not consumed"):
            with d.supplied("r"):
                pass
        assert d.supply is None

    def test_a_cut_records_one_leaf_and_the_scatter_honours_only_an_open_cut(self):
        d = deferral.Deferral()
        scatter = deferral.make_scatter(lambda x, group=None: x[:1])
        x = torch.ones(2, 3, requires_grad=True)
        assert scatter(x).grad_fn is not None  # stock outside a cut
        with d.cut_at_scatter() as cuts:
            leaf = scatter(x * 2)
        ((full, got),) = cuts
        assert got is leaf and leaf.is_leaf and leaf.requires_grad and full.grad_fn is not None
        with pytest.raises(RuntimeError, match="scattered its output 0 times"):
            with d.cut_at_scatter():
                pass
        assert not deferral._CUTTING


def test_early_reductions_are_adopted_in_order_by_the_very_tensor(fake):
    """What a column linear started is adopted by the program's next collective of that very
    gradient; another tensor finds nothing, one started later first is an error, and one left
    over is reported after the backward (waited on first)."""
    g = FakeGroup(2)
    early = comm.EarlyReductions()
    a, b = torch.ones(2), torch.ones(2)
    fake.name_of[id(a)], fake.name_of[id(b)] = "a", "b"
    early.start(a, g)
    early.start(b, g)
    assert early.take(torch.ones(2)) is None
    with pytest.raises(RuntimeError, match="out of order"):
        early.take(b)
    work, result = early.take(a)
    assert result() is a
    with pytest.raises(RuntimeError, match="another kind"):
        early.take(b, scatter=True)
    early.start(a, g)
    with pytest.raises(RuntimeError, match="no collective of the schedule took it"):
        early.check_empty()


def test_early_compute_runs_before_its_sub_batch_waits(fake):
    """An ``early`` compute (a recomputation from a saved input) runs when its sub-batch resumes,
    before it waits for its collective and ahead of the ops that need it; each op runs once."""
    g = FakeGroup(2)
    a, state = program(fake, "a", 1, g)

    def early():
        fake.log.append(("compute", "a-early"))
        state["early_saw"] = state.get(0)  # A0 still in flight: nothing delivered yet

    a.insert(3, Compute(early, early=True, block="a-early"))  # a0 A0 a1 a-early
    b, _ = program(fake, "b", 1, g)
    run_programs([a, b])
    assert fake.log == [
        ("compute", "a0"),
        ("issue", "A0"),
        ("compute", "b0"),
        ("issue", "B0"),
        ("compute", "a-early"),  # a resumes: the early op before A0 is waited for
        ("wait", "A0"),
        ("done", "A0"),
        ("compute", "a1"),  # not run again after it
        ("wait", "B0"),
        ("done", "B0"),
        ("compute", "b1"),
    ]
    assert state["early_saw"] is None and torch.equal(state["seen"][1], torch.full((2,), 2.0))


def _yielding_program(fake, name, group, interleave, light):
    """``x0 X0 x1 X1 x2``: x0 and x2 are long ops with a yield point inside, x1 is short
    (``light`` or not)."""

    def long(k):
        def fn():
            fake.log.append(("start", f"{name}{k}"))
            interleave()
            fake.log.append(("end", f"{name}{k}"))

        return Compute(fn, block=f"{name}{k}")

    def short():
        return Compute(
            lambda: fake.log.append(("compute", f"{name}1")), light=light, block=f"{name}1"
        )

    def comm_op(k):
        def get():
            t = torch.ones(2)
            fake.name_of[id(t)] = f"{name.upper()}{k}"
            return t

        return Comm(get, lambda t: fake.log.append(("done", f"{name.upper()}{k}")), group)

    return [long(0), comm_op(0), short(), comm_op(1), long(2)]


def test_yield_point_runs_the_other_sub_batch_light_stretch(fake):
    """A yield point inside a running op lets the other sub-batch take its pending result, run
    its light ops and issue its next collective there, hidden by the rest of the running op;
    the executor then goes on in program order, each op once."""
    g, interleave = FakeGroup(2), ex.Interleave()
    a = _yielding_program(fake, "a", g, interleave, light=True)
    b = _yielding_program(fake, "b", g, interleave, light=True)
    run_programs([a, b], interleave=interleave)
    assert fake.log == [
        ("start", "a0"),  # nothing pending at this yield point
        ("end", "a0"),
        ("issue", "A0"),
        ("start", "b0"),
        ("wait", "A0"),  # b0's yield point: a's short op and its next issue run inside b0
        ("done", "A0"),
        ("compute", "a1"),
        ("issue", "A1"),
        ("end", "b0"),
        ("issue", "B0"),
        ("wait", "A1"),
        ("done", "A1"),
        ("start", "a2"),
        ("wait", "B0"),
        ("done", "B0"),
        ("compute", "b1"),
        ("issue", "B1"),
        ("end", "a2"),
        ("wait", "B1"),
        ("done", "B1"),
        ("start", "b2"),
        ("end", "b2"),
    ]
    assert interleave.execution is None  # outside an execution the yield points do nothing
    interleave()


def test_yield_point_skips_a_stretch_that_is_not_light(fake):
    g, interleave = FakeGroup(2), ex.Interleave()
    a = _yielding_program(fake, "a", g, interleave, light=False)
    b = _yielding_program(fake, "b", g, interleave, light=False)
    run_programs([a, b], interleave=interleave)
    order = [e for e in fake.log if e[0] in ("start", "end", "compute")]
    assert order == [
        ("start", "a0"),
        ("end", "a0"),
        ("start", "b0"),
        ("end", "b0"),
        ("compute", "a1"),
        ("compute", "b1"),
        ("start", "a2"),
        ("end", "a2"),
        ("start", "b2"),
        ("end", "b2"),
    ]


def test_yield_point_splits_the_running_op_trace_segment(fake):
    """The running op's trace segment pauses while the other sub-batch's ops run: segments never
    nest, so compute time is not counted twice."""
    tracer = trace_mod.Tracer()
    g, interleave = FakeGroup(2), ex.Interleave()
    a = _yielding_program(fake, "a", g, interleave, light=True)
    b = _yielding_program(fake, "b", g, interleave, light=True)
    run_programs([a, b], tracer=tracer, interleave=interleave)
    segments = sorted((e["ts"], e["ts"] + e["dur"], e["args"]["block"]) for e in tracer.events)
    assert [s[2] for s in segments] == ["a0", "b0", "a1", "b0", "a2", "b1", "a2", "b2"]
    assert all(end <= nxt + 1e-6 for (_, end, _), (nxt, _, _) in zip(segments, segments[1:]))
