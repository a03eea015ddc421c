"""Megatron-LM integration: flag chaining, install hook, oases-pretrain-gpt, patches/, configs.

Megatron-LM itself (``megatron.training``, ``pretrain_gpt.py``) is not on PyPI for megatron-core
0.16, so these tests build a stand-in checkout in a temp dir: the module names, functions and
argparse shape that ``pretrain_gpt.py`` at ``core_v0.16.0`` uses (``parse_args(extra_args_provider)``
on an ``ArgumentParser(allow_abbrev=False)``, ``--transformer-impl`` defaulting to
``transformer_engine``, ``add_modelopt_args`` as the existing provider, ``pretrain(...)`` building
the model through ``model_provider(gpt_builder)`` and logging through ``training.training_log``).
Its ``__main__`` block keeps the real file's lines so that ``patches/pretrain_gpt.oases.patch``
applies to it.
"""

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import textwrap
import types

import pytest

from megatron_oases import megatron_lm, patches
from megatron_oases.arguments import build_parser, validate_args
from megatron_oases.errors import OasesConfigError
from megatron_oases.megatron_lm import configs

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PATCH = os.path.join(REPO, "patches", "pretrain_gpt.oases.patch")
TINY = (
    "--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 32 "
    "--max-position-embeddings 32 --micro-batch-size 2 --global-batch-size 4 --train-iters 3 "
    "--mock-data --tokenizer-type NullTokenizer --vocab-size 512 --lr 1e-4"
).split()

# ------------------------------------------------------------------ a Megatron-LM-shaped checkout

