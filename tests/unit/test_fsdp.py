"""Megatron's sharded data parallelism, checked before anything starts: which wrapper runs where,
``CUDA_DEVICE_MAX_CONNECTIONS`` by Megatron's own rule, and the CPU shim FSDP2 needs. (FSDP2
against DDP, and the emulated link under it: ``tests/e2e/test_fsdp_e2e.py``.)"""

import pytest
from helpers.runs import parse, parse_config

from megatron_oases.arguments import default_max_connections
from megatron_oases.errors import OasesConfigError

FSDP2 = "--use-torch-fsdp2 --untie-embeddings-and-output-weights "


@pytest.fixture
def no_max_connections(monkeypatch):
    monkeypatch.delenv("CUDA_DEVICE_MAX_CONNECTIONS", raising=False)
    monkeypatch.delenv("OASES_DEFAULT_MAX_CONNECTIONS", raising=False)


def test_max_connections_is_one_unless_fsdp(no_max_connections, monkeypatch):
    import os

    default_max_connections(["--tensor-model-parallel-size", "2"])
    assert os.environ["CUDA_DEVICE_MAX_CONNECTIONS"] == "1"
    # the next job of the same process (compare's passes, the tests) gets its own flags' value
    default_max_connections(["--use-torch-fsdp2"])
    assert "CUDA_DEVICE_MAX_CONNECTIONS" not in os.environ
    default_max_connections(["--use-megatron-fsdp=true"])
    assert "CUDA_DEVICE_MAX_CONNECTIONS" not in os.environ
    default_max_connections([])
    assert os.environ["CUDA_DEVICE_MAX_CONNECTIONS"] == "1"
    # a value the user set is theirs, FSDP or not
    monkeypatch.setenv("CUDA_DEVICE_MAX_CONNECTIONS", "8")
    monkeypatch.delenv("OASES_DEFAULT_MAX_CONNECTIONS")
    default_max_connections([])
    assert os.environ["CUDA_DEVICE_MAX_CONNECTIONS"] == "8"


def test_torch_fsdp2_parses_with_tp(no_max_connections):
    """Megatron's FSDP checks pass (they refuse CUDA_DEVICE_MAX_CONNECTIONS=1) with TP as well."""
    args = parse(FSDP2 + "--tensor-model-parallel-size 2", world_size=4)
    assert args.use_torch_fsdp2 and args.tensor_model_parallel_size == 2


@pytest.mark.parametrize(
    "argv,match",
    [
        (
            "--use-megatron-fsdp --data-parallel-sharding-strategy optim_grads_params",
            "--use-megatron-fsdp needs CUDA (Megatron-FSDP's buffers, streams and events are "
            "CUDA's); without a GPU use --use-torch-fsdp2",
        ),
        (
            FSDP2 + "--oases-schedule overlap --tensor-model-parallel-size 2",
            "--oases-schedule overlap does not run under --use-torch-fsdp2 yet",
        ),
        ("--use-torch-fsdp2", "--use-torch-fsdp2 requires --untie-embeddings-and-output-weights"),
        (
            FSDP2 + "--pipeline-model-parallel-size 2 --num-layers 2",
            "Megatron rejects the arguments",
        ),
    ],
)
def test_bad_fsdp_combinations_are_one_line(no_max_connections, argv, match):
    with pytest.raises(OasesConfigError) as err:
        parse_config(argv, world_size=4)
    assert match in str(err.value) and "\n" not in str(err.value)


def test_user_max_connections_one_under_fsdp_is_one_line(monkeypatch):
    monkeypatch.setenv("CUDA_DEVICE_MAX_CONNECTIONS", "1")
    monkeypatch.delenv("OASES_DEFAULT_MAX_CONNECTIONS", raising=False)
    with pytest.raises(OasesConfigError, match="CUDA_DEVICE_MAX_CONNECTIONS"):
        parse_config(FSDP2, world_size=2)


def test_cpu_shims_give_fsdp2_a_cpu_mesh():
    """Megatron builds FSDP2's mesh on "cuda"; under the shims the same call gives a CPU mesh."""
    from megatron.core.distributed import torch_fully_sharded_data_parallel as fsdp2

    from megatron_oases import platform

    installed = platform.install_cpu_shims(force=True)
    try:
        assert fsdp2.DeviceMesh.from_group.__qualname__.startswith("_CpuDeviceMesh")
    finally:
        if installed:
            platform.uninstall_cpu_shims()
    assert fsdp2.DeviceMesh.__module__.startswith("torch.distributed")
