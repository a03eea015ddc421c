import os
import shutil
import tempfile

import pytest

os.environ.setdefault("OMP_NUM_THREADS", "1")
#: Megatron's fused functions (its ``jit_fuser``: ``torch.compile``) run eagerly in the tests
#: unless a test asks for them compiled (the ``torch_compile`` fixture): inductor compiling them
#: on the CPU, per rank and per shape, was more than half of an in-process run's time. Parity is
#: unaffected (stock and the schedules call the same functions); docs/testing.md lists the tests
#: that keep them compiled. ``run_distributed``'s ranks follow the value of the moment.
os.environ.setdefault("TORCH_COMPILE_DISABLE", "1")
#: Megatron's mock-data indices, shared by the session's runs (``helpers.runs.with_data_cache``).
#: Under pytest-xdist each worker has its own (inside the controller's): two workers building
#: the same index files at once would read each other's half-written ones.
_DATA_CACHE = None
if "OASES_TEST_DATA_CACHE" not in os.environ:
    _DATA_CACHE = tempfile.mkdtemp(prefix="oases-test-data-cache-")
    os.environ["OASES_TEST_DATA_CACHE"] = _DATA_CACHE
if os.environ.get("PYTEST_XDIST_WORKER"):
    _worker_cache = os.path.join(
        os.environ["OASES_TEST_DATA_CACHE"], os.environ["PYTEST_XDIST_WORKER"]
    )
    os.makedirs(_worker_cache, exist_ok=True)
    os.environ["OASES_TEST_DATA_CACHE"] = _worker_cache


#: Files run first, in this order, and last: the suite runs two files at a time (``-n 2 --dist
#: loadfile``). First the longest (docs/testing.md's table), so that the short ones even out the
#: two workers' ends; the two files that start a SLURM cluster take turns
#: (``helpers.slurm.LOCK``), apart in the order so that neither waits for the other.
FIRST = (
    "test_two_hosts_e2e.py",
    "test_schedule_parity.py",
    "test_sequence_parallel.py",
    "test_faults_e2e.py",
    "test_gpu_check.py",
    "test_schedule_behaviour.py",
)
LAST = ("test_slurm.py",)


def pytest_collection_modifyitems(config, items):
    def rank(item):
        name = item.path.name
        return FIRST.index(name) if name in FIRST else len(FIRST) + (name in LAST)

    items.sort(key=rank)  # stable: the order within each file and among the others is kept


def pytest_sessionfinish(session, exitstatus):
    if _DATA_CACHE:
        shutil.rmtree(_DATA_CACHE, ignore_errors=True)


@pytest.fixture
def torch_compile(monkeypatch):
    """Megatron's fused functions compiled, as on a user's machine (the suite runs them eagerly)."""
    monkeypatch.setenv("TORCH_COMPILE_DISABLE", "0")


@pytest.fixture
def tmp_out(tmp_path):
    return str(tmp_path)


@pytest.fixture
def model_parallel_1():
    """One gloo rank in this process: TP=1 model-parallel state and Megatron's RNG tracker
    (seeded), with the CPU shims where there is no CUDA; all torn down after."""
    import torch.distributed as dist
    from megatron.core import parallel_state, tensor_parallel

    from megatron_oases import platform
    from megatron_oases.launch import find_free_port

    installed = platform.install_cpu_shims()
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{find_free_port()}", rank=0, world_size=1
    )
    try:
        parallel_state.initialize_model_parallel(1, 1)
        tensor_parallel.model_parallel_cuda_manual_seed(1234)
        yield
    finally:
        parallel_state.destroy_model_parallel()
        dist.destroy_process_group()
        if installed:
            platform.uninstall_cpu_shims()