FAKE_FILES = {
    "megatron/training/__init__.py": """
        from . import inprocess_restart
        from .global_vars import get_args
        from .training import pretrain, set_startup_timestamps
        """,
    "megatron/training/global_vars.py": """
        _ARGS = None

        def get_args():
            return _ARGS

        def set_args(args):
            global _ARGS
            _ARGS = args
        """,
    "megatron/training/arguments.py": """
        import argparse
        import os

        def add_megatron_arguments(parser):
            g = parser.add_argument_group(title='network size')
            g.add_argument('--num-layers', type=int, default=None)
            g.add_argument('--hidden-size', type=int, default=None)
            g.add_argument('--num-attention-heads', type=int, default=None)
            g.add_argument('--seq-length', type=int, default=None)
            g.add_argument('--max-position-embeddings', type=int, default=None)
            g.add_argument('--vocab-size', type=int, default=None)
            g = parser.add_argument_group(title='transformer configuration')
            g.add_argument('--transformer-impl', default='transformer_engine',
                           choices=['local', 'transformer_engine', 'inference_optimized'])
            g.add_argument('--recompute-granularity', default=None, choices=['full', 'selective'])
            g.add_argument('--recompute-method', default=None, choices=['uniform', 'block'])
            g.add_argument('--recompute-num-layers', type=int, default=None)
            g.add_argument('--sequence-parallel', action='store_true')
            g.add_argument('--num-experts', type=int, default=None)
            g = parser.add_argument_group(title='distributed')
            g.add_argument('--tensor-model-parallel-size', type=int, default=1)
            g.add_argument('--pipeline-model-parallel-size', type=int, default=1)
            g.add_argument('--context-parallel-size', type=int, default=1)
            g.add_argument('--distributed-backend', default='nccl', choices=['nccl', 'gloo'])
            g.add_argument('--distributed-timeout-minutes', type=int, default=10)
            g = parser.add_argument_group(title='training')
            g.add_argument('--micro-batch-size', type=int, default=None)
            g.add_argument('--global-batch-size', type=int, default=None)
            g.add_argument('--train-iters', type=int, default=None)
            g.add_argument('--lr', type=float, default=None)
            g.add_argument('--log-interval', type=int, default=100)
            g = parser.add_argument_group(title='data and dataloader')
            g.add_argument('--mock-data', action='store_true')
            g.add_argument('--tokenizer-type', type=str, default=None)
            return parser

        def parse_args(extra_args_provider=None, ignore_unknown_args=False):
            parser = argparse.ArgumentParser(description='Megatron-LM Arguments',
                                             allow_abbrev=False)
            parser = add_megatron_arguments(parser)
            if extra_args_provider is not None:
                parser = extra_args_provider(parser)
            if ignore_unknown_args:
                args, _ = parser.parse_known_args()
            else:
                args = parser.parse_args()
            args.rank = int(os.getenv('RANK', '0'))
            args.world_size = int(os.getenv('WORLD_SIZE', '1'))
            return args

        def validate_args(args, defaults={}):
            for key in defaults:
                if getattr(args, key, None) is None:
                    setattr(args, key, defaults[key])
            return args
        """,
    "megatron/training/training.py": """
        import json
        import os

        from . import global_vars
        from .arguments import parse_args, validate_args

        _STARTUP = {}

        def set_startup_timestamps(program_start=None, main_entry=None):
            _STARTUP.update(program_start=program_start, main_entry=main_entry)

        def training_log(loss_dict, total_loss_dict, learning_rate, iteration, loss_scale,
                         report_memory_flag, skipped_iter, grad_norm, params_norm,
                         num_zeros_in_grad, max_attention_logit, pg_collection=None,
                         is_first_iteration=False):
            return report_memory_flag

        def pretrain(train_valid_test_dataset_provider, model_provider, model_type,
                     forward_step_func, process_non_loss_data_func=None,
                     extra_args_provider=None, args_defaults={}, get_embedding_ranks=None,
                     get_position_embedding_ranks=None, non_loss_data_func=None, store=None,
                     inprocess_call_wrapper=None):
            args = parse_args(extra_args_provider)
            validate_args(args, args_defaults)
            global_vars.set_args(args)
            model = model_provider(pre_process=True, post_process=True)
            for iteration in range(1, args.train_iters + 1):
                loss = forward_step_func(iteration, model)
                training_log({'lm loss': loss}, {}, args.lr, iteration, 1.0, True, 0, 1.0, None,
                             None, None)
            record = os.environ.get('FAKE_MEGATRON_RECORD')
            if record:
                with open(record, 'w') as f:
                    json.dump(dict(args=vars(args), model=model, startup=_STARTUP,
                                   embedding_ranks=get_embedding_ranks([0, 1]),
                                   is_distributed=getattr(train_valid_test_dataset_provider,
                                                          'is_distributed', False)), f)
        """,
    "megatron/training/inprocess_restart.py": """
        def maybe_wrap_for_inprocess_restart(pretrain):
            return pretrain, None
        """,
    "megatron/training/utils.py": """
        def get_batch_on_this_tp_rank(data_iterator):
            return next(data_iterator)
        """,
    "megatron/post_training/arguments.py": """
        def add_modelopt_args(parser):
            group = parser.add_argument_group(title='modelopt-generic')
            group.add_argument('--export-te-mcore-model', action='store_true')
            return parser
        """,
    "megatron/post_training/loss_func.py": """
        def loss_func(loss_mask, output_tensor, model=None):
            return output_tensor
        """,
    "model_provider.py": """
        from megatron.training import get_args

        def model_provider(model_builder, pre_process=True, post_process=True, vp_stage=None,
                           config=None, pg_collection=None):
            args = get_args()
            return model_builder(args, pre_process, post_process, vp_stage, config=config,
                                 pg_collection=pg_collection)
        """,
    "gpt_builders.py": """
        from megatron_oases import patches

        def gpt_builder(args, pre_process, post_process, vp_stage=None, config=None,
                        pg_collection=None):
            # What the real builder would see: which patches are in place when the model is built.
            return {'patches_at_build': sorted(patches.installed()),
                    'transformer_impl': args.transformer_impl}
        """,
    "pretrain_gpt.py": '''
        """Stand-in for Megatron-LM core_v0.16.0 pretrain_gpt.py: same names, no CUDA, no data."""

        import time
        _PROGRAM_START_TIME = time.time()

        from functools import partial

        from gpt_builders import gpt_builder
        from megatron.core.enums import ModelType
        from megatron.training import (
            get_args,
            inprocess_restart,
            pretrain,
            set_startup_timestamps,
        )
        from megatron.training.utils import (
            get_batch_on_this_tp_rank,
        )
        from model_provider import model_provider

        try:
            from megatron.post_training.arguments import add_modelopt_args
            from megatron.post_training.loss_func import loss_func as loss_func_modelopt

            has_nvidia_modelopt = True
        except ImportError:
            has_nvidia_modelopt = False


        def forward_step(iteration, model):
            return 7.0 - iteration


        def train_valid_test_datasets_provider(train_val_test_num_samples, vp_stage=None):
            return None, None, None


        def get_embedding_ranks(pp_ranks):
            return [pp_ranks[0], pp_ranks[-1]]


        if __name__ == "__main__":
            # Timestamp right after entering __main__ block (after all imports/library setup)
            _MAIN_ENTRY_TIME = time.time()

            # Register startup timestamps for timing report in pretrain()
            set_startup_timestamps(program_start=_PROGRAM_START_TIME, main_entry=_MAIN_ENTRY_TIME)

            # Temporary for transition to core datasets
            train_valid_test_datasets_provider.is_distributed = True

            # Optionally enable inprocess restart on pretrain
            pretrain, store = inprocess_restart.maybe_wrap_for_inprocess_restart(pretrain)

            pretrain(
                train_valid_test_datasets_provider,
                partial(model_provider, gpt_builder),
                ModelType.encoder_or_decoder,
                forward_step,
                args_defaults={'tokenizer_type': 'GPT2BPETokenizer'},
                extra_args_provider=add_modelopt_args if has_nvidia_modelopt else None,
                store=store,
                get_embedding_ranks=get_embedding_ranks,
            )
        ''',
}

