"""megatron-core versions: the installed one is accepted, and every Megatron symbol our patches
replace is there and is still what Megatron calls; releases out of range are refused.

Runs on whatever megatron-core is installed (CI: 0.19; 0.18 was checked by hand the same way).
Fast: one argument parse, the patches built, installed and uninstalled, no training.
"""

import inspect

import pytest
from helpers import GPT
from helpers.runs import parse
from helpers.variants import VERSIONS_TINY as TINY

from megatron_oases import compat
from megatron_oases.config import OasesConfig
from megatron_oases.errors import OasesConfigError


def test_installed_version_is_supported():
    version = compat.megatron_core_version()
    assert version is not None
    assert compat.check_megatron_core() == version


def test_the_imported_megatron_core_is_the_one_checked(monkeypatch):
    """A Megatron-LM checkout on PYTHONPATH shadows the installed wheel: its own package_info
    names the release (the wheel's metadata would name another), without the local git tag."""
    import sys
    import types

    monkeypatch.delenv(compat.NEXT_ENV, raising=False)  # tests/megatron_main.sh's switch
    fake = types.SimpleNamespace(__version__="0.20.0+d98e8a6")
    monkeypatch.setitem(sys.modules, "megatron.core.package_info", fake)
    assert compat.megatron_core_version() == "0.20.0"
    assert compat.check_megatron_core() == "0.20.0"
    fake.__version__ = "0.21.0+abcdef0"
    with pytest.raises(OasesConfigError, match="megatron-core 0.21.0 is not supported"):
        compat.check_megatron_core()


def test_the_next_release_is_admitted_only_to_check_its_branch(monkeypatch):
    """``tests/megatron_main.sh`` runs the suite on Megatron-LM main before its release: once main
    moves past 0.20 (0.21-dev), only its switch admits 0.21; 0.22 is refused either way."""
    monkeypatch.setenv(compat.NEXT_ENV, "1")
    assert compat.check_megatron_core("0.21.0") == "0.21.0"
    with pytest.raises(OasesConfigError, match="0.22.0 is not supported"):
        compat.check_megatron_core("0.22.0")
    monkeypatch.delenv(compat.NEXT_ENV)
    with pytest.raises(OasesConfigError, match="0.21.0 is not supported"):
        compat.check_megatron_core("0.21.0")
    assert compat.check_megatron_core("0.20.0") == "0.20.0"  # admitted: the suite passed on main


@pytest.mark.parametrize("version", ["0.16.1", "0.17.1", "0.21.0"])
def test_versions_out_of_range_are_refused(version, monkeypatch):
    monkeypatch.delenv(compat.NEXT_ENV, raising=False)
    with pytest.raises(OasesConfigError, match=f"megatron-core {version} is not supported"):
        compat.check_megatron_core(version)


