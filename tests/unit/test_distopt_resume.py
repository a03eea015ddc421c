"""``distopt-resume`` (``platform/distopt_resume.py``): after Megatron's
``DistributedOptimizer.load_state_dict`` (its branch without Apex/TE) every parameter state has its
own Adam ``step`` at the checkpoint's step, and a resumed torch Adam trains bit for bit as the
uninterrupted one.

Megatron's own method runs here, and its own parameter-state copy
(``_set_main_param_and_optimizer_states``, what the ``dp_reshardable`` load calls per parameter),
on a stand-in ``DistributedOptimizer`` that has only what they read (the wrapped torch Adam already
has state, as the load into the state dict it builds leaves it, so no buffers are needed). Fast: no
training, no process group.
"""

import copy
import types

import pytest
import torch
from helpers import GPT
from helpers.runs import parse

from megatron_oases.config import OasesConfig
from megatron_oases.errors import OasesConfigError
from megatron_oases.platform import distopt_resume

N_PARAMS = 5
SAVED_AT = 2


@pytest.fixture
def megatron(monkeypatch):
    """Megatron's ``distrib_optimizer`` module, in its branch without Apex/TE (the branch the
    replacement corrects) wherever the test runs."""
    from megatron.core.optimizer import distrib_optimizer

    monkeypatch.setattr(distrib_optimizer, "HAVE_APEX_OR_TE", False)
    return distrib_optimizer


def _grads(seed):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(3 + i, generator=gen) for i in range(N_PARAMS)]


def _step(adam, params, grads):
    for p, g in zip(params, grads):
        p.grad = g.clone()
    adam.step()


def _stand_in(megatron, adam, params):
    """What Megatron's ``load_state_dict`` and ``_set_main_param_and_optimizer_states`` read of a
    ``DistributedOptimizer`` (one param group; the main parameters are the model's)."""
    cls = megatron.DistributedOptimizer
    stand_in = types.SimpleNamespace(
        ddp_config=types.SimpleNamespace(use_megatron_fsdp=False),
        optimizer=adam,
        config=types.SimpleNamespace(
            fp16=False, use_precision_aware_optimizer_no_fp8_or_ds_fp8=False
        ),
        grad_scaler=None,
        model_param_group_index_map={p: (0, i) for i, p in enumerate(params)},
    )

    def load_parameter_state_from_dp_reshardable(param_state):
        with torch.no_grad():  # as the patch's second replacement runs it
            for model_param, tensors in param_state:
                cls._set_main_param_and_optimizer_states(stand_in, model_param, tensors)

    stand_in.load_parameter_state_from_dp_reshardable = load_parameter_state_from_dp_reshardable
    return stand_in


def _uninterrupted_and_resumed(megatron, load_state_dict):
    """(params, Adam) of an uninterrupted run after ``SAVED_AT`` steps, and of a run resumed from
    it through ``load_state_dict``, as Megatron-LM's torch_dist load calls it: the step in the
    param groups, the parameter state (``dp_reshardable``) holding the checkpoint's tensors and
    the ``step`` tensor captured when the state dict to load into was built (0)."""
    gen = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(3 + i, generator=gen)) for i in range(N_PARAMS)]
    adam = torch.optim.Adam(params, lr=0.1)
    for seed in range(1, SAVED_AT + 1):
        _step(adam, params, _grads(seed))
    resumed_params = [torch.nn.Parameter(torch.zeros_like(p)) for p in params]
    resumed = torch.optim.Adam(resumed_params, lr=0.1)
    for p in resumed_params:  # the state as the load into the built state dict leaves it
        resumed.state[p] = {
            "step": torch.tensor(0.0),
            "exp_avg": torch.zeros_like(p),
            "exp_avg_sq": torch.zeros_like(p),
        }
    param_state = [  # what dist_checkpointing's load hands back (the step is non-persistent)
        (
            q,
            {"param": p.detach().clone(), "step": resumed.state[q]["step"]}
            | {k: adam.state[p][k].clone() for k in ("exp_avg", "exp_avg_sq")},
        )
        for p, q in zip(params, resumed_params)
    ]
    groups = [
        {k: v for k, v in g.items() if k != "params"} | {"step": float(SAVED_AT)}
        for g in adam.state_dict()["param_groups"]
    ]
    checkpoint = {
        "optimizer": {"param_groups": groups},
        "param_state": param_state,
        "param_state_sharding_type": "dp_reshardable",
    }
    load_state_dict(_stand_in(megatron, resumed, resumed_params), checkpoint)
    return (params, adam), (resumed_params, resumed)


