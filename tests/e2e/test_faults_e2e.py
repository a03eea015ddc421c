"""Fault injection under the real training loop: ``oases train`` on 2 torchrun ranks (Megatron-LM's
``pretrain()``), with a fault chosen by ``OASES_FAULT`` in the test-only program
``tests/helpers/fault_injection.py`` (the package has no fault hooks).

* a rank killed or stopped mid-iteration ends the job (non-zero, no hang: a stopped rank within the
  distributed timeout);
* a full disk during a save stops the run with one line, the previous checkpoint intact, and the
  run resumes from it bit-exactly (dropout on);
* a rank killed while re-saving the latest iteration leaves that checkpoint loadable;
* a NaN seen only on the last pipeline stage is still reported (once);
* damaged checkpoints, an unwritable ``--save``, a checkpoint of another vocabulary padding or
  learning-rate schedule: one line each, before training.

Damaged plan, profile and model files and the staged save's own failures, in one process:
``tests/unit/test_faults.py``.
"""

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import types

import pytest
from helpers.paths import FAULT_INJECTION
from helpers.runs import pretrain_and_capture

from megatron_oases.launch import run_distributed, torchrun_command

#: The demo model (2 layers, dropout 0.1) at TP=2, a vocabulary whose padding depends on TP.
TINY = "train --tensor-model-parallel-size 2 --vocab-size 520 --train-iters 4 ".split()
#: Megatron's fallback warnings that quiet.py keeps out of the way on CPU.
#: Megatron's line for a trained iteration.
TRAINED = re.compile(r" iteration +\d+/ +\d+ \|")
NOISE = ("Transformer Engine and Apex are not installed", "Apex is not installed", "absl.logging")


