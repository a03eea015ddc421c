"""A rank that lost a peer (it died, or its host dropped off): rank 0 prints the job's one line
before any other rank of its host exits, so its launcher cannot stop rank 0 first (two hosts:
``tests/e2e/test_two_hosts_e2e.py``)."""

import time

import pytest

from megatron_oases import errors

LOST = RuntimeError("[pair.cc:561] Connection closed by peer [10.77.0.2]:27373")


@pytest.mark.parametrize("rank", ["0", "1", "3"])
def test_rank_0_prints_before_the_other_ranks_exit(monkeypatch, capsys, rank):
    clock = []
    monkeypatch.setenv("RANK", rank)
    monkeypatch.setattr(time, "sleep", lambda s: clock.append(s))
    assert errors.exit_status(LOST, "oases-pretrain-gpt") == 1
    err = capsys.readouterr().err
    if rank == "0":
        assert sum(clock) == errors.ERROR_EXIT_GRACE_S
        assert err.startswith("oases-pretrain-gpt: error: lost contact with another rank")
        assert "Connection closed by peer" in err and err.count("\n") == 1
    else:  # exits one grace after rank 0 has printed
        assert sum(clock) == 2 * errors.ERROR_EXIT_GRACE_S and err == ""


def test_other_failures_are_raised_again():
    with pytest.raises(RuntimeError, match="shape mismatch"):
        errors.exit_status(RuntimeError("shape mismatch"), "oases-pretrain-gpt")
