"""``--oases-schedule auto`` in Megatron-LM's own loop on 2 gloo ranks (TP=2, the tiny GPT, full
recompute, fp32, dropout 0), in one spawned job:

* stock, 24 iterations: the reference;
* ``auto --oases-retune-interval 8`` (iterations 1-16, saved at 16 by ``--exit-interval``) with a
  test-side patch that makes ``overlap`` fail on both ranks inside its first step, after both
  micro-batches were fetched and run forward, and sleeps on one rank per candidate after the
  step's collectives (rank 0 in ``off``'s steps, rank 1 in ``oases``'): every rank must choose
  ``cross-pass``, the one fast on *both* ranks, which only the slowest rank's time shows, and print
  the same table;
  its losses equal stock's (the failed step ran again on the same micro-batches); ``--log-json``
  holds the choice and the table;
* the resumed run (iterations 17-24, ``--load``) keeps ``cross-pass`` without a trial; at
  iteration 18 (8 after the choice at 9) it re-times ``cross-pass`` against the trial's runner-up
  while rank 0 alone sleeps in ``cross-pass``' steps: every rank switches to the runner-up after
  two timed rounds (18-22), the rest runs it, ``--log-json`` holds the re-timing, and its losses
  equal stock's.

A candidate failing on one rank only stops the run with one line, without hanging (its own job).
The failures and sleeps are injected by this file's patches on ``train_step``, never by a hook
in the package. Selection and refusals without process groups: ``tests/unit/test_autotune.py``.
"""

import json
import time

import pytest
from helpers import GPT, NO_DROP, RECOMPUTE
from helpers.runs import max_rel_diff, prepared

from megatron_oases.launch import run_distributed

pytestmark = pytest.mark.slow

BASE = (
    GPT.format(layers=2)
    + "--tensor-model-parallel-size 2 --micro-batch-size 2 --global-batch-size 4 "
    + NO_DROP
    + RECOMPUTE
    + "--train-iters 24 "
)
AUTO = "--oases-schedule auto --oases-tune-steps 16 "
RETUNE = "--oases-retune-interval 8 "
#: Seconds a rank sleeps inside a candidate's steps: far above a tiny step's noise.
SLEEP = 0.3


def _test_patch(record, slow=None, fail=None):
    """``train_step`` (by name, installed before the package's patches, so inside the tuner's
    timing) reading the tuner's live selection: ``slow``: {rank: schedule sleeping}; ``fail``:
    {rank: schedule whose first step raises inside the forward-backward, after the second
    micro-batch's forward}. Records the losses, the schedule of each step, and the tuner's record
    (the choice, once made)."""
    import inspect

    import torch
    import torch.distributed as dist
    from megatron.training import get_args, training

    from megatron_oases.patching import Patch
    from megatron_oases.tuning.runtime import ARGS_KEY

    original = training.train_step
    signature = inspect.signature(original)
    rank, fired = dist.get_rank(), set()

    def selection(model):
        """The run's schedule selection, as the prepared stage's bound decoder holds it."""
        for chunk in model:
            while hasattr(chunk, "module"):
                chunk = chunk.module
            forward = vars(chunk.decoder).get("forward")
            if forward is not None:
                return forward.args[1].layer_schedule
        raise AssertionError("no prepared stage on this rank")

    def train_step(forward_step_func, *a, **k):
        model = signature.bind(forward_step_func, *a, **k).arguments["model"]
        schedule = selection(model).schedule
        step_func = forward_step_func
        if (fail or {}).get(rank) == schedule and schedule not in fired:
            fired.add(schedule)
            calls = []

            def step_func(*x, **y):
                out = forward_step_func(*x, **y)
                calls.append(1)
                if len(calls) == 2:  # both micro-batches fetched, the second run forward
                    raise RuntimeError(f"injected failure of {schedule} (test)")
                return out

        record["schedules"].append(schedule)
        out = original(step_func, *a, **k)
        if (slow or {}).get(rank) == schedule:  # after the step's collectives: only this rank
            time.sleep(SLEEP)  # is slower, which only the agreed (slowest rank's) time shows
        loss = out[0].get("lm loss") if out[0] else None
        record["losses"].append(None if loss is None else float(torch.as_tensor(loss).flatten()[0]))
        record["tuner"] = getattr(get_args(), ARGS_KEY, None)  # the tuner's, as of the step before
        return out

    return Patch("test-autotune", [(training, "train_step", train_step)])


def _run(argv, **patch):
    from megatron_oases.training.pretrain import run_in_process

    record = {"losses": [], "schedules": []}
    out = run_in_process(prepared(argv), demo=True, extra_patches=[_test_patch(record, **patch)])
    return {**record, **out}


def _stock(argv):
    from helpers.runs import pretrain_and_capture

    return pretrain_and_capture(argv)