FAKE_MODULES = (
    "megatron.training",
    "megatron.post_training",
    "pretrain_gpt",
    "gpt_builders",
    "model_provider",
)


def write_fake_megatron_lm(root):
    for rel, text in FAKE_FILES.items():
        path = os.path.join(root, rel)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "w") as f:
            f.write(textwrap.dedent(text).lstrip("\n"))
    return root


def _drop_fake_modules():
    for name in list(sys.modules):
        if any(name == m or name.startswith(m + ".") for m in FAKE_MODULES):
            del sys.modules[name]


@pytest.fixture
def fake_megatron_lm(tmp_path, monkeypatch):
    """A Megatron-LM-shaped checkout on sys.path (namespace ``megatron`` beside the wheel)."""
    root = write_fake_megatron_lm(str(tmp_path / "Megatron-LM"))
    _drop_fake_modules()
    monkeypatch.syspath_prepend(root)
    monkeypatch.setenv("FAKE_MEGATRON_RECORD", str(tmp_path / "record.json"))
    monkeypatch.delenv("MEGATRON_LM_DIR", raising=False)
    saved_argv = list(sys.argv)
    yield root
    sys.argv[:] = saved_argv
    megatron_lm.uninstall_patches()
    _drop_fake_modules()


def _clean_env(**extra):
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "MEGATRON_LM_DIR")}
    env["PYTHONPATH"] = REPO
    env.update(extra)
    return env


# ------------------------------------------------------------ Megatron-style argparse + chaining


def megatron_style_parse(argv, extra_args_provider=None):
    """Parse the way Megatron-LM's ``parse_args`` does (allow_abbrev=False, provider hook)."""
    parser = argparse.ArgumentParser(description="Megatron-LM Arguments", allow_abbrev=False)
    g = parser.add_argument_group(title="transformer configuration")
    g.add_argument(
        "--transformer-impl",
        default="transformer_engine",
        choices=["local", "transformer_engine", "inference_optimized"],
    )
    g.add_argument("--recompute-granularity", default=None, choices=["full", "selective"])
    g.add_argument("--recompute-method", default=None, choices=["uniform", "block"])
    g.add_argument("--recompute-num-layers", type=int, default=None)
    g.add_argument("--micro-batch-size", type=int, default=None)
    g.add_argument("--tensor-model-parallel-size", type=int, default=1)
    g.add_argument("--log-interval", type=int, default=100)
    if extra_args_provider is not None:
        parser = extra_args_provider(parser)
    return parser, parser.parse_args(argv)


def _oases_group_flags(parser):
    for group in parser._action_groups:
        if group.title == "oases":
            return {s for a in group._group_actions for s in a.option_strings}
    return set()


def test_chained_provider_keeps_existing_provider():
    calls = []

    def modelopt_provider(parser):
        calls.append("modelopt")
        parser.add_argument_group("modelopt").add_argument(
            "--export-te-mcore-model", action="store_true"
        )
        return parser

    def provider_returning_none(parser):  # tolerated: the parser is kept
        calls.append("none")
        parser.add_argument("--my-fork-flag", type=int, default=3)

    provider = megatron_lm.chain_extra_args_providers(
        modelopt_provider, None, provider_returning_none, megatron_lm.add_args
    )
    parser, args = megatron_style_parse(
        [
            "--export-te-mcore-model",
            "--oases-schedule",
            "overlap",
            "--micro-batch-size",
            "2",
            "--log-json",
            "g.json",
            "--my-fork-flag",
            "5",
        ],
        provider,
    )
    assert calls == ["modelopt", "none"]
    assert args.export_te_mcore_model and args.my_fork_flag == 5
    assert args.oases_schedule == "overlap" and args.log_json == "g.json"
    # Same oases flags as `oases train`, in a group named oases.
    assert _oases_group_flags(parser) == _oases_group_flags(build_parser())
    assert {"--oases-schedule", "--oases-trace"} <= _oases_group_flags(parser)
    # Nothing given: stock behaviour.
    _, args = megatron_style_parse([], megatron_lm.extra_args_provider(None))
    assert args.oases_schedule == "off" and args.log_json is None


