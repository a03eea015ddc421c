"""One rank stands for the group: the launcher's one-rank command, and what ``--one-rank`` refuses.
The runs (``oases compare`` and ``oases profile`` on the fake process group):
``tests/e2e/test_one_rank_e2e.py``."""

import megatron.training.arguments  # noqa: F401,E402  isort: skip  (start-up warnings here)

from helpers.variants import TINY_TP4

from megatron_oases.cli import main as oases_main
from megatron_oases.launch import one_rank_command


def test_one_rank_command_stands_for_rank_0_of_the_job():
    cmd, env = one_rank_command(["train", "--x"], 8)
    assert cmd[-1] == "--fake-process-group" and "torch.distributed.run" not in cmd
    assert env["RANK"] == "0" and env["WORLD_SIZE"] == "8" and env["LOCAL_WORLD_SIZE"] == "1"


def _one_line_error(capsys, argv, *needles):
    assert oases_main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert "error:" in err and "\n" not in err, err
    for n in needles:
        assert n in err, err


def test_one_rank_refuses_what_it_cannot_stand_for(capsys):
    _one_line_error(
        capsys, ["compare", "--one-rank", "--nproc", "4", "--", *TINY_TP4], "--emulate-link"
    )
    pp2 = ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2"]
    pp2 += ["--num-layers", "2", "--micro-batch-size", "2"]
    argv = ["compare", "--one-rank", "--nproc", "4", "--emulate-link", "rtx3090-pcie", "--", *pp2]
    _one_line_error(capsys, argv, "--pipeline-model-parallel-size 1")
    _one_line_error(
        capsys,
        ["compare", "--emulate-link", "rtx3090-pcie", "--", *TINY_TP4, "--fake-process-group"],
        "--fake-process-group",
    )
    argv = ["profile", "--model", "tiny-cpu", "--one-rank", "--out", "/tmp/never.json"]
    _one_line_error(capsys, argv, "--emulate-link")


def test_one_rank_runs_with_a_ranks_share_of_the_cpus():
    """Issue 42: rank 0 alone gets the threads a rank of the all-ranks job gets (the same D)."""
    from megatron_oases.testbed.emulator import threads_per_rank

    assert threads_per_rank(None, 2, cpus=2) == 1  # both modes: 1 thread per rank process
    assert threads_per_rank(None, 8, cpus=2) == 1
    assert threads_per_rank(None, 2, cpus=16) == 8
    assert threads_per_rank(3, 2, cpus=2) == 3  # --threads-per-rank wins
