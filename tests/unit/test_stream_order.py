"""The order of stream and event operations the executor issues on CUDA, for ``overlap`` and
``oases`` (issue 42): recorded on the CPU through a stand-in for ``torch.cuda``'s streams, events
and spin (:mod:`helpers.recording_cuda`, as :mod:`tests.unit.test_cuda_link` for the link
emulator alone), with every emulated collective taking the link emulator's CUDA path (a spin on
its channel's stream, a stream wait where its result is needed).

With ``CUDA_DEVICE_MAX_CONNECTIONS=1`` kernels enter the GPU in issue order, so the order of
these calls is the order the GPU sees. Two things must hold for the collectives to run beside
compute:

* each collective is issued (its spin launched) before the other sub-batch's compute that is to
  hide it, i.e. before the compute stream's wait on it there is compute of another sub-batch;
* the compute stream waits on a collective only where its result is consumed: the next compute
  after the wait is its own sub-batch's, never the other sub-batch's (a wait issued early would
  make the other sub-batch's kernels queue behind the spin).

One tiny training iteration on the fake process group (rank 0 of TP 2) per schedule."""

import pytest
import torch

import megatron.training.arguments  # noqa: F401,E402  isort: skip  (start-up warnings here)

from helpers.recording_cuda import recording_cuda

from megatron_oases.schedule.engine import executor as ex
from megatron_oases.testbed import collectives
from megatron_oases.testbed.link_model import CudaLink

BASE = (
    "--num-layers 2 --hidden-size 64 --num-attention-heads 8 --seq-length 32 "
    "--max-position-embeddings 32 --vocab-size 512 --mock-data --tensor-model-parallel-size 2 "
    "--micro-batch-size 2 --global-batch-size 2 --hidden-dropout 0 --attention-dropout 0 "
    "--emulate-link rtx3090-pcie --train-iters 1 --fake-process-group "
    "--no-gradient-accumulation-fusion --no-persist-layer-norm --no-masked-softmax-fusion"
)
RECOMPUTE = " --recompute-granularity full --recompute-method uniform --recompute-num-layers 1"


def _recorded_cuda(log):
    """The stand-ins as a :class:`Patch` installed after the CPU shims; events go by the link's
    ``oases_id`` and spins by launch number, the link's calibration spins left out."""
    return recording_cuda(
        log,
        event_tag=lambda event: getattr(event, "oases_id", None),
        elapsed_ms=1.0,
        spin_tag=lambda cycles: CudaLink.launches,
        compute_spins=False,
    )