def test_add_oases_args_does_not_clash_with_megatron_flag_names():
    # argparse raises on a duplicate option string; abbreviations are off as in Megatron-LM.
    parser, _ = megatron_style_parse([], megatron_lm.extra_args_provider(None))
    with pytest.raises(SystemExit):
        parser.parse_args(["--oases-sched", "overlap"])


@pytest.mark.parametrize(
    "argv,expected",
    [
        ([], ["--transformer-impl", "local"]),
        (
            ["--transformer-impl", "local", "--lr", "1"],
            ["--transformer-impl", "local", "--lr", "1"],
        ),
        (["--transformer-impl=local"], ["--transformer-impl=local"]),
    ],
)
def test_force_local_transformer_impl(argv, expected):
    assert megatron_lm.force_local_transformer_impl(argv) == expected


@pytest.mark.parametrize(
    "argv",
    [["--transformer-impl", "transformer_engine"], ["--transformer-impl=inference_optimized"]],
)
def test_force_local_transformer_impl_rejects_other_values(argv):
    with pytest.raises(OasesConfigError, match="use --transformer-impl local"):
        megatron_lm.force_local_transformer_impl(argv)


@pytest.mark.parametrize(
    "argv,match",
    [
        (["--transformer-impl", "transformer_engine"], "use --transformer-impl local"),
        (
            ["--oases-schedule", "oases", "--micro-batch-size", "2"],
            "add --recompute-granularity full",
        ),
        (["--oases-schedule", "overlap", "--micro-batch-size", "1"], "cannot be split"),
        (["--oases-schedule", "overlap"], "set --micro-batch-size"),
        (
            [
                "--oases-schedule",
                "cross-pass",
                "--micro-batch-size",
                "2",
                "--recompute-granularity",
                "full",
                "--recompute-method",
                "block",
            ],
            "--recompute-method uniform",
        ),
    ],
)
def test_validate_megatron_args_rejects(argv, match):
    argv = argv if "--transformer-impl" in argv else argv + ["--transformer-impl", "local"]
    _, args = megatron_style_parse(argv, megatron_lm.extra_args_provider(None))
    with pytest.raises(OasesConfigError, match=re.escape(match)):
        megatron_lm.validate_megatron_args(args)


def test_validate_megatron_args_accepts():
    for argv in (
        ["--transformer-impl", "local"],
        ["--transformer-impl", "local", "--oases-schedule", "overlap", "--micro-batch-size", "2"],
        [
            "--transformer-impl",
            "local",
            "--oases-schedule",
            "oases",
            "--micro-batch-size",
            "4",
            "--recompute-granularity",
            "full",
            "--recompute-method",
            "uniform",
            "--recompute-num-layers",
            "1",
        ],
    ):
        _, args = megatron_style_parse(argv, megatron_lm.extra_args_provider(None))
        assert megatron_lm.validate_megatron_args(args) is args


# ------------------------------------------------------------------------- the install hook


@pytest.fixture
def recording_patch(monkeypatch):
    """Register a patch factory that records the args it was built from (in PATCH_FACTORIES)."""
    seen = {}
    target = types.SimpleNamespace(value="stock")
    module = types.ModuleType("_oases_test_recording_patch")

    def make_patch(args):
        seen["args"] = args
        return patches.Patch("test-recording", [(target, "value", "patched")])

    module.make_patch = make_patch
    monkeypatch.setitem(sys.modules, module.__name__, module)
    monkeypatch.setitem(patches.PATCH_FACTORIES, "test-recording", f"{module.__name__}:make_patch")
    return seen, target


def test_wrap_builder_installs_patches_once_before_the_model(recording_patch):
    seen, target = recording_patch
    _, args = megatron_style_parse(
        ["--transformer-impl", "local"], megatron_lm.extra_args_provider(None)
    )
    built = []

    def gpt_builder(args, pre_process, post_process, vp_stage=None, config=None):
        built.append((target.value, pre_process, post_process, vp_stage))
        return "model"

    builder = megatron_lm.wrap_builder(gpt_builder, args_getter=lambda: args)
    try:
        assert builder(args, True, False, vp_stage=0) == "model"
        assert builder(None, False, True, vp_stage=1) == "model"  # args from the getter
        assert built == [("patched", True, False, 0), ("patched", False, True, 1)]
        assert seen["args"] is args
        assert "test-recording" in patches.installed()
    finally:
        megatron_lm.uninstall_patches()
    assert target.value == "stock" and patches.installed() == []


def test_install_patches_validates_first(recording_patch):
    seen, target = recording_patch
    _, args = megatron_style_parse([], megatron_lm.extra_args_provider(None))  # TE default
    with pytest.raises(OasesConfigError, match="use --transformer-impl local"):
        megatron_lm.install_patches(args)
    assert "args" not in seen and target.value == "stock"


