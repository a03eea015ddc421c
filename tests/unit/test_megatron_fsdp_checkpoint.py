"""Issue 61.2: the ``megatron-fsdp-checkpoint`` patch
(:mod:`megatron_oases.platform.megatron_fsdp_checkpoint`): where it is installed (``--use-megatron-
fsdp`` with ``--save`` or ``--load``, any device), its install-time checks (one line where
Megatron moved what it replaces), and its mocks on real DTensor parameters and torch's AdamW.
(Save and resume bit for bit, and every rank's keys equal: ``tests/e2e/
test_megatron_fsdp_checkpoint_e2e.py``.)"""

from types import SimpleNamespace

import pytest
import torch

from megatron_oases.errors import OasesConfigError
from megatron_oases.platform import megatron_fsdp_checkpoint as mfc


def _args(**kw):
    base = dict(use_megatron_fsdp=True, save=None, load=None)
    return SimpleNamespace(**{**base, **kw})


def test_installed_only_under_megatron_fsdp_with_save_or_load():
    assert mfc.make_patch(_args()) is None
    assert mfc.make_patch(_args(use_megatron_fsdp=False, save="/tmp/x")) is None
    for kw in ({"save": "/tmp/x"}, {"load": "/tmp/x"}):
        patch = mfc.make_patch(_args(**kw))  # no CPU shims here: on every device
        assert patch.name == mfc.PATCH_NAME == "megatron-fsdp-checkpoint"


def test_preflight_installs_it_and_uninstall_restores_megatron():
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    from megatron_oases import patches
    from megatron_oases.training.preflight import install_megatron_fsdp

    original = DistributedOptimizer.sharded_param_state_fsdp_dtensor
    install_megatron_fsdp(_args(load="/tmp/x"))
    try:
        assert patches.is_installed(mfc.PATCH_NAME)
        assert not patches.is_installed("megatron-fsdp-cpu")  # no CPU shims: CUDA's own
        replaced = DistributedOptimizer.sharded_param_state_fsdp_dtensor
        assert replaced is not original and replaced.__wrapped__ is original
    finally:
        patches.uninstall(mfc.PATCH_NAME)
    assert DistributedOptimizer.sharded_param_state_fsdp_dtensor is original


def test_this_megatron_has_the_gap():
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    from megatron.training import checkpointing

    (owner, name, replacement), (module, preprocess, renaming) = mfc.replacements()
    assert (owner, name) == (DistributedOptimizer, "sharded_param_state_fsdp_dtensor")
    assert replacement.__wrapped__ is DistributedOptimizer.sharded_param_state_fsdp_dtensor
    # the layer keys renamed model-wide under pipeline stages
    assert (module, preprocess) == (checkpointing, "preprocess_fsdp_dtensor_state_dict")
    assert renaming.__wrapped__ is checkpointing.preprocess_fsdp_dtensor_state_dict


def _one_line():
    with pytest.raises(OasesConfigError) as err:
        mfc.replacements()
    message = str(err.value)
    assert "\n" not in message and "megatron-oases supports megatron-core" in message
    return message


def test_a_method_that_packs_every_parameter_is_refused(monkeypatch):
    """The replacement relies on Megatron packing only the states that exist."""
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    def sharded_param_state_fsdp_dtensor(self, is_loading=False):
        self._init_optimizer_states_with_dummy_values()
        return {"state": {self._param_name(p): {} for p in self.params}}

    monkeypatch.setattr(
        DistributedOptimizer, "sharded_param_state_fsdp_dtensor", sharded_param_state_fsdp_dtensor
    )
    assert repr(mfc.PACKED) in _one_line()


def test_a_dummy_step_that_no_longer_skips_empty_shards_is_refused(monkeypatch):
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    def _init_optimizer_states_with_dummy_values(self):
        self.optimizer.step()

    monkeypatch.setattr(
        DistributedOptimizer,
        "_init_optimizer_states_with_dummy_values",
        _init_optimizer_states_with_dummy_values,
    )
    assert repr(mfc.SKIPS_EMPTY) in _one_line()


def test_a_preprocessing_without_its_per_key_collective_is_refused(monkeypatch):
    from megatron.core.distributed.fsdp.src.megatron_fsdp import uneven_dtensor

    monkeypatch.setattr(uneven_dtensor, "preprocess_state_dict_for_uneven_dtensor", lambda sd: sd)
    assert repr(mfc.PAIRED) in _one_line()


def test_a_checkpointing_that_no_longer_preprocesses_is_refused(monkeypatch):
    from megatron.training import checkpointing

    monkeypatch.setattr(checkpointing, "preprocess_fsdp_dtensor_state_dict", lambda *a: a[1])
    assert "preprocess_state_dict_for_uneven_dtensor" in _one_line()


# ------------------------------------------------------------- the mocks, on one gloo rank


