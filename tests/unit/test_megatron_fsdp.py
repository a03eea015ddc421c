"""Issue 61.1: stock Megatron-FSDP (``--use-megatron-fsdp``) on CPU ranks. What cannot run there is
one line before anything starts; the ``megatron-fsdp-cpu`` platform patch checks what it replaces
(parity against DDP: ``tests/e2e/test_megatron_fsdp_e2e.py``)."""

from types import SimpleNamespace

import pytest
from helpers.runs import parse_config

from megatron_oases.arguments import with_defaults
from megatron_oases.errors import OasesConfigError
from megatron_oases.validation import MEGATRON_FSDP_CUDA_ONLY, check_sharded_data_parallel

MFSDP = "--use-megatron-fsdp --ckpt-format fsdp_dtensor "


@pytest.fixture(autouse=True)
def no_max_connections(monkeypatch):
    monkeypatch.delenv("CUDA_DEVICE_MAX_CONNECTIONS", raising=False)
    monkeypatch.delenv("OASES_DEFAULT_MAX_CONNECTIONS", raising=False)


def _cpu_args(**kw):
    """Megatron's args of a CPU run under Megatron-FSDP as ``oases-pretrain-gpt`` makes them."""
    base = dict(
        use_megatron_fsdp=True,
        use_torch_fsdp2=False,
        gradient_accumulation_fusion=False,
        gradient_reduce_div_fusion=False,
    )
    return SimpleNamespace(**{**base, **kw})


def _one_line(fn, *args, **kwargs):
    with pytest.raises(OasesConfigError) as err:
        fn(*args, **kwargs)
    message = str(err.value)
    assert "\n" not in message, message
    return message


def test_megatron_fsdp_parses_on_cpu():
    """Refused on CPU with one line before (it needed CUDA); the CPU default is added."""
    argv = with_defaults((MFSDP + "--data-parallel-sharding-strategy optim").split(), demo=True)
    assert "--no-gradient-reduce-div-fusion" in argv
    config = parse_config(MFSDP + "--data-parallel-sharding-strategy optim", world_size=2)
    assert config.schedule == "off"


def test_the_cpu_default_is_megatron_fsdp_on_cpu_only():
    assert "--no-gradient-reduce-div-fusion" not in with_defaults(["--mock-data"], demo=True)
    gpu = with_defaults(MFSDP.split(), demo=True, cuda=True)
    assert "--no-gradient-reduce-div-fusion" not in gpu


@pytest.mark.parametrize("flag, attribute, unused, why", MEGATRON_FSDP_CUDA_ONLY)
def test_each_option_that_cannot_run_on_cpu_is_one_line(flag, attribute, unused, why):
    value = 2 if attribute == "num_distributed_optimizer_instances" else True
    value = {"cuda_graph_impl": "local", "fp8": "hybrid"}.get(attribute, value)
    args = _cpu_args(**{attribute: value})
    message = _one_line(check_sharded_data_parallel, args, "off", cuda_available=False)
    assert flag in message and "drop it" in message and "CPU ranks" in message
    check_sharded_data_parallel(args, "off", cuda_available=True)  # a GPU's to honour


@pytest.mark.parametrize(
    "argv, match",
    [
        ("--use-nccl-ub", "--use-nccl-ub registers NCCL user buffers"),
        ("--cuda-graph-impl local", "--cuda-graph-impl local captures CUDA graphs"),
        ("--bf16 --fp8-format hybrid", "--fp8-format hybrid needs Transformer Engine"),
        (
            "--oases-schedule overlap --oases-cuda-graphs eager",
            "--oases-cuda-graphs does not run under --use-megatron-fsdp",
        ),
    ],
)
def test_what_megatron_fsdp_cannot_run_here_is_one_line_up_front(argv, match):
    """Through Megatron's parse, as a user's command line."""
    message = _one_line(parse_config, MFSDP + argv, world_size=2)
    assert match in message, message


@pytest.mark.parametrize("flag", ["--save", "--load"])
def test_checkpoints_run_under_megatron_fsdp_on_cpu(flag):
    """Issue 61.2: refused on CPU ranks before (the fsdp_dtensor save hung where a rank holds no
    shard of a parameter); now saved and resumed through the ``megatron-fsdp-checkpoint`` patch
    (``tests/e2e/test_megatron_fsdp_checkpoint_e2e.py``)."""
    path = "/tmp/oases-test-never-touched"
    config = parse_config(MFSDP + f"--data-parallel-sharding-strategy optim {flag} {path}", 2)
    assert config.schedule == "off"
    check_sharded_data_parallel(_cpu_args(**{flag[2:]: path}), "overlap", cuda_available=False)


