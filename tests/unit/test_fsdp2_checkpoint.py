"""The ``fsdp2-checkpoint`` patch (:mod:`megatron_oases.platform.fsdp2_checkpoint`): what it finds
open in this megatron-core, its install-time checks (one line where Megatron moved what it
replaces; nothing installed where a gap is closed), each replacement on a real ``Parameter``
DTensor and Megatron's own optimizer wrappers, and the FSDP2 checkpoint refusal gone. (Save and
resume under FSDP2, bit for bit: ``tests/e2e/test_fsdp2_checkpoint_e2e.py``.)"""

import contextlib

import pytest
import torch
from helpers.runs import parse_config

from megatron_oases.errors import OasesConfigError
from megatron_oases.patching import Patch
from megatron_oases.platform import fsdp2_checkpoint as fc

FSDP2 = "--use-torch-fsdp2 --untie-embeddings-and-output-weights "


def _names(found):
    return {(getattr(o, "__name__", o), n) for o, n, _ in found}


#: Every replacement megatron-core 0.19.2 needs (torch >= 2.14).
ALL = {
    ("megatron.core.dist_checkpointing.optimizer", "to_local_if_dtensor"),
    ("FP32Optimizer", "state_dict"),
    ("ChainedOptimizer", "state_dict"),
    ("Float16OptimizerWithFloat16Params", "state_dict"),
    ("megatron.core.dist_checkpointing", "load"),
    ("megatron.training.training", "load_checkpoint"),
}


def test_this_megatron_has_the_three_gaps():
    assert _names(fc.replacements()) == ALL
    assert fc.gap() is None


def _dtensor_param(shape=(4, 2)):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (1,))
    return torch.nn.Parameter(distribute_tensor(torch.randn(*shape), mesh, [Shard(0)]))


def _chained_adam(params):
    """Megatron's wrappers around torch Adam, with Megatron's ``init_state_fn`` for it."""
    from megatron.core.optimizer import OptimizerConfig
    from megatron.core.optimizer.optimizer import ChainedOptimizer, FP32Optimizer

    adam = torch.optim.Adam(params, lr=1e-3)

    def init_state_fn(opt, config=None):  # as megatron/core/optimizer/__init__.py's for Adam
        for group in opt.param_groups:
            for p in group["params"]:
                if len(opt.state[p]) == 0:
                    opt.state[p]["exp_avg"] = torch.zeros_like(p.data)
                    opt.state[p]["exp_avg_sq"] = torch.zeros_like(p.data)

    inner = FP32Optimizer(adam, OptimizerConfig(lr=1e-3), init_state_fn)
    return ChainedOptimizer([inner]), adam


@contextlib.contextmanager
def _installed(patch):
    patch.install()
    try:
        yield
    finally:
        patch.uninstall()


def test_torch_dist_maps_optimizer_params_to_the_models_local_tensors(model_parallel_1):
    """Torch >= 2.14 returns a fresh view from a Parameter DTensor's ``to_local()``: Megatron's map
    by ``id()`` finds no model tensor (the save's ValueError) until the patch is in."""
    from megatron.core.dist_checkpointing import optimizer as dist_optim

    p = _dtensor_param()
    assert dist_optim.get_optim_param_to_id_map([p]) != {id(p._local_tensor): 0}  # the gap
    patch = Patch(fc.PATCH_NAME, replacements=fc.replacements())
    with _installed(patch):
        assert dist_optim.to_local_if_dtensor(p) is p._local_tensor
        assert dist_optim.get_optim_param_to_id_map([p]) == {id(p._local_tensor): 0}
        plain = torch.ones(2)
        assert dist_optim.to_local_if_dtensor(plain) is plain


def test_torch_dcp_request_holds_the_state_a_checkpoint_loads_into(model_parallel_1):
    p = _dtensor_param()
    chained, adam = _chained_adam([p])
    with pytest.raises(TypeError):  # the gap: megatron-core 0.19.2's torch_dcp load
        chained.state_dict(is_loading=True)
    with _installed(Patch(fc.PATCH_NAME, replacements=fc.replacements())):
        sd = chained.state_dict(is_loading=True)
    state = sd["state"][0]
    assert set(state) == {"exp_avg", "exp_avg_sq", "step"}  # DCP loads only keys present
    assert type(state["exp_avg"]) is type(p.data)  # a DTensor, as after a step
    assert state["step"].dtype == torch.float32 and state["step"].item() == 0.0
    assert not state["step"].is_cuda  # torch Adam's own place for it (not capturable)


