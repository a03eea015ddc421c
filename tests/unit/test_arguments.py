"""Bad input ⇒ one clear error line naming the fix and a non-zero exit, before anything starts.

Parsing is Megatron-LM's own (``parse_args`` + ``validate_args``, their assertions turned into one
line) plus the Oases rules and the size checks Megatron makes only when it builds the model."""

import pytest
from helpers.runs import parse

from megatron_oases.compat import check_megatron_core, megatron_core_version
from megatron_oases.errors import OasesConfigError


@pytest.mark.parametrize(
    "argv,world,match",
    [
        ("--hidden-size 65 --num-attention-heads 4", 1, "--hidden-size 65 is not divisible by"),
        (
            "--hidden-size 96 --num-attention-heads 6 --tensor-model-parallel-size 4",
            4,
            "--num-attention-heads 6 is not divisible by --tensor-model-parallel-size 4",
        ),
        (
            "--tensor-model-parallel-size 2 --pipeline-model-parallel-size 2",
            6,
            "world size (6) is not divisible by total_model_size",
        ),
        ("--micro-batch-size 2 --global-batch-size 6", 2, "must be divisible by"),
        ("--transformer-impl transformer_engine", 1, "use --transformer-impl local"),
        ("--num-layers 3 --pipeline-model-parallel-size 2", 2, "Number of layers should be"),
        (
            "--oases-schedule overlap --micro-batch-size 1",
            1,
            "micro-batch 1 cannot be split; use --micro-batch-size ≥ 2, --oases-split sequence "
            "(sub-batches of sequence chunks) or --oases-schedule off",
        ),
        (
            "--oases-schedule overlap --micro-batch-size 1 --oases-split sequence "
            "--sequence-parallel --tensor-model-parallel-size 2",
            2,
            "--oases-split sequence does not support --sequence-parallel; drop it or use "
            "--oases-split batch",
        ),
        (
            "--oases-schedule overlap --oases-split sequence --attention-backend flash",
            1,
            "--oases-split sequence needs Megatron's unfused attention",
        ),
        (
            "--oases-schedule overlap --oases-split sequence --seq-length 1 "
            "--max-position-embeddings 1",
            1,
            "--seq-length 1 cannot be cut into 2 chunks; use --oases-split batch",
        ),
        ("--oases-schedule overlap --oases-split rows", 1, "invalid choice: 'rows'"),
        ("--oases-schedule oases", 1, "add --recompute-granularity full"),
        (
            "--oases-schedule oases --recompute-granularity full --recompute-method uniform "
            "--recompute-num-layers 2",
            1,
            "--oases-schedule oases recomputes one layer per checkpoint; use --recompute-method "
            "uniform --recompute-num-layers 1 (every layer), or --recompute-method block "
            "--recompute-num-layers N (a stage's first N layers)",
        ),
        (
            "--oases-schedule overlap --recompute-granularity selective "
            "--recompute-modules core_attn mlp",
            1,
            "supports --recompute-modules core_attn layernorm only (got mlp)",
        ),
        (
            "--oases-schedule oases --recompute-granularity selective",
            1,
            "merges recompute with backward; add --recompute-granularity full",
        ),
        (
            "--oases-plan plan.json --sequence-parallel --tensor-model-parallel-size 2",
            2,
            "--oases-plan does not support --sequence-parallel",
        ),
        ("--oases-schedule overlap --context-parallel-size 2", 2, "context-parallel"),
        ("--oases-schedule overlap --num-experts 4", 1, "MoE"),
        ("--oases-schedule overlap --oases-sub-batches 1", 1, "--oases-sub-batches 1 must be in"),
        (
            "--oases-schedule overlap --micro-batch-size 2 --oases-sub-batches 3",
            1,
            "micro-batch 2 cannot be split; use --micro-batch-size ≥ 3",
        ),
        ("--micro-batch-size 0", 1, "--micro-batch-size 0 must be >= 1"),
        ("--num-attention-heads 0", 1, "--num-attention-heads 0 must be >= 1"),
        ("--hidden-dropout 1.5", 1, r"--hidden-dropout 1.5 must be in \[0, 1\)"),
        ("--train-iters -5", 1, "--train-iters -5 must be >= 1"),
        ("--log-interval 0", 1, "--log-interval 0 must be >= 1"),
        ("--vocab-size 0", 1, "--vocab-size 0 must be >= 1"),
        ("--eval-interval 0", 1, "--eval-interval 0 must be >= 1"),
        ("--make-vocab-size-divisible-by 0", 1, "--make-vocab-size-divisible-by 0 must be >= 1"),
        ("--seed -1", 1, "--seed -1 must be >= 0"),
        ("--lr -1", 1, "--lr -1.0 must be >= 0"),
    ],
)
def test_bad_input_is_rejected(argv, world, match):
    with pytest.raises(
        OasesConfigError,
        match=match.replace("(", r"\(").replace(")", r"\)") if "[" not in match else match,
    ) as info:
        parse(argv, world_size=world)
    assert "\n" not in str(info.value)


def test_demo_defaults_leave_sample_based_training_alone():
    """``oases train --train-samples N``: no demo --train-iters next to it (Megatron refuses both)."""
    args = parse("--train-samples 64 --lr-decay-samples 64", world_size=1)
    assert args.train_samples == 64 and args.train_iters is None  # Megatron derives it later
    with pytest.raises(OasesConfigError, match="--train-samples -5 must be >= 1"):
        parse("--train-samples -5", world_size=1)


def test_megatron_derives_the_rest():
    args = parse(
        "--recompute-granularity full --tensor-model-parallel-size 2 --vocab-size 300 "
        "--oases-schedule oases --recompute-method uniform --recompute-num-layers 1",
        world_size=4,
    )
    assert args.ffn_hidden_size == 256 and args.data_parallel_size == 2
    assert args.distributed_backend == "gloo" and args.world_size == 4
    assert args.transformer_impl == "local" and not args.gradient_accumulation_fusion


@pytest.mark.parametrize("version", ["0.15.3", "0.16.1", "0.17.1", "0.21.0", "1.0.0"])
def test_megatron_version_outside_range(version, monkeypatch):
    monkeypatch.delenv("OASES_CHECK_MEGATRON_MAIN", raising=False)  # tests/megatron_main.sh's
    with pytest.raises(OasesConfigError, match=r"is not supported \(supported: >=0.18,<0.21"):
        check_megatron_core(version)


def test_installed_megatron_is_supported():
    assert check_megatron_core() == megatron_core_version()