def test_golden_values_recorder(tmp_path):
    path = str(tmp_path / "sub" / "golden.json")
    rec = megatron_lm.GoldenValuesRecorder(path)
    rec.record(1, 5.0, now=10.0)
    rec.record(2, 4.5, now=10.25, mem_bytes=100)
    rec.record(3, None, now=10.5)  # a rank without the loss contributes nothing
    rec.write()
    with open(path) as f:
        data = json.load(f)
    assert data["lm loss"] == {
        "start_step": 1,
        "end_step": 2,
        "step_interval": 1,
        "values": [5.0, 4.5],
    }
    assert data["iteration-time"]["values"] == [None, 0.25]
    assert data["mem-allocated-bytes"]["values"] == [None, 100]


def test_golden_values_patch_wraps_training_log(tmp_path):
    import torch

    calls = []
    module = types.SimpleNamespace(training_log=lambda *a, **k: calls.append(a[3]) or "flag")
    path = str(tmp_path / "g.json")
    patch = megatron_lm.golden_values_patch(path, module, is_logging_rank=lambda: True)
    patch.install()
    try:
        for it in (1, 2, 3):
            assert (
                module.training_log(
                    {"lm loss": torch.tensor([3.0 - it])},
                    {},
                    1e-4,
                    it,
                    1.0,
                    True,
                    0,
                    1.0,
                    None,
                    None,
                    None,
                )
                == "flag"
            )
        module.training_log({}, {}, 1e-4, 4, 1.0, True, 0, 1.0, None, None, None)
    finally:
        patch.uninstall()
    assert calls == [1, 2, 3, 4]
    with open(path) as f:
        assert json.load(f)["lm loss"]["values"] == [2.0, 1.0, 0.0]


# ------------------------------------------------------------------- oases-pretrain-gpt / run


def test_pretrain_gpt_oases_on_megatron_lm_shaped_checkout(
    fake_megatron_lm, recording_patch, tmp_path
):
    from megatron_oases import pretrain_gpt_oases

    seen, target = recording_patch
    golden = str(tmp_path / "golden.json")
    rc = pretrain_gpt_oases.main(TINY + ["--log-json", golden, "--export-te-mcore-model"])
    assert rc == 0
    with open(os.environ["FAKE_MEGATRON_RECORD"]) as f:
        record = json.load(f)
    args = record["args"]
    assert args["transformer_impl"] == "local"  # forced
    assert args["export_te_mcore_model"] is True  # ModelOpt's provider kept
    assert args["oases_schedule"] == "off" and args["tokenizer_type"] == "NullTokenizer"
    # Patches were in place when the model was built, reverted afterwards.
    assert record["model"] == {
        "patches_at_build": sorted(["test-recording", "megatron-lm-golden-values"]),
        "transformer_impl": "local",
    }
    assert seen["args"].log_json == golden
    assert patches.installed() == [] and target.value == "stock"
    assert record["embedding_ranks"] == [0, 1] and record["is_distributed"] is True
    assert record["startup"]["program_start"] is not None
    with open(golden) as f:
        data = json.load(f)
    assert data["lm loss"]["values"] == [6.0, 5.0, 4.0]
    assert data["lm loss"]["start_step"] == 1 and data["lm loss"]["end_step"] == 3
    assert sys.argv[1:] != TINY  # sys.argv restored to pytest's


def test_pretrain_gpt_oases_bad_flags_fail_before_pretrain(fake_megatron_lm):
    from megatron_oases import pretrain_gpt_oases

    for extra, match in (
        (["--oases-schedule", "oases"], "add --recompute-granularity full"),
        (["--transformer-impl", "transformer_engine"], "use --transformer-impl local"),
    ):
        with pytest.raises(OasesConfigError, match=re.escape(match)):
            pretrain_gpt_oases.main(TINY + extra)
        assert not os.path.exists(os.environ["FAKE_MEGATRON_RECORD"])


def _one_error_line(proc, prefix):
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert proc.returncode == 2, proc.stderr
    assert len(lines) == 1 and lines[0].startswith(prefix), proc.stderr
    return lines[0]


@pytest.mark.parametrize(
    "cmd,prefix",
    [
        (["-m", "megatron_oases.pretrain_gpt_oases"], "oases-pretrain-gpt: error: "),
        (["-m", "megatron_oases", "run"], "oases run: error: "),
        (
            [
                "-c",
                "import sys; from megatron_oases.pretrain_gpt_oases import console_main; "
                "sys.exit(console_main())",
            ],
            "oases-pretrain-gpt: error: ",
        ),
    ],
)
def test_without_megatron_lm_one_clear_line(cmd, prefix):
    proc = subprocess.run(
        [sys.executable, *cmd, *TINY],
        capture_output=True,
        text=True,
        timeout=120,
        env=_clean_env(),
        cwd=REPO,
    )
    line = _one_error_line(proc, prefix)
    assert "Megatron-LM is not importable" in line and "core_v0.16.0" in line
    assert "git clone --branch core_v0.16.0 https://github.com/NVIDIA/Megatron-LM" in line


