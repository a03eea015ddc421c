"""``run_distributed`` forks its ranks from a fork server that imported torch and Megatron once:
each rank must still see the caller's environment of the moment, as a spawned rank would."""

import os

from megatron_oases.launch import run_distributed


def _read_environment():
    return {k: os.environ.get(k) for k in ("OASES_TEST_LAUNCH_VALUE", "OASES_TEST_LAUNCH_GONE")}


def test_each_run_sees_the_callers_environment_of_the_moment(monkeypatch):
    monkeypatch.setenv("OASES_TEST_LAUNCH_VALUE", "first")
    monkeypatch.setenv("OASES_TEST_LAUNCH_GONE", "here")
    (first,) = run_distributed(_read_environment, 2, one_rank=True, timeout=120)
    # the fork server started above with these values; later changes must still reach the ranks
    monkeypatch.setenv("OASES_TEST_LAUNCH_VALUE", "second")
    monkeypatch.delenv("OASES_TEST_LAUNCH_GONE")
    (second,) = run_distributed(_read_environment, 2, one_rank=True, timeout=120)
    assert first == {"OASES_TEST_LAUNCH_VALUE": "first", "OASES_TEST_LAUNCH_GONE": "here"}
    assert second == {"OASES_TEST_LAUNCH_VALUE": "second", "OASES_TEST_LAUNCH_GONE": None}


def _compile_disabled():
    import torch._dynamo

    return torch._dynamo.config.disable


def test_each_run_takes_torchs_compile_switch_of_the_moment(monkeypatch):
    """torch reads ``TORCH_COMPILE_DISABLE`` once, at import (in the fork server): a rank must
    still follow the caller's value of the moment, either way."""
    monkeypatch.setenv("TORCH_COMPILE_DISABLE", "1")
    (disabled,) = run_distributed(_compile_disabled, 2, one_rank=True, timeout=120)
    monkeypatch.setenv("TORCH_COMPILE_DISABLE", "0")
    (enabled,) = run_distributed(_compile_disabled, 2, one_rank=True, timeout=120)
    monkeypatch.setenv("TORCH_COMPILE_DISABLE", "1")
    (again,) = run_distributed(_compile_disabled, 2, one_rank=True, timeout=120)
    assert (disabled, enabled, again) == (True, False, True)
