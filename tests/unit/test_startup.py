"""A training process's start: Python's cyclic collector paused while torch and Megatron import,
what they imported frozen out of later collections (``training.pretrain.collector_paused``)."""

import gc

import pytest

from megatron_oases.training.pretrain import collector_paused


@pytest.fixture
def collector():
    """This process's collector as it was, restored after (freeze state included)."""
    enabled = gc.isenabled()
    yield
    gc.unfreeze()
    (gc.enable if enabled else gc.disable)()


def test_imports_run_without_the_collector_and_stay_out_of_it_after(collector):
    gc.enable()
    before = gc.get_freeze_count()
    with collector_paused():
        assert not gc.isenabled()
        imported = [[] for _ in range(1000)]  # what an import leaves behind
    assert gc.isenabled()
    assert gc.get_freeze_count() >= before + len(imported)


def test_a_failed_import_still_gives_the_collector_back(collector):
    gc.enable()
    with pytest.raises(ImportError):
        with collector_paused():
            raise ImportError("an unsupported Megatron")
    assert gc.isenabled()


def test_a_collector_turned_off_before_stays_off(collector):
    gc.disable()
    with collector_paused():
        pass
    assert not gc.isenabled()