@pytest.fixture
def recorded(monkeypatch):
    """Runs one iteration of a schedule; returns the merged log of computes (by sub-batch),
    collective issues, spins and stream waits."""
    import megatron_oases.testbed.spin as spin_mod

    log = []

    def no_triton(*args, **kwargs):  # the torch.cuda._sleep path, as on a GPU without Triton
        raise RuntimeError("no GPU")

    monkeypatch.setattr(spin_mod, "spin", no_triton)
    monkeypatch.setattr(CudaLink, "launches", 0)
    monkeypatch.setenv("OASES_EMULATE_DILATION", "1")
    # every emulated collective takes the CUDA path (the tensors stay on the CPU)
    monkeypatch.setattr(collectives, "_device", lambda *c: torch.device("cuda", 0))
    init, compute, issue = ex._Execution.__init__, ex._Execution.compute, ex._issue

    def run_init(self, *args, **kwargs):
        init(self, *args, **kwargs)
        self.tracked = True  # every compute through _Execution.compute, where it is logged
        log.append(("run",))

    def run_compute(self, x, op):
        log.append(("compute", self.ids[x]))
        return compute(self, x, op)

    def logged_issue(sub_batch, op, tracer, early):
        log.append(("issue", sub_batch))
        return issue(sub_batch, op, tracer, early)

    monkeypatch.setattr(ex._Execution, "__init__", run_init)
    monkeypatch.setattr(ex._Execution, "compute", run_compute)
    monkeypatch.setattr(ex, "_issue", logged_issue)

    def run(flags):
        import shlex

        import torch.distributed as dist

        from megatron_oases.launch import init_fake_process_group
        from megatron_oases.training.pretrain import run_in_process

        log.clear()
        init_fake_process_group(2)
        try:
            run_in_process(
                shlex.split(BASE + flags), demo=True, extra_patches=[_recorded_cuda(log)]
            )
        finally:
            dist.destroy_process_group()
        return list(log)

    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("LOCAL_RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    return run


def _collectives_in_runs(log):
    """Per spin launched inside an executor run: (run index, its sub-batch, log position of the
    launch, of the compute stream's wait on it, the sub-batches of the computes after the launch
    in that run, with their positions)."""
    runs, cur, owner = [], None, None
    for i, e in enumerate(log):
        if e[0] == "run":
            cur = {"start": i, "spins": {}, "computes": [], "waits": {}}
            runs.append(cur)
            owner = None
        elif cur is None:
            continue
        elif e[0] in ("compute", "issue"):
            owner = e[1]
            if e[0] == "compute":
                cur["computes"].append((i, e[1]))
        elif e[0] == "spin":
            cur["spins"][e[2]] = (i, owner)
        elif e[0] == "wait_event" and e[2] is not None:
            cur["waits"].setdefault(e[2], []).append((i, e[1]))
    return runs


def _check_order(log):
    runs = _collectives_in_runs(log)
    # a wait on a spin may fall in a later run (a gradient hook's reduction): look it up globally
    waits = {}
    for i, e in enumerate(log):
        if e[0] == "wait_event" and e[2] is not None:
            waits.setdefault(e[2], []).append((i, e[1]))
    checked = 0
    for r in runs:
        for n, (at, x) in r["spins"].items():
            assert x is not None, f"spin {n} launched outside a compute or an issue"
            assert n in waits, f"collective {n} of sub-batch {x} is never waited on"
            (w, stream), *more = waits[n]
            assert not more, f"collective {n} waited on {len(more) + 1} times"
            assert stream == "compute", (n, stream)
            later = [(i, y) for i, y in r["computes"] if i > at]
            others = [i for i, y in later if y != x]
            if others:  # the other sub-batch has compute left: some of it runs before the wait
                assert others[0] < w, (
                    f"collective {n} of sub-batch {x}: the compute stream waits on it (log "
                    f"{w}) before any compute of another sub-batch (first at {others[0]})"
                )
            after = [y for i, y in later if i > w]
            if after:  # the wait sits right before its own sub-batch's next compute
                assert after[0] == x, (
                    f"collective {n} of sub-batch {x}: the compute stream waits on it before "
                    f"sub-batch {after[0]}'s compute, where its result is not consumed"
                )
            checked += 1
    return checked


@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    "name, flags",
    [
        ("overlap", " --oases-schedule overlap"),
        ("oases", " --oases-schedule oases" + RECOMPUTE),
        # the graphs' CPU bookkeeping (static buffers, replays in place of the computes)
        ("oases+graphs", " --oases-schedule oases --oases-cuda-graphs eager" + RECOMPUTE),
    ],
)
def test_collectives_go_out_before_the_other_sub_batch_and_are_waited_on_where_consumed(
    recorded, name, flags
):
    log = recorded(flags)
    spins = [e for e in log if e[0] == "spin"]
    assert spins and all(e[1] != "compute" for e in spins), "collectives on the compute stream"
    # the link stream starts each collective after the compute issued before it
    assert sum(1 for e in log if e[0] == "wait_stream" and e[2] == "compute") >= len(spins)
    checked = _check_order(log)
    # two layers, two sub-batches: at least the blocks' forward and backward all-reduces
    assert checked >= 2 * 2 * 4, (name, checked)


def test_the_order_check_catches_an_early_wait():
    """The assertion fails on the order the GPU must not see: sub-batch 0's collective waited
    on before sub-batch 1 computes."""
    good = [("run",), ("compute", 0), ("issue", 0), ("spin", "s1", 1), ("compute", 1),
            ("issue", 1), ("spin", "s1", 2), ("wait_event", "compute", 1), ("compute", 0),
            ("wait_event", "compute", 2), ("compute", 1)]  # fmt: skip
    assert _check_order(good) == 2
    early = [("run",), ("compute", 0), ("issue", 0), ("spin", "s1", 1),
             ("wait_event", "compute", 1), ("compute", 1), ("compute", 0)]  # fmt: skip
    with pytest.raises(AssertionError, match="before any compute of another sub-batch"):
        _check_order(early)
    misplaced = [("run",), ("compute", 0), ("issue", 0), ("spin", "s1", 1), ("compute", 1),
                 ("wait_event", "compute", 1), ("compute", 1), ("compute", 0)]  # fmt: skip
    with pytest.raises(AssertionError, match="where its result is not consumed"):
        _check_order(misplaced)
