"""``oases-pretrain-hybrid`` under torchrun: a GPT checkpoint resumed as a ``HybridModel`` under
``oases`` continues exactly as the GPT run does (Megatron translates the checkpoint's keys at
load time), and bad hybrid command lines are one line once per job before anything starts."""

import re
import shutil

import pytest
from helpers import NO_DROP, RECOMPUTE, SHAPE
from helpers.console import console_script, torchrun

RUN = (
    SHAPE + NO_DROP + RECOMPUTE + "--tensor-model-parallel-size 2 --micro-batch-size 2 "
    "--global-batch-size 4 --log-interval 1 --train-iters 4 --oases-schedule oases"
).split()


def _torchrun(name, argv, timeout=240):
    return torchrun(console_script(name), argv, timeout=timeout)


def _losses(log):
    return {
        int(it): float(loss)
        for it, loss in re.findall(r" iteration +(\d+)/ *\d+ \|.*? lm loss: ([0-9.E+-]+) \|", log)
    }


@pytest.mark.timeout(600)
def test_gpt_checkpoint_resumes_as_hybrid_under_oases(tmp_path):
    gpt_dir, hybrid_dir = tmp_path / "gpt", tmp_path / "hybrid"
    rc, log = _torchrun(
        "oases-pretrain-gpt",
        ["--num-layers", "2", *RUN, "--save", str(gpt_dir), "--save-interval", "2"]
        + ["--exit-interval", "2"],
    )
    assert rc == 0, log[-3000:]
    shutil.copytree(gpt_dir, hybrid_dir)
    rc, gpt_log = _torchrun(
        "oases-pretrain-gpt", ["--num-layers", "2", *RUN, "--load", str(gpt_dir)]
    )
    assert rc == 0, gpt_log[-3000:]
    rc, hybrid_log = _torchrun(
        "oases-pretrain-hybrid", ["--hybrid-layer-pattern", "*-*-", *RUN, "--load", str(hybrid_dir)]
    )
    assert rc == 0, hybrid_log[-3000:]
    gpt, hybrid = _losses(gpt_log), _losses(hybrid_log)
    assert sorted(gpt) == sorted(hybrid) == [3, 4], (gpt, hybrid)  # resumed after iteration 2
    for it in (3, 4):  # the same weights and optimizer state, the same layers: the same losses
        assert abs(hybrid[it] - gpt[it]) <= 1e-5 * abs(gpt[it]), (it, gpt, hybrid)


@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    "argv,message",
    [
        (["--num-layers", "2"], "add --hybrid-layer-pattern"),
        (["--hybrid-layer-pattern", "*M*-"], "'M' layers need Transformer Engine"),
        (["--hybrid-layer-pattern", "*-*-", "--oases-split", "sequence"], "--oases-split batch"),
    ],
    ids=["no-pattern", "mamba-local", "sequence-split"],
)
def test_bad_hybrid_command_lines_are_one_line(argv, message):
    rc, log = _torchrun("oases-pretrain-hybrid", argv + RUN, timeout=200)
    errors = [line for line in log.splitlines() if line.startswith("oases-pretrain-hybrid: error:")]
    assert rc != 0 and len(errors) == 1, log[-3000:]
    assert message in errors[0], errors[0]
    # no rank's traceback (torchrun reports the failed ranks with its own)
    frames = [line for line in log.splitlines() if line.strip().startswith("File ")]
    assert not any("megatron" in f and "torch/distributed" not in f for f in frames), log[-3000:]