def test_megatron_lm_dir_without_pretrain_gpt(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "megatron_oases.pretrain_gpt_oases", *TINY],
        capture_output=True,
        text=True,
        timeout=120,
        env=_clean_env(MEGATRON_LM_DIR=str(tmp_path)),
        cwd=REPO,
    )
    line = _one_error_line(proc, "oases-pretrain-gpt: error: ")
    assert "has no pretrain_gpt.py" in line and "core_v0.16.0" in line


def test_console_script_and_cli_registered():
    from megatron_oases.cli import COMMANDS

    with open(os.path.join(REPO, "setup.py")) as f:
        setup_py = f.read()
    match = re.search(r'"oases-pretrain-gpt=([\w.]+):(\w+)"', setup_py)
    assert match, "console script oases-pretrain-gpt missing from setup.py"
    module = __import__(match.group(1), fromlist=[match.group(2)])
    assert callable(getattr(module, match.group(2)))
    assert COMMANDS["run"][0] == "megatron_oases.pretrain_gpt_oases:main"


# ----------------------------------------------------------------------------------- patches/


def _git(*args, cwd):
    return subprocess.run(["git", *args], cwd=cwd, capture_output=True, text=True, timeout=60)


def test_patch_only_touches_pretrain_gpt_and_calls_existing_helpers():
    with open(PATCH) as f:
        text = f.read()
    assert re.findall(r"^diff --git a/(\S+) b/(\S+)$", text, re.M) == [
        ("pretrain_gpt.py", "pretrain_gpt.py")
    ]
    for name in set(re.findall(r"oases_megatron_lm\.(\w+)", text)):
        assert callable(getattr(megatron_lm, name)), name


def test_patch_applies_and_patched_script_runs(tmp_path):
    """git apply the patch to the stand-in checkout, then run the patched pretrain_gpt.py."""
    root = write_fake_megatron_lm(str(tmp_path / "Megatron-LM"))
    assert _git("init", "-q", cwd=root).returncode == 0
    check = _git("apply", "--check", "-v", PATCH, cwd=root)
    assert check.returncode == 0, check.stderr
    assert _git("apply", PATCH, cwd=root).returncode == 0
    assert _git("apply", "-R", "--check", PATCH, cwd=root).returncode == 0
    # Megatron-Core's import-time warnings (no TE/Apex) would precede our line, as in Megatron-LM.
    env = _clean_env(PYTHONPATH=os.pathsep.join([root, REPO]), PYTHONWARNINGS="ignore")
    golden = str(tmp_path / "golden.json")
    record = str(tmp_path / "record.json")
    proc = subprocess.run(
        [
            sys.executable,
            "pretrain_gpt.py",
            *TINY,
            "--log-json",
            golden,
            "--oases-schedule",
            "overlap",
        ],
        cwd=root,
        capture_output=True,
        text=True,
        timeout=120,
        env=dict(env, FAKE_MEGATRON_RECORD=record),
    )
    assert proc.returncode == 0, proc.stderr
    with open(record) as f:
        rec = json.load(f)
    assert rec["args"]["transformer_impl"] == "local"
    assert rec["args"]["oases_schedule"] == "overlap"
    assert "oases-schedule" in rec["model"]["patches_at_build"]
    assert "megatron-lm-golden-values" in rec["model"]["patches_at_build"]
    with open(golden) as f:
        assert json.load(f)["lm loss"]["values"] == [6.0, 5.0, 4.0]


def test_prepare_or_exit_one_line_exit_2(fake_megatron_lm, capsys):
    """What the patched pretrain_gpt.py calls before pretrain(): bad flags ⇒ one line, exit 2."""
    sys.argv[:] = ["pretrain_gpt.py", *TINY, "--oases-schedule", "cross-pass"]
    with pytest.raises(SystemExit) as exc:
        megatron_lm.prepare_or_exit(None)
    assert exc.value.code == 2
    err = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]
    assert err == [
        "pretrain_gpt.py: error: --oases-schedule cross-pass merges recompute with backward; add "
        "--recompute-granularity full or use --oases-schedule overlap"
    ]
    sys.argv[:] = ["pretrain_gpt.py", *TINY]
    provider = megatron_lm.prepare_or_exit(None)
    assert sys.argv[-2:] == ["--transformer-impl", "local"] and provider.providers[-1] is (
        megatron_lm.add_args
    )