def auto_worker(base, ckpt, golden, golden_resumed):
    stock = _stock(base + " --oases-schedule off")
    saved = _run(
        f"{base} {AUTO} {RETUNE} --exit-interval 16 --save {ckpt} --log-json {golden}",
        slow={0: "off", 1: "oases"},
        fail={0: "overlap", 1: "overlap"},
    )
    resumed = _run(
        f"{base} {AUTO} {RETUNE} --load {ckpt} --log-json {golden_resumed}",
        slow={0: "cross-pass"},
    )
    return {"stock": stock, "saved": saved, "resumed": resumed}


@pytest.mark.timeout(300)
def test_auto_matches_stock_agrees_drops_a_failure_resumes_and_retunes(tmp_path):
    ckpt, golden, golden2 = tmp_path / "ckpt", tmp_path / "golden.json", tmp_path / "resumed.json"
    results = run_distributed(
        auto_worker, 2, BASE, str(ckpt), str(golden), str(golden2), timeout=280
    )
    for rank, res in enumerate(results):
        stock, saved, resumed = res["stock"], res["saved"], res["resumed"]
        assert {"oases-schedule", "oases-autotune"} <= set(saved["installed"])
        chosen = saved["tuner"]
        assert chosen["name"] == "cross-pass" and chosen["how"] == "timed", (rank, chosen)
        status = {row["candidate"]: row["status"] for row in chosen["table"]}
        assert status["overlap"].startswith("failed: RuntimeError: injected failure of overlap")
        assert status["off"] == status["oases"] == "dropped: slower", status
        assert chosen["iterations"] == [1, 9] and chosen["retunes"] == []  # next due at 18
        # the trial's and the re-timing's steps (the failed one run again) train as stock does
        assert len(saved["losses"]) == 16 and len(resumed["losses"]) == 8
        losses = saved["losses"] + resumed["losses"]
        assert max_rel_diff(losses, stock["losses"]) < 1e-5, (losses, stock["losses"])
        # resumed: cross-pass kept (17), then raced against the runner-up (the faster of the two
        # the trial dropped), which rank 0's sleeps make clearly faster: all switch at 23
        x = min(("off", "oases"), key=lambda n: _median(chosen, n))
        assert resumed["schedules"] == ["cross-pass", x, "cross-pass", x, "cross-pass", x, x, x]
        retuned = resumed["tuner"]
        assert retuned["name"] == x and retuned["how"] == "re-timed", (rank, retuned)
        assert retuned["iterations"] == [1, 9] and retuned["table"] == chosen["table"]
        (entry,) = retuned["retunes"]
        assert (
            entry["iterations"] == [18, 22] and entry["switched"] and entry["was"] == "cross-pass"
        )
        status = {row["candidate"]: row["status"] for row in entry["table"]}
        assert status == {"cross-pass": "dropped: slower", x: "chosen"}
    # one agreed time per step: the same table on every rank
    assert results[0]["saved"]["tuner"]["table"] == results[1]["saved"]["tuner"]["table"]
    logged = json.loads(golden.read_text())["oases-autotune"]
    assert logged["flags"] == "--oases-schedule cross-pass --oases-sub-batches 2"
    assert logged["table"] == results[1]["saved"]["tuner"]["table"]
    # the re-timing: one agreed time per step too, and in the resumed run's --log-json
    assert results[0]["resumed"]["tuner"]["retunes"] == results[1]["resumed"]["tuner"]["retunes"]
    logged = json.loads(golden2.read_text())["oases-autotune"]
    assert logged["retunes"] == results[1]["resumed"]["tuner"]["retunes"]
    assert logged["name"] == logged["retunes"][0]["name"] != "cross-pass"


def _median(record, name):
    return next(row["median_s"] for row in record["table"] if row["candidate"] == name)


def one_rank_fails(base):
    from megatron_oases.tuning import runtime

    runtime.FAILED_WAIT_MIN_S = 2.0  # the failed rank's wait for the others (60 s in a run)
    return _run(f"{base} {AUTO}", fail={1: "oases"})


@pytest.mark.timeout(200)
def test_a_candidate_failing_on_one_rank_stops_the_run_with_one_line():
    """The other rank is inside the step's collectives, waiting for the failed one: no
    agreement is possible. The failed rank stops the run (no hang) and names what to do."""
    with pytest.raises(RuntimeError) as err:
        run_distributed(one_rank_fails, 2, BASE, timeout=150)
    text = str(err.value)
    assert text.startswith("rank 1 failed")
    assert (
        "TrainingStopped: --oases-schedule auto: oases failed on rank 1 (RuntimeError: injected "
        "failure of oases (test)) while the other ranks are still inside that step's "
        "collectives; pin a schedule that runs here, e.g. --oases-schedule off"
    ) in text