@pytest.fixture
def adam(model_parallel_1):
    """torch's AdamW (Megatron's optimizer without TE or Apex) over two DTensor parameters of a
    one-rank mesh: ``held`` (its local shard whole) and ``empty`` (a 4 x 2 parameter whose local
    shard is empty, as on a Megatron-FSDP rank whose slice of the bucket misses it), after one
    step in which, as Megatron gives it, only ``held`` has a gradient. Wrapped as Megatron's
    ``DistributedOptimizer`` is seen by the patch."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    mesh = init_device_mesh("cpu", (1,))
    held = torch.nn.Parameter(DTensor.from_local(torch.randn(4, 2), mesh, [Shard(0)]))
    empty = torch.nn.Parameter(
        DTensor.from_local(
            torch.empty(0, 2), mesh, [Shard(0)], shape=torch.Size((4, 2)), stride=(2, 1)
        )
    )
    opt = torch.optim.AdamW([held, empty], lr=1e-2, foreach=False)
    held.grad = DTensor.from_local(torch.ones(4, 2), mesh, [Shard(0)])
    opt.step()
    names = {id(held): "held", id(empty): "empty"}
    wrapper = SimpleNamespace(optimizer=opt, state=opt.state, _param_name=lambda p: names[id(p)])
    return wrapper, held, empty


def test_torch_adamw_makes_no_state_for_the_empty_shard(adam):
    """The gap: what the ranks' state dicts then lack."""
    wrapper, held, empty = adam
    assert held in wrapper.state and empty not in wrapper.state


def _check_mock(entry, empty):
    from torch.distributed.tensor import DTensor

    for key in ("exp_avg", "exp_avg_sq"):
        value = entry[key]
        assert isinstance(value, DTensor) and value._local_tensor.numel() == 0
        assert value._local_tensor.shape == empty._local_tensor.shape  # (0, 2), not (0,)
        assert value.shape == empty.shape and value.placements == empty.placements
        assert value.dtype == torch.float32


def test_a_save_mocks_the_dtensor_keys_and_leaves_the_optimizer_alone(adam):
    wrapper, held, empty = adam
    packed = {"held": wrapper.state[held]}
    assert mfc.fill_missing(wrapper, packed) == ["empty"]
    assert set(packed) == {"held", "empty"} and packed["held"] is wrapper.state[held]
    assert set(packed["empty"]) == {"exp_avg", "exp_avg_sq"}  # no step from this rank
    _check_mock(packed["empty"], empty)
    assert empty not in wrapper.state


def test_a_load_mocks_a_step_too(adam):
    """torch's Adam reads ``step`` from every state it loads; the load overwrites the copy."""
    wrapper, held, empty = adam
    packed = {"held": wrapper.state[held]}
    mfc.fill_missing(wrapper, packed, is_loading=True)
    step = packed["empty"]["step"]
    assert torch.equal(step, wrapper.state[held]["step"])
    assert step is not wrapper.state[held]["step"]
    _check_mock(packed["empty"], empty)


def test_a_save_after_a_load_writes_no_stale_step(adam):
    """After a load the mock is the parameter's state, its step never advancing on this rank: a
    save writes its DTensor entries only (DCP would keep either rank's step)."""
    wrapper, held, empty = adam
    loaded = {"held": wrapper.state[held]}
    mfc.fill_missing(wrapper, loaded, is_loading=True)
    wrapper.state[empty] = loaded["empty"]  # what optimizer.load_state_dict installs
    packed = {"held": wrapper.state[held], "empty": wrapper.state[empty]}
    assert mfc.fill_missing(wrapper, packed) == []
    assert set(packed["empty"]) == {"exp_avg", "exp_avg_sq"}
    assert packed["empty"]["exp_avg"] is wrapper.state[empty]["exp_avg"]
    assert "step" in wrapper.state[empty] and "step" in packed["held"]


def test_a_rank_without_any_state_mocks_the_other_ranks_keys(adam, monkeypatch):
    """A rank whose every shard is empty has no state to copy the keys from: they come from the
    other ranks (one ``all_gather_object``)."""
    import torch.distributed as dist

    wrapper, held, empty = adam
    others = mfc.state_keys(wrapper.state.values())
    wrapper.state.clear()

    def all_gather_object(out, obj, group=None):
        out[:] = [obj, others]

    monkeypatch.setattr(dist, "all_gather_object", all_gather_object)
    packed = {}
    assert mfc.fill_missing(wrapper, packed) == ["empty"]  # ``held`` is not empty: left
    _check_mock(packed["empty"], empty)


def test_the_replacement_fills_what_megatron_returns(monkeypatch):
    calls, seen = [], []

    def original(self, is_loading=False):
        calls.append(is_loading)
        return {"state": {}, "param_to_group_meta": {}}

    monkeypatch.setattr(mfc, "fill_missing", lambda opt, packed, loading: seen.append(loading))
    out = mfc.make_sharded_param_state(original)(object(), is_loading=True)
    assert calls == [True] and seen == [True] and set(out) == {"state", "param_to_group_meta"}