# ------------------------------------------------------------------------- configs and scripts

TABLE4 = {  # H: (L, heads, TMP, DP, global batch) — Oases paper, Appendix B.2
    1024: (24, 16, 2, 16, 256),
    2048: (24, 32, 4, 8, 128),
    3072: (24, 48, 4, 8, 32),
    4096: (16, 64, 4, 8, 32),
    6144: (16, 96, 8, 4, 8),
    8192: (8, 128, 8, 4, 8),
    12288: (4, 192, 8, 4, 8),
}
TABLE5 = {  # name: (H, L, heads, PP, TP, DP, micro-batch, billions of parameters)
    "gpt-18.4b": (6144, 40, 48, 4, 4, 2, 2, 18.4),
    "gpt-39.1b": (8192, 48, 64, 4, 8, 1, 2, 39.1),
}


def _validated(cfg, world_size, extra=()):
    argv = configs.model_flags(cfg) + ["--mock-data", *extra]
    return validate_args(build_parser().parse_args(argv), world_size, cuda_available=True)


@pytest.mark.parametrize("hidden", sorted(TABLE4))
def test_table4_model_configs(hidden):
    layers, heads, tp, dp, gbs = TABLE4[hidden]
    cfg = configs.load_model_config(f"h{hidden}-l{layers}")
    assert (cfg["model"]["hidden-size"], cfg["model"]["num-layers"]) == (hidden, layers)
    assert cfg["model"]["num-attention-heads"] == heads and cfg["model"]["seq-length"] == 1024
    assert cfg["parallel"]["tensor-model-parallel-size"] == tp
    assert cfg["training"]["global-batch-size"] == gbs and cfg["paper"]["gpus"] == tp * dp == 32
    args = _validated(cfg, world_size=32)  # `oases train` accepts every flag, on 32 ranks
    assert args.data_parallel_size == dp and args.num_microbatches == 1


@pytest.mark.parametrize("name", sorted(TABLE5))
def test_table5_model_configs(name):
    hidden, layers, heads, pp, tp, dp, mbs, billions = TABLE5[name]
    cfg = configs.load_model_config(name)
    m = cfg["model"]
    assert (m["hidden-size"], m["num-layers"], m["num-attention-heads"]) == (hidden, layers, heads)
    assert cfg["parallel"] == {"tensor-model-parallel-size": tp, "pipeline-model-parallel-size": pp}
    assert cfg["training"]["micro-batch-size"] == mbs
    assert configs.parameter_count(cfg) / 1e9 == pytest.approx(billions, abs=0.1)
    assert _validated(cfg, world_size=pp * tp * dp).data_parallel_size == dp


def test_tiny_cpu_config_and_flag_rendering():
    cfg = configs.load_model_config("tiny-cpu")
    assert _validated(cfg, world_size=2).tensor_model_parallel_size == 2
    assert configs.to_flags({"a_b": 1, "swiglu": True, "bias": False, "x": None, "l": [1, 2]}) == [
        "--a-b",
        "1",
        "--swiglu",
        "--l",
        "1",
        "2",
    ]
    with pytest.raises(OasesConfigError, match="unknown model config 'nope'"):
        configs.load_model_config("nope")


def test_compare_matrix_runs_are_valid_oases_train_flags():
    path = os.path.join(REPO, "configs", "compare_matrix.yaml")
    for name in ("ci", "cpu-demo"):
        matrix = configs.load_matrix(path, name)
        runs = configs.expand_matrix(matrix)
        assert {r["schedule"] for r in runs} >= {"off", "oases"}
        assert any(r["variant"] == matrix["baseline"] for r in runs)
        cfg = configs.load_model_config(matrix["model"])
        for run in runs:
            extra = [
                "--tensor-model-parallel-size",
                str(run["tp"]),
                "--pipeline-model-parallel-size",
                str(run["pp"]),
                "--oases-schedule",
                run["schedule"],
                *run["args"],
            ]
            _validated(cfg, world_size=matrix["gpus-per-node"], extra=extra)
    for name in ("paper-h4096-l16", "paper-gpt-18.4b"):
        matrix = configs.load_matrix(path, name)
        configs.load_model_config(matrix["model"])
        assert len(configs.expand_matrix(matrix)) == len(matrix["layouts"]) * len(
            matrix["variants"]
        )
    assert configs.load_matrix(path)["name"] == "cpu-demo"