def _steps(adam, params):
    return [adam.state[p]["step"] for p in params]


def test_megatron_shares_one_step_reset_to_zero_and_adam_counts_it_per_parameter(megatron):
    """The gap itself, on this Megatron: one ``step`` object in every state, at 0 instead of the
    checkpoint's step, and one Adam step adds ``N_PARAMS`` to it (a resumed run's checkpoint
    stored step 36 at iteration 4)."""
    _, (params, adam) = _uninterrupted_and_resumed(
        megatron, megatron.DistributedOptimizer.load_state_dict
    )
    steps = _steps(adam, params)
    assert len({id(s) for s in steps}) == 1 and steps[0].item() == 0.0
    _step(adam, params, _grads(SAVED_AT + 1))
    assert [s.item() for s in _steps(adam, params)] == [float(N_PARAMS)] * N_PARAMS


def test_each_state_gets_its_own_step_and_training_resumes_bit_for_bit(megatron):
    fixed = distopt_resume.make_own_steps(megatron.DistributedOptimizer.load_state_dict)
    (ref_params, ref), (params, adam) = _uninterrupted_and_resumed(megatron, fixed)
    steps = _steps(adam, params)
    assert len({id(s) for s in steps}) == N_PARAMS, "the states still share a step tensor"
    assert [s.item() for s in steps] == [float(SAVED_AT)] * N_PARAMS
    for p, q in zip(params, ref_params):  # the rest as loaded, by Megatron's method
        assert torch.equal(p, q)
        for key in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(adam.state[p][key], ref.state[q][key]), key
    for iteration in (SAVED_AT + 1, SAVED_AT + 2):  # two steps after the load
        _step(ref, ref_params, _grads(iteration))
        _step(adam, params, _grads(iteration))
        assert [s.item() for s in _steps(adam, params)] == [float(iteration)] * N_PARAMS
        for p, q in zip(params, ref_params):
            assert torch.equal(p, q), f"step {iteration}: the resumed parameters differ"


def _config(flags=""):
    argv = GPT.format(layers=2) + "--micro-batch-size 2 --tensor-model-parallel-size 1 " + flags
    return OasesConfig.from_args(parse(argv, world_size=2))


def test_the_patch_replaces_load_state_dict_where_megatron_shares_the_step(megatron):
    cls = megatron.DistributedOptimizer
    original = cls.__dict__["load_state_dict"]
    assert distopt_resume.make_patch(_config()) is None  # no --use-distributed-optimizer
    patch = distopt_resume.make_patch(_config("--use-distributed-optimizer"))
    assert patch.name == "distopt-resume"
    replaced = {attr: new for owner, attr, new in patch.replacements if owner is cls}
    assert replaced["load_state_dict"].__wrapped__ is original
    patch.install()
    try:
        assert cls.__dict__["load_state_dict"] is replaced["load_state_dict"]
    finally:
        patch.uninstall()
    assert cls.__dict__["load_state_dict"] is original


def test_with_apex_or_te_load_state_dict_is_left_alone(megatron, monkeypatch):
    monkeypatch.setattr(megatron, "HAVE_APEX_OR_TE", True)
    names = [attr for _, attr, _ in distopt_resume.replacements()]
    assert "load_state_dict" not in names and "state_dict" not in names


def test_a_megatron_without_the_shared_step_statement_is_one_line(megatron, monkeypatch):
    """The install-time check: the replacement corrects ``s["step"] = step``; a Megatron whose
    branch without Apex/TE no longer has it is named, not patched blind."""

    def load_state_dict(self, state_dict):  # another release's branch, without the statement
        if not megatron.HAVE_APEX_OR_TE:
            for state in self.optimizer.state.values():
                state["step"] = torch.tensor(0.0)
        self.load_parameter_state_from_dp_reshardable(state_dict)

    monkeypatch.setattr(megatron.DistributedOptimizer, "load_state_dict", load_state_dict)
    with pytest.raises(OasesConfigError) as err:
        distopt_resume.replacements()
    message = str(err.value)
    assert "\n" not in message and "s[\"step\"] = step" in message and "load_state_dict" in message