@pytest.mark.parametrize("schedule", ["overlap", "cross-pass", "oases"])
def test_split_schedules_run_under_megatron_fsdp(schedule):
    """Issue 61.3: no longer refused; the engine gathers each layer and hands its gradients over
    once (``schedule/megatron/fsdp_params.py``; parity against stock Megatron-FSDP in
    ``tests/e2e/test_megatron_fsdp_split_e2e.py``)."""
    recompute = "--recompute-granularity full --recompute-method uniform --recompute-num-layers 1 "
    argv = MFSDP + recompute + f"--tensor-model-parallel-size 2 --oases-schedule {schedule}"
    config = parse_config(argv, world_size=4)
    assert config.schedule == schedule


def test_pipeline_parallelism_runs_hybrid_sharding_with_it_is_one_line():
    """Pipeline stages run under Megatron-FSDP through the ``megatron-fsdp-pipeline`` patch
    (parity: ``tests/e2e/test_megatron_fsdp_pipeline_e2e.py``); its hybrid sharding lays its mesh
    over the whole world and is refused with them, in one line, on every device."""
    config = parse_config(MFSDP + "--pipeline-model-parallel-size 2", world_size=4)
    assert config.schedule == "off"
    args = _cpu_args(pipeline_model_parallel_size=2, num_distributed_optimizer_instances=2)
    for cuda in (False, True):
        message = _one_line(check_sharded_data_parallel, args, "off", cuda_available=cuda)
        assert "--num-distributed-optimizer-instances" in message and "drop one of them" in message
    check_sharded_data_parallel(_cpu_args(pipeline_model_parallel_size=2), "off", False)


def test_pipeline_patch_checks_what_it_replaces_and_only_acts_with_stages():
    from megatron_oases.platform import megatron_fsdp_pipeline as pipeline

    replaced = {attr for _owner, attr, _new in pipeline.replacements()}
    assert replaced == {"_get_dp_tp_mesh", "forward", "_allreduce_embedding_grad"}
    assert pipeline.make_patch(_cpu_args(pipeline_model_parallel_size=1)) is None
    assert pipeline.make_patch(SimpleNamespace(pipeline_model_parallel_size=2)) is None
    patch = pipeline.make_patch(_cpu_args(pipeline_model_parallel_size=2))
    assert patch.name == "megatron-fsdp-pipeline"


def test_stage_output_is_an_alias_that_is_no_view_and_keeps_the_hook():
    """What Megatron's ``deallocate_output_tensor`` needs of a stage's output (no ``_base``),
    while Megatron-FSDP's pre-backward hook on the view still fires and the gradient is exact."""
    import torch

    from megatron_oases.platform.megatron_fsdp_pipeline import not_a_view

    weight = torch.randn(3, 3, requires_grad=True)
    hidden = weight * 2
    view = hidden.view_as(hidden)
    fired = []
    torch.autograd.graph.register_multi_grad_hook([view], lambda grads: fired.append(1), mode="any")
    out = not_a_view(view)
    assert view._base is hidden and out._base is None
    assert out.untyped_storage().data_ptr() == hidden.untyped_storage().data_ptr()
    out.backward(torch.ones(3, 3))
    assert fired == [1] and torch.equal(weight.grad, torch.full((3, 3), 2.0))
    plain = torch.ones(2)
    assert not_a_view(plain) is plain and not_a_view(None) is None


def test_fusions_megatron_lm_leaves_on_are_one_line():
    """Megatron-LM's own ``pretrain_gpt.py`` (no CPU defaults added): gloo has no PREMUL_SUM;
    gradient-accumulation fusion needs TE."""
    message = _one_line(
        check_sharded_data_parallel,
        _cpu_args(gradient_reduce_div_fusion=True),
        "off",
        cuda_available=False,
    )
    assert "add --no-gradient-reduce-div-fusion" in message
    message = _one_line(
        check_sharded_data_parallel,
        _cpu_args(gradient_accumulation_fusion=True),
        "off",
        cuda_available=False,
    )
    assert "add --no-gradient-accumulation-fusion" in message