@pytest.fixture(scope="module")
def args(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("versions")
    plan = tmp / "plan.json"
    plan.write_text('{"version": 1, "tensor_model_parallel_size": 2, "degrees": [1, 2]}')
    return parse(
        TINY + f"--oases-schedule oases --oases-plan {plan} --oases-trace {tmp / 'trace.json'} "
        f"--log-json {tmp / 'golden.json'}",
        world_size=2,
    )


def _current(owner, attr):
    return owner.__dict__.get(attr) if isinstance(owner, type) else getattr(owner, attr)


def _built_patches(args):
    from megatron_oases import megatron_lm
    from megatron_oases.instrument import golden
    from megatron_oases.instrument import trace_patch as trace
    from megatron_oases.schedule.megatron import patch as schedule

    config = OasesConfig.from_args(args)
    built = {
        "oases-schedule": schedule.make_patch(config),
        "golden-values": golden.make_patch(config, golden.make_recorder(config)),
        "oases-trace": trace.make_patch(config, trace.make_tracer(config)),
        megatron_lm.HOOK_PATCH: megatron_lm.model_setup_hook(args, config),
    }
    assert all(p is not None for p in built.values()), built
    return built


def test_patches_replace_existing_symbols_and_uninstall_restores_them(args):
    for name, patch in _built_patches(args).items():
        originals = [(o, a, _current(o, a)) for o, a, _ in patch.replacements]
        for owner, attr, original in originals:
            assert original is not None, f"{name}: {owner}.{attr} does not exist"
        patch.install()
        try:
            for owner, attr, new in patch.replacements:
                assert _current(owner, attr) is new, f"{name}: {attr} not replaced"
        finally:
            patch.uninstall()
        for owner, attr, original in originals:
            assert _current(owner, attr) is original, f"{name}: {attr} not restored"


def test_replaced_symbols_are_what_megatron_calls():
    """What the replacements rely on, beyond the checks the factories make themselves."""
    from megatron.core.optimizer import clip_grads
    from megatron.core.tensor_parallel import layers
    from megatron.core.transformer.transformer_block import TransformerBlock
    from megatron.training import checkpointing, training

    from megatron_oases.schedule.megatron.transformer_block import block_forward

    req = compat.require_symbol
    # oases-schedule: RowParallelLinear's forward all-reduce / SP reduce-scatter, by the names
    # imported into layers, which the deferring row linear stops short of (.linears).
    for name in (
        "reduce_from_tensor_model_parallel_region",
        "reduce_scatter_to_sequence_parallel_region",
    ):
        req(layers, name, called_by=[layers.RowParallelLinear.forward], parameters=("input_",))
    # ColumnParallelLinear.forward hands its flags to _forward_impl, which the deferring one
    # overrides.
    forward = req(layers.ColumnParallelLinear, "forward")
    for flag in ("allreduce_dgrad=", "sequence_parallel=", "self._forward_impl("):
        assert flag in inspect.getsource(forward), flag
    # Our bound TransformerBlock forward hands the stock one its arguments by position.
    ours = inspect.signature(block_forward).parameters
    stock = list(inspect.signature(TransformerBlock.forward).parameters)
    positional = [n for n, p in ours.items() if p.kind == p.POSITIONAL_OR_KEYWORD][2:]
    assert stock[1 : 1 + len(positional)] == positional
    # Plans: grad-norm clipping asks, by the name imported into clip_grads.
    req(
        clip_grads,
        "param_is_not_tensor_parallel_duplicate",
        called_by=[clip_grads.count_zeros_fp32],
    )
    # --load of another model: refused before Megatron loads it.
    req(checkpointing, "_load_base_checkpoint", parameters=("rank0",))
    req(checkpointing, "check_checkpoint_args")
    # Safe saves: the torch_dist save and the tracker write go through these names.
    from megatron.core import dist_checkpointing

    req(dist_checkpointing, "save", called_by=[checkpointing.save_checkpoint])
    req(checkpointing, "maybe_msc", called_by=[checkpointing.save_checkpoint])
    req(dist_checkpointing, "load", called_by=[checkpointing._load_global_dist_base_checkpoint])
    # The test harness and the trace wrap train_step by name.
    req(training, "train_step", called_by=[training.train])
    # require_call: a statement a patch relies on, present here; one line when it is not.
    compat.require_call(training.train, "train_step(")
    with pytest.raises(OasesConfigError, match="no longer has 'no_such_call\\('"):
        compat.require_call(training.train, "no_such_call(")
    # Plans: the replica sync is the config's finalize_model_grads_func, which train() keeps from
    # 0.19 on and overwrites before (then compat replaces the name it overwrites it with).
    source = inspect.getsource(training.train)
    keeps = "if config.finalize_model_grads_func is None" in source
    assert keeps == (compat.version_tuple() >= (0, 19))
    assert bool(compat.finalize_model_grads_replacements()) == (not keeps)


def test_pretrain_takes_our_arguments_by_name():
    from megatron.training import pretrain

    names = set(compat.pretrain_kwargs(*range(5)))
    assert names <= set(inspect.signature(pretrain).parameters)


def test_norm_recompute_without_te_fixes_only_the_fp8_flag():
    """``--recompute-modules layernorm`` without TE: Megatron's ``CheckpointWithoutOutput()``
    reads its default ``fp8=False`` as fp8 on and reaches TE names that are not imported; the
    patch clears the flag and nothing else, and uninstall restores the original."""
    from megatron.core.tensor_parallel import CheckpointWithoutOutput, random

    from megatron_oases.platform import norm_recompute

    plain = GPT.format(layers=2) + "--tensor-model-parallel-size 2 --micro-batch-size 2 "
    selective = parse(plain + "--recompute-granularity selective", world_size=2)
    assert norm_recompute.make_patch(OasesConfig.from_args(selective)) is None
    flags = "--recompute-granularity selective --recompute-modules core_attn layernorm"
    args = parse(plain + flags, world_size=2)
    patch = norm_recompute.make_patch(OasesConfig.from_args(args))
    if random.HAVE_TE or "fp8 is not None" not in inspect.getsource(
        CheckpointWithoutOutput.__init__
    ):
        assert patch is None  # nothing to fix on this install
        return
    original = CheckpointWithoutOutput.__init__
    assert CheckpointWithoutOutput().fp8 is True  # the bug the patch exists for
    patch.install()
    try:
        checkpoint = CheckpointWithoutOutput()
        assert checkpoint.fp8 is False and checkpoint.ctx is None and checkpoint.outputs is None
    finally:
        patch.uninstall()
    assert CheckpointWithoutOutput.__init__ is original


@pytest.mark.parametrize(
    "field, value, fix",
    [("gtp_weight_remat_size", 2, "GTP weight sharding"), ("enable_mhc_connections", True, "mHC")],
)
def test_megatron_features_the_schedules_cannot_split_are_refused(field, value, fix):
    import types

    from megatron_oases.validation import check_megatron_features

    check_megatron_features("off", types.SimpleNamespace(**{field: value}))  # stock runs them
    with pytest.raises(OasesConfigError, match=fix) as err:
        check_megatron_features("oases", types.SimpleNamespace(**{field: value}))
    assert "\n" not in str(err.value)
    check_megatron_features("oases", types.SimpleNamespace(gtp_weight_remat_size=1))


@pytest.mark.parametrize(
    "flags",
    [
        "--oases-schedule overlap",
        "--oases-schedule oases --recompute-granularity full --recompute-method uniform "
        "--recompute-num-layers 1 --sequence-parallel",
        "--oases-schedule auto --oases-tune-steps 8",
    ],
)
def test_the_schedule_without_a_plan_replaces_at_most_two_process_wide_symbols(flags):
    """The schedule is applied per model instance (``prepare_model``); process-wide, without a
    plan, the ``oases-schedule`` patch replaces at most 2 symbols (today one: the embedding's
    split under SP, which Megatron calls through the module)."""
    from megatron.core import tensor_parallel

    from megatron_oases.schedule.megatron import patch as schedule

    config = OasesConfig.from_args(parse(TINY + flags, world_size=2))
    patch = schedule.make_patch(config)
    assert patch is not None and schedule.joins_stage_ends(config)
    replaced = [(owner, attr) for owner, attr, _ in patch.replacements]
    assert len(replaced) <= 2, replaced
    assert replaced == [(tensor_parallel, "scatter_to_sequence_parallel_region")]
