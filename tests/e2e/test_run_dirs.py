"""A run's directories checked before training, one line each (``oases run`` under torchrun): a
``--save`` directory belongs to one run, a ``--load`` that is not there is a typo not a fresh
start, and data paths are checked before the model is built."""

import os

import pytest

from megatron_oases.launch import run_torchrun
from megatron_oases.training.save_owner import lock_save_dir

RUN = (
    "run --num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 32 "
    "--max-position-embeddings 32 --micro-batch-size 2 --global-batch-size 4 --train-iters 1 "
    "--lr 1e-3 "
).split()
MOCK = ["--mock-data"]


def _refused(argv, nproc=1, timeout=120):
    """The job's stderr error lines (it must fail with exit status 2, without a traceback)."""
    proc = run_torchrun(RUN + argv, nproc=nproc, timeout=timeout)
    assert proc.returncode != 0, proc.stdout[-2000:]
    # torchrun reports a failed job with its own traceback; a rank's would name other files
    frames = [ln for ln in proc.stderr.splitlines() if ln.strip().startswith('File "')]
    ours = [ln for ln in frames if "/torch/distributed/" not in ln and "<frozen" not in ln]
    assert not ours, proc.stderr[-3000:]
    return [ln for ln in proc.stderr.splitlines() if ": error:" in ln]


@pytest.mark.timeout(150)
def test_a_second_live_run_into_the_same_save_directory_is_refused(tmp_path):
    save = tmp_path / "ckpt"
    save.mkdir()
    held = lock_save_dir(str(save))  # the first run, alive
    try:
        errors = _refused(MOCK + ["--save", str(save), "--load", str(save)], nproc=2)
    finally:
        held.close()
    assert len(errors) == 1, errors  # once per job
    assert f"--save {save} is in use by another run (pid {os.getpid()}" in errors[0], errors
    assert sorted(os.listdir(save)) == [".oases-lock"]  # nothing written


@pytest.mark.timeout(150)
def test_a_new_run_over_another_runs_checkpoints_is_refused(tmp_path):
    save = tmp_path / "ckpt"
    (save / "iter_0000005").mkdir(parents=True)
    (save / "latest_checkpointed_iteration.txt").write_text("5")
    (errors,) = [_refused(MOCK + ["--save", str(save)])]
    assert errors == [
        f"oases run: error: --save {save} holds checkpoints up to iteration 5 of another run; "
        f"resume from them with --load {save}, choose another --save directory, or add "
        "--oases-start-over to replace them"
    ]
    assert (save / "iter_0000005").is_dir()


def test_start_over_and_resume_may_write_into_a_used_save_directory(tmp_path):
    import argparse

    from megatron_oases.errors import OasesConfigError
    from megatron_oases.training.save_owner import check_not_overwriting

    save = tmp_path / "ckpt"
    save.mkdir()
    (save / "latest_checkpointed_iteration.txt").write_text("5")
    args = dict(save=str(save), load=None)
    with pytest.raises(OasesConfigError, match="holds checkpoints up to iteration 5"):
        check_not_overwriting(argparse.Namespace(**args), start_over=False)
    with pytest.raises(OasesConfigError):  # fine-tuning from elsewhere into it: refused too
        check_not_overwriting(argparse.Namespace(**dict(args, load=str(tmp_path))), False)
    check_not_overwriting(argparse.Namespace(**dict(args, load=str(save) + "/")), False)  # resume
    check_not_overwriting(argparse.Namespace(**args), start_over=True)


def test_the_save_lock_is_held_by_one_open_file_at_a_time(tmp_path):
    from megatron_oases.errors import OasesConfigError

    first = lock_save_dir(str(tmp_path))
    with pytest.raises(OasesConfigError, match=f"pid {os.getpid()}"):
        lock_save_dir(str(tmp_path))
    first.close()  # the run ended (or died): the kernel released the lock
    lock_save_dir(str(tmp_path)).close()


@pytest.mark.timeout(150)
def test_load_of_a_missing_directory_is_refused(tmp_path):
    missing = tmp_path / "typo"
    errors = _refused(MOCK + ["--load", str(missing)])
    assert errors == [
        f"oases run: error: --load {missing} does not exist; check the path, or drop --load to "
        "start from scratch"
    ]


@pytest.mark.timeout(200)
def test_the_restart_idiom_says_it_starts_from_scratch(tmp_path):
    save = tmp_path / "ckpt"  # absent: --save creates it
    proc = run_torchrun(RUN + MOCK + ["--save", str(save), "--load", str(save)], 1, timeout=180)
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = f"oases: --load {save} holds no checkpoint yet: training starts from scratch"
    assert proc.stderr.count(line) == 1, proc.stderr[-3000:]
    assert (save / "latest_checkpointed_iteration.txt").read_text().strip() == "1"