def test_without_einops_one_line(monkeypatch):
    import importlib.util

    find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "einops" else find_spec(name)
    )
    for cuda in (False, True):
        message = _one_line(check_sharded_data_parallel, _cpu_args(), "off", cuda_available=cuda)
        assert "pip install einops" in message


def test_the_platform_patch_gives_the_adapter_a_cpu_mesh_and_device():
    """Installed only under --use-megatron-fsdp without CUDA; replaces what it names, restores
    it on uninstall."""
    from megatron.core.distributed.fsdp import mcore_fsdp_adapter as adapter

    from megatron_oases import platform
    from megatron_oases.platform import megatron_fsdp

    init, mesh = adapter.FullyShardedDataParallel.__init__, adapter.DeviceMesh
    assert megatron_fsdp.make_patch(_cpu_args()) is None  # no CPU shims: CUDA's own
    installed = platform.install_cpu_shims(force=True)
    try:
        assert megatron_fsdp.make_patch(_cpu_args(use_megatron_fsdp=False)) is None
        patch = megatron_fsdp.make_patch(_cpu_args())
        assert patch.name == "megatron-fsdp-cpu"
        patch.install()
        try:
            assert adapter.DeviceMesh.from_group.__qualname__.startswith("_CpuDeviceMesh")
            assert adapter.FullyShardedDataParallel.__init__ is not init
            assert adapter.FullyShardedDataParallel.__init__.__wrapped__ is init
        finally:
            patch.uninstall()
    finally:
        if installed:
            platform.uninstall_cpu_shims()
    assert adapter.FullyShardedDataParallel.__init__ is init and adapter.DeviceMesh is mesh


def test_the_platform_patch_refuses_an_adapter_it_does_not_know(monkeypatch):
    """A Megatron whose adapter no longer formats the CUDA device: one line at install time, not
    a patch replacing what nothing calls."""
    from megatron.core.distributed.fsdp import mcore_fsdp_adapter as adapter

    from megatron_oases.platform import megatron_fsdp

    def __init__(self, config, ddp_config, module, device=None):
        self.device = device

    monkeypatch.setattr(adapter.FullyShardedDataParallel, "__init__", __init__)
    message = _one_line(megatron_fsdp.replacements)
    assert "torch.cuda.current_device()" in message


def test_cpu_index_is_zero_only_while_the_wrapper_is_built():
    import logging

    import torch

    from megatron_oases.platform.megatron_fsdp import DEVICE_WARNING, _cuda_index_zero

    seen, saved = [], torch.cuda.current_device
    log = logging.getLogger("test-megatron-fsdp")

    class Keep(logging.Handler):
        def emit(self, record):
            seen.append(record.getMessage())

    log.addHandler(Keep())
    with _cuda_index_zero([log]):
        assert torch.cuda.current_device() == 0
        log.warning("Megatron-FSDP is using device cpu %s cuda:0", DEVICE_WARNING)
        log.warning("another warning")
    log.warning("after: %s", DEVICE_WARNING)
    assert torch.cuda.current_device is saved
    assert seen == ["another warning", f"after: {DEVICE_WARNING}"]


def test_a_stage_checkpoint_names_its_layers_model_wide():
    """fsdp_dtensor keys under pipeline stages: the second stage's ``layers.0`` is the model's
    layer 2 (its ``layer_number`` 3); multi-token-prediction keys and other keys stay."""
    import torch

    from megatron_oases.platform.megatron_fsdp_checkpoint import (
        global_layer_numbers,
        with_global_layer_keys,
    )

    layers = torch.nn.ModuleList([torch.nn.Linear(1, 1), torch.nn.Linear(1, 1)])
    for i, layer in enumerate(layers):
        layer.layer_number = 3 + i
    model = torch.nn.Module()
    model.decoder = torch.nn.Module()
    model.decoder.layers = layers
    numbers = global_layer_numbers(model)
    assert numbers == {0: 2, 1: 3}
    state = {
        "module.decoder.layers.0.weight": 1,
        "module.decoder.layers.1.mlp.experts.local_experts.0.weight": 2,
        "module.decoder.final_layernorm.weight": 3,
        "module.mtp.layers.0.weight": 4,
    }
    assert with_global_layer_keys(state, numbers) == {
        "module.decoder.layers.2.weight": 1,
        "module.decoder.layers.3.mlp.experts.local_experts.0.weight": 2,
        "module.decoder.final_layernorm.weight": 3,
        "module.mtp.layers.0.weight": 4,
    }
    assert with_global_layer_keys(state, {0: 0, 1: 1}) is state
