"""Megatron's console loss line: each iteration's own at ``--log-interval 1`` (Megatron 0.19 adds
the first iteration into the second line's mean; :mod:`megatron_oases.training.console_log`)."""

import json
import re

import pytest

from megatron_oases.launch import run_torchrun

LOSS = re.compile(r"iteration +(\d+)/ +\d+ \|.* lm loss: ([0-9.E+-]+) \|")


@pytest.mark.timeout(200)
@pytest.mark.parametrize("interval", [1, 2])
def test_console_loss_is_the_mean_of_its_own_interval(tmp_path, interval):
    golden = tmp_path / "golden.json"
    argv = ["train", "--train-iters", "4", "--log-interval", str(interval)]
    proc = run_torchrun(argv + ["--log-json", str(golden)], nproc=1, timeout=180)
    assert proc.returncode == 0, proc.stderr[-3000:]
    console = {int(i): float(v) for i, v in LOSS.findall(proc.stdout)}
    exact = json.loads(golden.read_text())["lm loss"]["values"]  # iterations 1..4
    assert sorted(console) == sorted({1} | set(range(interval, 5, interval)))
    for it, value in console.items():  # the first line shows iteration 1 alone
        first = 1 if it == 1 else it - interval + 1
        mean = sum(exact[first - 1 : it]) / (it - first + 1)
        assert value == pytest.approx(mean, rel=2e-6), (it, value, mean, exact)