def test_summary_table(tmp_path):
    def golden(losses, times):
        p = tmp_path / f"g{len(os.listdir(tmp_path))}.json"
        p.write_text(
            json.dumps(
                {
                    "lm loss": {
                        "start_step": 1,
                        "end_step": len(losses),
                        "step_interval": 1,
                        "values": losses,
                    },
                    "iteration-time": {
                        "start_step": 1,
                        "end_step": len(times),
                        "step_interval": 1,
                        "values": times,
                    },
                }
            )
        )
        return str(p)

    runs = tmp_path / "runs.tsv"
    rows = [
        ("megatron-tp2-pp1", 2, 1, "off", "ok", golden([6.0, 5.0, 4.0], [None, 0.2, 0.2])),
        ("oases-tp2-pp1", 2, 1, "oases", "ok", golden([6.0, 5.0, 4.5], [0.9, 0.1, 0.1])),
        ("oases-tp1-pp2", 1, 2, "oases", "failed(1)", str(tmp_path / "missing.json")),
    ]
    runs.write_text("".join("\t".join(map(str, r)) + "\n" for r in rows))
    table = configs.summary_table(configs.read_runs_file(str(runs)), baseline="megatron")
    lines = table.splitlines()
    assert lines[0].startswith("| run | schedule | TP | PP | status |") and len(lines) == 5
    assert lines[2].split("|")[1:-1] == [
        " megatron-tp2-pp1 ",
        " off ",
        " 2 ",
        " 1 ",
        " ok ",
        " 3 ",
        " 4.000000 ",
        " 200.0 ",
        " - ",
        " 1.00 ",
    ]
    assert "| 100.0 | - | 2.00 |" in lines[3]
    assert "| failed(1) | 0 | - | - | - | - |" in lines[4]


def test_helper_cli_for_bash():
    def run(*args):
        return subprocess.run(
            [sys.executable, "-m", "megatron_oases.megatron_lm", *args],
            capture_output=True,
            text=True,
            timeout=60,
            cwd=REPO,
        )

    out = run("flags", "tiny-cpu", "--section", "model")
    assert out.returncode == 0 and out.stdout.split()[:2] == ["--num-layers", "2"]
    assert run("get", "gpt-18.4b", "parallel.pipeline-model-parallel-size").stdout.strip() == "4"
    assert run("get", "tiny-cpu", "training.nope", "7").stdout.strip() == "7"
    out = run("matrix", "configs/compare_matrix.yaml", "ci")
    lines = out.stdout.strip().splitlines()
    assert [ln.split("\t")[:4] for ln in lines] == [
        ["megatron-tp2-pp1", "2", "1", "off"],
        ["oases-tp2-pp1", "2", "1", "oases"],
    ]
    assert (
        run("matrix", "configs/compare_matrix.yaml", "ci", "--field", "baseline").stdout.strip()
        == "megatron"
    )
    bad = run("matrix", "configs/compare_matrix.yaml", "nope")
    assert bad.returncode == 2 and "no matrix 'nope'" in bad.stderr


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_cpu_demo_script(tmp_path):
    """launch_scripts/run_cpu_demo.sh: 2 gloo ranks, tiny model, no SLURM."""
    golden = str(tmp_path / "demo.json")
    env = dict(
        os.environ,
        PYTHON=sys.executable,
        TRAIN_ITERS="2",
        LOG_JSON=golden,
        PATH=os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", ""),
    )
    proc = subprocess.run(
        ["bash", os.path.join(REPO, "launch_scripts", "run_cpu_demo.sh")],
        capture_output=True,
        text=True,
        timeout=230,
        env=env,
        cwd=str(tmp_path),
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "entry=oases-train model=tiny-cpu device=cpu" in proc.stdout
    assert re.search(r"^lm loss: [\d.]+ [\d.]+$", proc.stdout, re.M), proc.stdout
    with open(golden) as f:
        assert len(json.load(f)["lm loss"]["values"]) == 2


def test_launch_scripts_are_valid_bash():
    for name in ("slurm_pretrain_gpt_oases.sh", "compare_vs_megatron.sh", "run_cpu_demo.sh"):
        path = os.path.join(REPO, "launch_scripts", name)
        assert os.access(path, os.X_OK), f"{name} is not executable"
        assert subprocess.run(["bash", "-n", path], capture_output=True).returncode == 0
    with open(os.path.join(REPO, "launch_scripts", "slurm_pretrain_gpt_oases.sh")) as f:
        text = f.read()
    for needle in (
        "#SBATCH",
        "scontrol show hostnames",
        "GPUS_PER_NODE",
        "NUM_NODES",
        "CUDA_DEVICE_MAX_CONNECTIONS",
        "--kill-on-bad-exit",
        "DISTRIBUTED_ARGS=(",
        "GPT_MODEL_ARGS",
        "MODEL_PARALLEL_ARGS=(",
        "TRAINING_ARGS=(",
        "OASES_ARGS=(",
    ):
        assert needle in text, needle
    assert shutil.which("bash")