def launch(argv, fault=None, timeout=240, nproc=2):
    """``torchrun tests/helpers/fault_injection.py argv`` with ``OASES_FAULT=fault``, in its own
    session: whatever of the job is left when torchrun exits (or at ``timeout``: a hang fails the
    test) is killed. Returns ``returncode``, ``stdout``, ``stderr``, ``elapsed``."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env.pop("OASES_FAULT", None)
    if fault:
        env["OASES_FAULT"] = fault
    start = time.time()
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        proc = subprocess.Popen(
            torchrun_command(list(argv), nproc, program=FAULT_INJECTION),
            stdout=out,
            stderr=err,
            text=True,
            env=env,
            start_new_session=True,
        )
        try:
            returncode = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            returncode = None
        finally:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            proc.wait()
        out.seek(0)
        err.seek(0)
        result = types.SimpleNamespace(
            returncode=returncode,
            stdout=out.read(),
            stderr=err.read(),
            elapsed=time.time() - start,
        )
    if returncode is None:
        pytest.fail(f"the job hung: no exit within {timeout} s\n{result.stderr[-3000:]}")
    return result


def errors(proc):
    return [ln for ln in proc.stderr.splitlines() if ": error: " in ln]


def losses(path):
    with open(path) as f:
        return json.load(f)["lm loss"]["values"]


def tracker(ckpt):
    with open(os.path.join(ckpt, "latest_checkpointed_iteration.txt")) as f:
        return f.read().strip()


# ------------------------------------------------------------------------- ranks that die or hang


@pytest.mark.timeout(200)
def test_killed_rank_ends_the_job():
    proc = launch(TINY + ["--num-workers", "0"], fault="kill:rank=1:iter=3", timeout=180)
    assert proc.returncode != 0, proc.stdout[-2000:]
    assert (
        "iteration        2/       4 |" in proc.stdout and "iteration        3/" not in proc.stdout
    )
    assert "exitcode  : -9" in proc.stderr, proc.stderr[-3000:]  # the launcher names the kill
    assert not any(n in proc.stderr for n in NOISE), proc.stderr[-3000:]
    print(f"killed rank: job ended after {proc.elapsed:.0f} s")


@pytest.mark.timeout(300)
def test_stopped_rank_ends_the_job_within_the_distributed_timeout():
    """A hung (SIGSTOPped) rank: the other times out after 5 s, says so once, and exits; torchrun
    then kills the stopped one (it waits 30 s for a SIGTERM that a stopped process cannot act
    on)."""
    argv = TINY + ["--num-workers", "0", "--distributed-timeout-seconds-after-init", "5"]
    proc = launch(argv, fault="stop:rank=1:iter=3", timeout=280)
    assert proc.returncode != 0, proc.stdout[-2000:]
    assert [e.split(" (")[0] for e in errors(proc)] == [
        "oases train: error: lost contact with another rank of this job, which stopped or died"
    ], proc.stderr[-3000:]
    assert "Timed out" in errors(proc)[0]
    assert proc.elapsed < 150, proc.elapsed
    print(f"stopped rank: job ended after {proc.elapsed:.0f} s")


@pytest.mark.timeout(200)
def test_sigterm_to_the_job_saves_with_the_exit_signal_handler(tmp_path):
    """SIGTERM to every process of the job (SLURM's time limit): ``--exit-signal-handler`` saves
    and exits. The signal had also stopped the manager process behind Megatron's writer queue
    (started by the save of iteration 2), and the save failed on a broken pipe, blamed on "free
    space, permissions"."""
    ckpt = str(tmp_path / "ckpt")
    argv = TINY + ["--num-workers", "0", "--exit-signal-handler", "--save", ckpt]
    proc = launch(argv + ["--save-interval", "2"], fault="term:rank=1:iter=3", timeout=180)
    assert errors(proc) == [], proc.stderr[-3000:]
    assert "exiting program after receiving SIGTERM" in proc.stdout, proc.stdout[-2000:]
    assert tracker(ckpt) == "3" and "iteration        4/" not in proc.stdout
    assert not re.search(r"\[rank\d\]: Traceback", proc.stderr)  # torchrun prints its own


# ------------------------------------------------------------------ saves that fail half-way


@pytest.fixture(scope="module")
def full_disk_then_resume(tmp_path_factory):
    """Iterations 1-4 saving at 2 and 4, the save of 4 failing on rank 1 as on a full disk; then
    the same command resumed from the checkpoint of iteration 2."""
    root = tmp_path_factory.mktemp("faults")
    ckpt = str(root / "ckpt")
    save = ["--save", ckpt, "--save-interval", "2"]
    first = launch(
        TINY + save + ["--log-json", str(root / "first.json")], fault="enospc:rank=1:iter=4"
    )
    dirs = sorted(n for n in os.listdir(ckpt) if n != ".oases-lock")  # the run's lock file
    after_failure = {"tracker": tracker(ckpt), "dirs": dirs}
    # a leftover of an older layout where the resumed run will save iteration 4
    os.makedirs(os.path.join(ckpt, "iter_0000004"))
    with open(os.path.join(ckpt, "iter_0000004", "__9_0.distcp"), "w") as f:
        f.write("stale shard of another layout")
    resumed = launch(TINY + save + ["--load", ckpt, "--log-json", str(root / "resumed.json")])
    return dict(
        root=root,
        ckpt=ckpt,
        first=first,
        after_failure=after_failure,
        first_losses=losses(root / "first.json"),
        resumed=resumed,
        resumed_losses=losses(root / "resumed.json"),
    )


@pytest.mark.timeout(400)
def test_full_disk_during_save_is_one_line_and_keeps_the_previous_checkpoint(
    full_disk_then_resume,
):
    r = full_disk_then_resume
    assert r["first"].returncode == 1, r["first"].stderr[-3000:]
    (line,) = errors(r["first"])
    assert line.startswith(f"oases train: error: saving iter_0000004 to {r['ckpt']} failed (")
    assert "OSError" in line and "the previous checkpoint (iteration 2) is intact" in line
    assert r["after_failure"] == {
        "tracker": "2",
        "dirs": ["iter_0000002", "latest_checkpointed_iteration.txt"],
    }  # the partial iter_0000004 is removed
    assert len(r["first_losses"]) == 4


@pytest.mark.timeout(400)
def test_resume_after_a_failed_save_is_bit_exact(full_disk_then_resume):
    r = full_disk_then_resume
    assert r["resumed"].returncode == 0, r["resumed"].stderr[-3000:]
    # iterations 3 and 4 again, from the checkpoint of iteration 2: the same losses, dropout on
    assert r["resumed_losses"] == r["first_losses"][2:], (r["resumed_losses"], r["first_losses"])
    assert tracker(r["ckpt"]) == "4"
    # saved into a fresh directory and swapped in: nothing of the old one is merged into it
    assert "__9_0.distcp" not in os.listdir(os.path.join(r["ckpt"], "iter_0000004"))


def _load_checks_worker(ckpt, broken):
    """In one 2-rank job: the (re-saved) checkpoint loads; damaged copies, another padding of the
    vocabulary, another learning-rate schedule are one line each."""
    from megatron_oases.errors import OasesConfigError

    out = {
        "loaded": pretrain_and_capture(
            f"--tensor-model-parallel-size 2 --vocab-size 520 "
            f"--train-iters 4 --load {ckpt} --num-workers 0"
        )
    }
    cases = {name: f"--tensor-model-parallel-size 2 --load {path}" for name, path in broken.items()}
    cases["vocab-at-tp1"] = f"--tensor-model-parallel-size 1 --load {ckpt}"
    cases["layers"] = f"--tensor-model-parallel-size 2 --num-layers 4 --load {ckpt}"
    cases["heads"] = f"--tensor-model-parallel-size 2 --num-attention-heads 8 --load {ckpt}"
    cases["norm"] = f"--tensor-model-parallel-size 2 --normalization RMSNorm --load {ckpt}"
    cases["schedule"] = f"--tensor-model-parallel-size 2 --train-iters 6 --load {ckpt}"
    for name, flags in cases.items():
        argv = f"--vocab-size 520 --train-iters 4 --num-workers 0 {flags}"
        if name == "schedule":
            argv = argv.replace("--train-iters 4 ", "")
        try:
            pretrain_and_capture(argv)
            out[name] = None
        except OasesConfigError as exc:
            out[name] = str(exc)
    return out


@pytest.mark.timeout(500)
def test_killed_resave_keeps_the_checkpoint_loadable_and_damage_is_one_line(
    full_disk_then_resume,
):
    """Resumed at iteration 4 with --save-interval 3, the run ends at once and saves iteration 4
    again (4 % 3 != 0): rank 1 is killed while writing. Megatron alone would overwrite the only
    checkpoint of iteration 4 in place; here it is written aside and the old one survives."""
    from megatron_oases.training.checkpoint_check import check_tracker

    r = full_disk_then_resume
    ckpt = r["ckpt"]
    proc = launch(
        TINY + ["--load", ckpt, "--save", ckpt, "--save-interval", "3"],
        fault="kill-save:rank=1:iter=4",
    )
    assert proc.returncode != 0 and "exitcode  : -9" in proc.stderr, proc.stderr[-3000:]
    assert "saving checkpoint at iteration       4" in proc.stdout, proc.stdout[-3000:]
    assert tracker(ckpt) == "4" and check_tracker(ckpt) == 4  # complete, not torn
    # damaged copies of it
    broken = {}
    for name in (
        "empty-tracker",
        "truncated-shard",
        "missing-shard",
        "missing-metadata",
        "missing-dot-metadata",
    ):
        path = str(r["root"] / name)
        shutil.copytree(ckpt, path, ignore=shutil.ignore_patterns("*.saving"))
        it = os.path.join(path, "iter_0000004")
        if name == "empty-tracker":
            open(os.path.join(path, "latest_checkpointed_iteration.txt"), "w").close()
        elif name == "truncated-shard":
            shard = os.path.join(it, "__1_0.distcp")
            os.truncate(shard, os.path.getsize(shard) // 2)
        elif name == "missing-shard":
            os.unlink(os.path.join(it, "__0_0.distcp"))
        elif name == "missing-dot-metadata":
            os.unlink(os.path.join(it, ".metadata"))
        else:
            os.unlink(os.path.join(it, "metadata.json"))
        broken[name] = path
    res = run_distributed(_load_checks_worker, 2, ckpt, broken, timeout=400)[0]
    assert res.pop("loaded")["exit_code"] in (0, None)  # loaded at iteration 4, nothing to train
    expected = {
        "empty-tracker": "latest_checkpointed_iteration.txt is empty, an interrupted save?; "
        "write 4 (a complete checkpoint there)",
        "truncated-shard": "the checkpoint of iteration 4 is incomplete or damaged: "
        "__1_0.distcp is truncated",
        "missing-shard": "__0_0.distcp is missing; write 2 (a complete checkpoint there)",
        "missing-metadata": "metadata.json is missing (the save did not finish); write 2",
        "missing-dot-metadata": "the checkpoint of iteration 4 is incomplete or damaged: "
        ".metadata is missing (torch_dist's index of the shards); write 2",
        "vocab-at-tp1": "the padded vocabulary is 768 in the checkpoint (--vocab-size 520 padded "
        "to a multiple of --make-vocab-size-divisible-by 128 x --tensor-model-parallel-size 2), "
        "640 here; use --make-vocab-size-divisible-by 256",
        "layers": "holds a checkpoint of another model: num_layers value from checkpoint (2) is "
        "not equal to the input argument value (4)",
        "heads": "num_attention_heads value from checkpoint (4) is not equal to the input "
        "argument value (8)",
        "norm": "--normalization is 'LayerNorm' in the checkpoint, 'RMSNorm' here",
        "schedule": "the checkpoint's learning-rate schedule differs: the decay in samples "
        "(--lr-decay-iters, default --train-iters) is 8 there, 12 here; add "
        "--override-opt-param-scheduler",
    }
    for name, text in expected.items():
        assert res[name] and text in res[name] and "\n" not in res[name], (name, res[name])


@pytest.mark.timeout(200)
@pytest.mark.parametrize("damage", ["truncated", "garbage"])
def test_damaged_checkpoint_is_one_line_per_job(full_disk_then_resume, tmp_path, damage):
    """A truncated shard is found up front (exit status 2 on every rank); a shard of the right
    size with other bytes only by the rank that reads it in Megatron's load: that rank says so."""
    ckpt = str(tmp_path / "ckpt")
    shutil.copytree(full_disk_then_resume["ckpt"], ckpt, ignore=shutil.ignore_patterns("*.saving"))
    it = tracker(ckpt)
    shard = os.path.join(ckpt, f"iter_{int(it):07d}", "__1_0.distcp")
    if damage == "truncated":
        os.truncate(shard, 100)
    else:
        with open(shard, "r+b") as f:
            f.write(os.urandom(os.path.getsize(shard)))
    proc = launch(TINY + ["--load", ckpt], timeout=180)
    assert proc.returncode != 0, proc.stderr[-3000:]
    (line,) = errors(proc)
    if damage == "truncated":
        assert "exitcode  : 2 " in proc.stderr, proc.stderr[-3000:]
        assert (
            f"the checkpoint of iteration {it} is incomplete or damaged: __1_0.distcp is " in line
        )
        assert "truncated (100 of" in line, line
    else:
        assert f"--load {ckpt}: the checkpoint is damaged (" in line, line
    assert "write 2 (a complete checkpoint there)" in line, line
    assert not TRAINED.search(proc.stdout)  # refused before any training


# --------------------------------------------------------------------------- stops and bad input


@pytest.mark.timeout(200)
def test_nan_on_the_last_pipeline_stage_is_reported_once():
    """PP=2: the loss (and its NaN) exists on rank 1 only; rank 0 must not hide it."""
    proc = launch(
        [
            "train",
            "--pipeline-model-parallel-size",
            "2",
            "--lr",
            "1e6",
            "--train-iters",
            "8",
            "--num-workers",
            "0",
        ],
        timeout=180,
    )
    assert proc.returncode == 1, proc.stderr[-3000:]
    (line,) = errors(proc)
    assert "found NaN in local forward loss calculation" in line and "lower --lr" in line, line


def _cli(*argv):
    code = "import sys; from megatron_oases.cli import main; sys.exit(main(sys.argv[1:]))"
    return subprocess.run(
        [sys.executable, "-c", code, *argv], capture_output=True, text=True, timeout=120
    )


@pytest.mark.timeout(150)
def test_unwritable_save_is_one_line_before_training(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    proc = _cli("train", "--train-iters", "2", "--save", str(blocker / "ckpt"))
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert errors(proc) == [
        f"oases train: error: --save {blocker / 'ckpt'} is not writable (Not a directory); "
        "choose a directory you can write to (checked before training, so no work is lost)"
    ], proc.stderr[-3000:]
    assert not TRAINED.search(proc.stdout)


@pytest.mark.timeout(150)
def test_unwritable_trace_path_is_one_line_before_training(tmp_path):
    """Before: the run trained to the end, then every rank exited 1 and the trace was lost."""
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    proc = _cli("train", "--train-iters", "2", "--oases-trace", str(blocker / "trace.json"))
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert errors(proc) == [
        f"oases train: error: --oases-trace {blocker}/trace.rank0.json: {blocker} is a file, not "
        "a directory; choose another path"
    ], proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr and not TRAINED.search(proc.stdout)


@pytest.mark.timeout(400)
def test_torch_format_checkpoint_resumes(tmp_path):
    """``--ckpt-format torch`` (no metadata.json, one ``torch.save`` file per model-parallel
    rank) was called "incomplete or damaged ... start without --load"; it resumes now, and
    repeats the uninterrupted run's iterations 3 and 4 bit for bit (the second after the load
    depends on the loaded optimizer state too)."""
    ckpt = str(tmp_path / "ckpt")
    argv = "train --ckpt-format torch --num-workers 0 --train-iters 4".split()
    full = launch(argv + ["--log-json", str(tmp_path / "full.json")], nproc=1)
    assert full.returncode == 0, full.stderr[-3000:]
    argv += ["--save", ckpt]
    first = launch(argv + ["--exit-interval", "2"], nproc=1)
    assert first.returncode == 0, first.stderr[-3000:]
    assert os.listdir(os.path.join(ckpt, "iter_0000002")) == ["mp_rank_00"]
    resumed = launch(argv + ["--load", ckpt, "--log-json", str(tmp_path / "b.json")], nproc=1)
    assert resumed.returncode == 0 and not errors(resumed), resumed.stderr[-3000:]
    with open(tmp_path / "b.json") as f:
        assert json.load(f)["lm loss"]["start_step"] == 3  # iterations 3 and 4, from the checkpoint
    again, uninterrupted = losses(tmp_path / "b.json"), losses(tmp_path / "full.json")
    assert len(uninterrupted) == 4 and again == uninterrupted[2:], (again, uninterrupted)


def _children(pid):
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            return [int(p) for p in f.read().split()]
    except OSError:
        return []


def _alive(pid):
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ", 1)[1][0] != "Z"
    except OSError:
        return False


@pytest.mark.timeout(200)
def test_killed_launcher_leaves_no_orphan_ranks(tmp_path):
    """``kill -9`` of torchrun itself: its ranks trained on as orphans; each rank now asks the
    kernel for SIGKILL when its launcher dies (``launch.die_with_launcher``)."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    argv = ["train", "--train-iters", "100000", "--num-workers", "0"]
    log = tmp_path / "out.txt"
    with open(log, "w") as out:
        proc = subprocess.Popen(
            torchrun_command(argv, 2), stdout=out, stderr=subprocess.STDOUT, env=env,
            start_new_session=True,
        )  # fmt: skip
    ranks = []
    try:
        deadline = time.time() + 150
        while not TRAINED.search(log.read_text()):
            assert proc.poll() is None and time.time() < deadline, log.read_text()[-3000:]
            time.sleep(1)
        ranks = _children(proc.pid)
        assert len(ranks) == 2, ranks
        os.kill(proc.pid, signal.SIGKILL)  # the launcher only, as `kill -9 <torchrun pid>`
        proc.wait()
        deadline = time.time() + 10
        while any(map(_alive, ranks)) and time.time() < deadline:
            time.sleep(0.2)
        assert not any(map(_alive, ranks)), "ranks still running after their launcher died"
    finally:
        for pid in [proc.pid] + ranks:  # the ranks have sessions of their own
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        proc.wait()
