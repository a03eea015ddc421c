"""Bad input ⇒ one clear error line naming the fix, and a non-zero exit."""

import subprocess
import sys

import pytest

from megatron_oases.arguments import build_parser, validate_args
from megatron_oases.compat import check_megatron_core
from megatron_oases.errors import OasesConfigError


def validate(argv, world_size=1, cuda=False):
    return validate_args(build_parser().parse_args(argv.split()), world_size, cuda_available=cuda)


@pytest.mark.parametrize(
    "argv,world,match",
    [
        ("--hidden-size 65 --num-attention-heads 4", 1, "not divisible by --num-attention-heads"),
        (
            "--hidden-size 96 --num-attention-heads 6 --tensor-model-parallel-size 4",
            4,
            "--num-attention-heads 6 is not divisible by TP=4",
        ),
        (
            "--tensor-model-parallel-size 2 --pipeline-model-parallel-size 2",
            6,
            "world size 6 is not divisible by TP×PP",
        ),
        ("--micro-batch-size 2 --global-batch-size 6", 2, "--global-batch-size 6 is not divisible"),
        ("--transformer-impl transformer_engine", 1, "use --transformer-impl local"),
        ("--num-layers 3 --pipeline-model-parallel-size 2", 2, "--num-layers 3 is not divisible"),
        (
            "--oases-schedule overlap --micro-batch-size 1",
            1,
            "micro-batch 1 cannot be split; use --micro-batch-size ≥ 2 or --oases-schedule off",
        ),
        ("--oases-schedule oases", 1, "add --recompute-granularity full"),
        ("--sequence-parallel", 1, "--sequence-parallel is not supported"),
        ("--context-parallel-size 2", 2, "context-parallel"),
        ("--num-experts 4", 1, "MoE"),
        ("--distributed-backend nccl", 1, "needs CUDA"),
        ("--bf16", 1, "need CUDA"),
    ],
)
def test_bad_input_is_rejected(argv, world, match):
    with pytest.raises(OasesConfigError, match=match.replace("(", r"\(").replace("×", "×")):
        validate(argv, world)


def test_defaults_follow_megatron():
    args = validate("--hidden-size 64 --num-attention-heads 4 --micro-batch-size 2", 4)
    assert args.ffn_hidden_size == 256 and args.num_query_groups == 4
    assert args.global_batch_size == 8 and args.num_microbatches == 1
    assert args.distributed_backend == "gloo" and args.padded_vocab_size == 512
    args = validate(
        "--recompute-granularity full --tensor-model-parallel-size 2 --vocab-size 300", 2
    )
    assert args.recompute_method == "uniform" and args.recompute_num_layers == 1
    assert args.padded_vocab_size == 512


@pytest.mark.parametrize("version", ["0.15.3", "0.17.0", "1.0.0"])
def test_megatron_version_outside_range(version):
    with pytest.raises(OasesConfigError, match="outside the tested range >=0.16,<0.17"):
        check_megatron_core(version)
    assert check_megatron_core("0.16.1") == "0.16.1"


def _cli(code):
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)


def test_cli_reports_one_line_and_exit_code():
    proc = _cli(
        "import sys; from megatron_oases.cli import main; "
        "sys.exit(main(['train', '--hidden-size', '65']))"
    )
    assert proc.returncode == 2
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert lines == [
        "oases train: error: --hidden-size 65 is not divisible by " "--num-attention-heads 4"
    ]


def test_cli_rejects_unsupported_megatron_version():
    proc = _cli(
        "import sys, megatron_oases.compat as c; c.megatron_core_version = lambda: '0.15.0'; "
        "from megatron_oases.cli import main; sys.exit(main(['train']))"
    )
    assert proc.returncode == 2
    assert proc.stderr.strip().count("\n") == 0
    assert "megatron-core 0.15.0 is outside the tested range" in proc.stderr


def test_cli_transformer_engine_on_cpu():
    proc = _cli(
        "import sys; from megatron_oases.cli import main; "
        "sys.exit(main(['train', '--transformer-impl', 'transformer_engine']))"
    )
    assert proc.returncode == 2 and "use --transformer-impl local" in proc.stderr