@pytest.mark.timeout(200)
@pytest.mark.parametrize("case", ["missing", "empty"])
def test_a_bad_data_path_is_one_line_before_the_model_is_built(tmp_path, case):
    prefix = tmp_path / "corpus_text_document"
    if case == "empty":
        (tmp_path / "corpus_text_document.idx").write_bytes(b"")
        (tmp_path / "corpus_text_document.bin").write_bytes(b"")
    data = ["--data-path", str(prefix), "--tokenizer-type", "NullTokenizer", "--vocab-size", "512"]
    errors = _refused(data, nproc=2)
    what = "does not exist" if case == "missing" else "is empty"
    assert len(errors) == 1 and f"{prefix}.idx {what}" in errors[0], errors


def test_plan_settings_that_differ_from_the_flags_are_named():
    import argparse

    from megatron_oases.planner.settings import PlanSettings
    from megatron_oases.validation import plan_differences

    def differences(plan, args, schedule):  # the plan's run as the runtime reads it
        return plan_differences(PlanSettings.from_plan(plan), args, schedule)

    args = argparse.Namespace(
        micro_batch_size=2,
        global_batch_size=8,
        recompute_granularity="full",
        recompute_method="uniform",
        recompute_num_layers=1,
    )
    plan = {"schedule": "oases", "micro_batch_size": 4, "global_batch_size": 8}
    plan.update(recompute="full", recompute_num_layers=None)
    assert differences(plan, args, "overlap") == [
        ("--oases-schedule", "oases", "overlap"),
        ("--micro-batch-size", 4, 2),
    ]
    assert (
        differences({"degrees": [2, 2]}, args, "overlap") == []
    )  # a hand-written plan: nothing said
    assert differences({"recompute": True}, args, "overlap") == []  # older plans: True is full
    selective = argparse.Namespace(**dict(vars(args), recompute_granularity="selective"))
    selective.recompute_modules = ["core_attn"]
    assert differences({"recompute": "full"}, selective, "overlap") == [
        ("--recompute-granularity", "full", "selective")
    ]


@pytest.mark.timeout(200)
@pytest.mark.parametrize("rank", [0, 1])
def test_a_full_disk_is_one_line_from_the_whole_job(tmp_path, rank):
    """The save of iteration 1 fails as on a full disk on one rank: torch tells rank 0 (the
    coordinator) which write failed and the other ranks only that one did. One line for the job,
    no rank's traceback, none of Megatron's writer ERROR lines (the line says it)."""
    import subprocess

    from helpers.paths import FAULT_INJECTION

    from megatron_oases.launch import torchrun_command

    save = tmp_path / "ckpt"
    argv = RUN + MOCK + ["--tensor-model-parallel-size", "2", "--save", str(save)]
    argv += ["--save-interval", "1", "--train-iters", "2"]
    env = dict(os.environ, OMP_NUM_THREADS="1", OASES_FAULT=f"enospc:rank={rank}:iter=1")
    proc = subprocess.run(
        torchrun_command(argv, 2, program=FAULT_INJECTION),
        capture_output=True,
        text=True,
        timeout=180,
        env=env,
    )
    assert proc.returncode == 1, proc.stderr[-3000:]
    errors = [ln for ln in proc.stderr.splitlines() if ": error:" in ln]
    assert len(errors) == 1, proc.stderr[-3000:]
    assert f"saving iter_0000001 to {save} failed (" in errors[0], errors
    # rank 0 has its own writer's OSError; of another rank's it learns only the class
    assert ("OSError: [Errno 28] No space left" if rank == 0 else "OSError") in errors[0], errors
    assert "[rank" not in proc.stderr, proc.stderr[-3000:]  # torchrun's prefix of a rank's lines
    assert "ERROR:megatron" not in proc.stdout + proc.stderr
    assert not (save / "iter_0000001").exists()


def test_a_file_system_without_locks_warns_and_goes_on(tmp_path, capsys):
    """Checkpoints often live on a shared file system; one without ``flock`` (some Lustre or NFS
    mounts) must not stop a run: a warning says what is not detected there."""
    import errno
    import fcntl
    from unittest import mock

    no_locks = OSError(errno.ENOLCK, "No locks available")
    with mock.patch.object(fcntl, "flock", side_effect=no_locks):
        assert lock_save_dir(str(tmp_path)) is None
    (line,) = capsys.readouterr().err.splitlines()
    assert (
        line.startswith(f"oases: warning: --save {tmp_path} cannot be locked")
        and "No locks" in line
    )