def test_in_place_load_gets_the_saved_step_back(model_parallel_1):
    """``load_checkpoint`` with ``skip_load_to_model_and_opt`` never calls the optimizer's
    ``load_state_dict``; the saved ``common_step`` goes back into every parameter's state."""
    params = [_dtensor_param(), _dtensor_param((2, 2))]
    chained, adam = _chained_adam(params)
    chained.chained_optimizers[0].init_state_fn(adam)  # what the load's request made
    saved = torch.tensor(4.0)
    fc.restore_steps(chained, {"state": {"common_step": saved}, "param_groups": []})
    steps = [adam.state[p]["step"] for p in params]
    assert [s.item() for s in steps] == [4.0, 4.0]
    assert steps[0] is not steps[1] and steps[0] is not saved  # each its own tensor
    fc.restore_steps(chained, None)  # nothing loaded for the optimizer: nothing done
    fc.restore_steps(chained, {"state": {"common_step": torch.tensor(9.0)}})
    assert adam.state[params[0]]["step"].item() == 4.0  # a step already there is kept


def test_restore_steps_reads_nested_and_chained_state_dicts(model_parallel_1):
    from megatron.core.optimizer.optimizer import ChainedOptimizer

    a, b = _dtensor_param(), _dtensor_param()
    (first, adam_a), (second, adam_b) = _chained_adam([a]), _chained_adam([b])
    both = ChainedOptimizer([first.chained_optimizers[0], second.chained_optimizers[0]])
    for opt, adam in ((first, adam_a), (second, adam_b)):
        opt.chained_optimizers[0].init_state_fn(adam)
    loaded = {
        0: {"state": {"common_step": torch.tensor(3.0)}},
        1: {"optimizer": {"state": {"common_step": torch.tensor(5.0)}}},  # Float16Optimizer's
    }
    fc.restore_steps(both, loaded)
    assert adam_a.state[a]["step"].item() == 3.0 and adam_b.state[b]["step"].item() == 5.0


def test_a_moved_symbol_is_one_line(monkeypatch):
    """Install-time checks: what the patch replaces must be what Megatron calls."""
    from megatron.core.dist_checkpointing import optimizer as dist_optim
    from megatron.training import training

    monkeypatch.delattr(dist_optim, "to_local_if_dtensor")
    with pytest.raises(OasesConfigError, match="has no: .*to_local_if_dtensor") as err:
        fc.replacements()
    assert "\n" not in str(err.value)
    assert "cannot save and resume --use-torch-fsdp2 runs here" in fc.gap()
    monkeypatch.undo()

    def setup_model_and_optimizer(skip_load_to_model_and_opt=True):  # calls something else
        return skip_load_to_model_and_opt

    monkeypatch.setattr(training, "setup_model_and_optimizer", setup_model_and_optimizer)
    with pytest.raises(
        OasesConfigError, match="no longer calls it from .*setup_model_and_optimizer"
    ):
        fc.replacements()


def test_the_torch_dcp_request_must_be_megatrons(monkeypatch):
    from megatron.training import checkpointing

    def load_checkpoint(model, optimizer, skip_load_to_model_and_opt=False):
        if not skip_load_to_model_and_opt:  # the torch_dcp request gone
            return optimizer.state_dict()

    monkeypatch.setattr(checkpointing, "load_checkpoint", load_checkpoint)
    with pytest.raises(OasesConfigError, match="no longer has 'optimizer.state_dict"):
        fc.replacements()


def test_closed_gaps_are_not_replaced(monkeypatch):
    """Where Megatron fixed one (a newer release), that replacement is not made."""
    from megatron.core.dist_checkpointing import optimizer as dist_optim
    from megatron.core.optimizer import optimizer as optim
    from megatron.training import checkpointing

    def to_local_if_dtensor(tensor):
        return getattr(tensor, "_local_tensor", tensor)

    def state_dict(self, is_loading=False):
        return {}

    monkeypatch.setattr(dist_optim, "to_local_if_dtensor", to_local_if_dtensor)
    monkeypatch.setattr(optim.FP32Optimizer, "state_dict", state_dict)
    monkeypatch.setattr(optim.ChainedOptimizer, "state_dict", state_dict)
    monkeypatch.setattr(optim.Float16OptimizerWithFloat16Params, "state_dict", lambda self: {})
    assert _names(fc.replacements()) == {
        ("megatron.core.dist_checkpointing", "load"),
        ("megatron.training.training", "load_checkpoint"),
    }

    def load_checkpoint(model, optimizer, skip_load_to_model_and_opt=False):
        return optimizer.state_dict(is_loading=True)  # always loads the optimizer

    monkeypatch.setattr(checkpointing, "load_checkpoint", load_checkpoint)
    assert fc.replacements() == []


def test_installed_only_for_fsdp2_with_a_checkpoint(monkeypatch):
    monkeypatch.delenv("CUDA_DEVICE_MAX_CONNECTIONS", raising=False)
    monkeypatch.delenv("OASES_DEFAULT_MAX_CONNECTIONS", raising=False)
    for argv, wanted in (
        (FSDP2 + "--save /tmp/oases-test-never-written", True),
        (FSDP2 + "--load /tmp/oases-test-never-written", True),
        (FSDP2, False),
        ("--save /tmp/oases-test-never-written", False),
    ):
        config = parse_config(argv, world_size=2)  # no refusal any more
        assert config.fsdp2_checkpoints == wanted, argv
        patch = fc.make_patch(config)
        assert (patch is not None and patch.name == fc.PATCH_NAME) == wanted, argv
