"""Megatron's sharded data parallelism, checked before anything starts: which wrapper runs where,
``CUDA_DEVICE_MAX_CONNECTIONS`` by Megatron's own rule, and the CPU shim FSDP2 needs. (FSDP2
against DDP, and the emulated link under it: ``tests/e2e/test_fsdp_e2e.py``.)"""

import pytest
from helpers import RECOMPUTE
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


def test_split_schedule_under_torch_fsdp2_runs_under_emulated_link(no_max_connections):
    """No longer refused: the emulator's async handles are ``torch.distributed.Work`` objects, on
    which FSDP2's all-gather copy-out waits (``tests/e2e/test_fsdp_e2e.py``)."""
    argv = FSDP2 + "--oases-schedule overlap --tensor-model-parallel-size 2 "
    config = parse_config(argv + "--emulate-link rtx3090-pcie", world_size=4)
    assert config.emulate_link.profile == "rtx3090-pcie"


@pytest.mark.parametrize(
    "argv,match",
    [
        (
            FSDP2 + "--oases-plan plan.json --tensor-model-parallel-size 2",
            "--oases-plan does not run under --use-torch-fsdp2",
        ),
        (
            FSDP2 + "--oases-schedule overlap --oases-cuda-graphs eager",
            "--oases-cuda-graphs does not run under --use-torch-fsdp2",
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


@pytest.mark.parametrize("flag", ["--save", "--load"])
def test_torch_fsdp2_checkpoints_are_not_refused(no_max_connections, flag):
    """Issue 61.2: no longer one refusal line; the ``fsdp2-checkpoint`` patch closes megatron-core
    0.19.2's gaps (``tests/unit/test_fsdp2_checkpoint.py``; save and resume bit for bit in
    ``tests/e2e/test_fsdp2_checkpoint_e2e.py``)."""
    config = parse_config(FSDP2 + f"{flag} /tmp/oases-test-never-written", world_size=4)
    assert config.fsdp2_checkpoints


@pytest.mark.parametrize("schedule", ["overlap", "cross-pass", "oases"])
def test_split_schedules_parse_under_torch_fsdp2(no_max_connections, schedule):
    """Issue 51.3: the split schedules run under FSDP2 (``schedule/engine/fsdp.py``; parity in
    ``tests/e2e/test_fsdp_e2e.py``); they were one refusal line before."""
    argv = FSDP2 + RECOMPUTE + f"--oases-schedule {schedule} --tensor-model-parallel-size 2"
    config = parse_config(argv, world_size=4)
    assert config.schedule == schedule


def test_split_schedules_run_under_megatron_fsdp_on_a_gpu_host_too():
    """Issue 61.3: Megatron-FSDP under a split schedule is no longer refused (it was one line);
    the CPU side: ``tests/unit/test_megatron_fsdp.py``."""
    from types import SimpleNamespace

    from megatron_oases.validation import SPLIT_SCHEDULES, check_sharded_data_parallel

    args = SimpleNamespace(use_megatron_fsdp=True, use_torch_fsdp2=False)
    for schedule in ("off",) + SPLIT_SCHEDULES:
        check_sharded_data_parallel(args, schedule, cuda_available=True)


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


def test_cpu_shims_issue_fsdp2_gathers_in_the_gpu_order():
    """Under the shims Megatron's FSDP2 wrapper ends with :func:`gpu_issue_order`: every unshard
    async, each fully_shard-ed module with parameters prefetching the next in forward order (the
    root and a module without parameters, as Megatron's ``RotaryEmbedding``, left out); none under
    full recomputation, whose second forward would prefetch stale shards."""
    import torch
    from megatron.core.distributed import torch_fully_sharded_data_parallel as fsdp2
    from torch.distributed.fsdp import FSDPModule

    from megatron_oases import platform
    from megatron_oases.platform.cpu import gpu_issue_order

    calls = []

    class Recorded(FSDPModule):  # what fully_shard swaps in, its calls recorded
        def _set_unshard_async_op(self, async_op):
            calls.append(("async", self.tag, async_op))

        def set_modules_to_forward_prefetch(self, modules):
            calls.append(("prefetch", self.tag, [m.tag for m in modules]))

    def sharded(module, tag):
        module.__class__ = type(f"FSDP{type(module).__name__}", (Recorded, type(module)), {})
        module.tag = tag
        return module

    def model():
        layers = [sharded(torch.nn.Linear(2, 2), f"layer{i}") for i in range(3)]
        rotary = sharded(torch.nn.Identity(), "rotary")
        root = torch.nn.Sequential(sharded(torch.nn.Embedding(4, 2), "embedding"), rotary, *layers)
        return sharded(root, "root")

    gpu_issue_order(model(), None)
    assert calls == [("async", "root", True)] + [
        ("prefetch", a, [b])
        for a, b in [("embedding", "layer0"), ("layer0", "layer1"), ("layer1", "layer2")]
    ]
    calls.clear()
    gpu_issue_order(model(), "full")
    assert calls == [("async", "root", True)]

    init = fsdp2.TorchFullyShardedDataParallel.__init__
    installed = platform.install_cpu_shims(force=True)
    try:
        wrapped = fsdp2.TorchFullyShardedDataParallel.__init__
        assert wrapped is not init and wrapped.__wrapped__ is init
    finally:
        if installed:
            platform.uninstall_cpu_shims()
    assert fsdp2.TorchFullyShardedDataParallel.__init__ is init


def test_a_torch_dcp_checkpoint_is_complete_with_its_index(tmp_path):
    """A ``torch_dcp`` save (FSDP2's format) writes no ``metadata.json``: its index ``.metadata``,
    written last, marks it complete; under torch_dist the same files are a save cut short."""
    from megatron_oases.errors import OasesConfigError
    from megatron_oases.training.checkpoint_check import check_tracker

    it = tmp_path / "iter_0000002"
    it.mkdir()
    (it / "__0_0.distcp").write_bytes(b"x" * 16)
    (tmp_path / "latest_checkpointed_iteration.txt").write_text("2")
    with pytest.raises(
        OasesConfigError, match=r"\.metadata is missing \(written last by a torch_dcp"
    ):
        check_tracker(str(tmp_path), "torch_dcp")
    (it / ".metadata").write_bytes(b"index")  # not read: only the iteration to load is unpickled
    from megatron_oases.training import checkpoint_check

    assert checkpoint_check._complete(str(it), read_index=False, ckpt_format="torch_dcp") is None
    with pytest.raises(OasesConfigError, match="metadata.json is missing"):
        check_tracker(str(tmp_path), "torch_dist")
