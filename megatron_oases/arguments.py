"""Command-line arguments with Megatron-LM's names and meanings, plus the ``--oases-*`` group.

``add_megatron_args`` covers the subset of ``pretrain_gpt.py`` flags ``oases train`` understands;
``add_oases_args`` is the hook shared with Megatron-LM integration (``extra_args_provider``).
``validate_args`` turns every inconsistent combination into one :class:`OasesConfigError` line.
"""

import argparse
import os

from .errors import OasesConfigError

SCHEDULES = ("off", "overlap", "cross-pass", "oases")


def add_megatron_args(parser):
    g = parser.add_argument_group("model")
    g.add_argument("--num-layers", type=int, default=2)
    g.add_argument("--hidden-size", type=int, default=64)
    g.add_argument("--ffn-hidden-size", type=int, default=None, help="default 4 × hidden")
    g.add_argument("--num-attention-heads", type=int, default=4)
    g.add_argument("--num-query-groups", type=int, default=None, help="GQA groups; default = heads")
    g.add_argument("--kv-channels", type=int, default=None)
    g.add_argument("--seq-length", type=int, default=32)
    g.add_argument("--max-position-embeddings", type=int, default=None)
    g.add_argument("--vocab-size", type=int, default=512)
    g.add_argument("--make-vocab-size-divisible-by", type=int, default=128)
    g.add_argument("--hidden-dropout", type=float, default=0.1)
    g.add_argument("--attention-dropout", type=float, default=0.1)
    g.add_argument("--swiglu", action="store_true")
    g.add_argument("--normalization", choices=("LayerNorm", "RMSNorm"), default="LayerNorm")
    g.add_argument(
        "--position-embedding-type",
        choices=("learned_absolute", "rope"),
        default="learned_absolute",
    )
    g.add_argument("--disable-bias-linear", action="store_true")
    g.add_argument("--untie-embeddings-and-output-weights", action="store_true")
    g.add_argument("--init-method-std", type=float, default=0.02)
    g.add_argument(
        "--transformer-impl",
        choices=("local", "transformer_engine"),
        default="local",
        help="only 'local' is supported: TE linears do their own TP communication",
    )

    g = parser.add_argument_group("parallelism")
    g.add_argument("--tensor-model-parallel-size", type=int, default=1)
    g.add_argument("--pipeline-model-parallel-size", type=int, default=1)
    g.add_argument("--sequence-parallel", action="store_true")
    g.add_argument("--context-parallel-size", type=int, default=1)
    g.add_argument("--num-experts", type=int, default=None)
    g.add_argument(
        "--distributed-backend",
        choices=("gloo", "nccl"),
        default=None,
        help="default: nccl with CUDA, gloo without",
    )
    g.add_argument("--distributed-timeout-minutes", type=float, default=5.0)

    g = parser.add_argument_group("recompute")
    g.add_argument("--recompute-granularity", choices=("full", "selective"), default=None)
    g.add_argument("--recompute-method", choices=("uniform", "block"), default=None)
    g.add_argument("--recompute-num-layers", type=int, default=None)

    g = parser.add_argument_group("training")
    g.add_argument("--micro-batch-size", type=int, default=2)
    g.add_argument("--global-batch-size", type=int, default=None)
    g.add_argument("--train-iters", type=int, default=10)
    g.add_argument("--lr", type=float, default=1e-3)
    g.add_argument("--min-lr", type=float, default=0.0)
    g.add_argument("--weight-decay", type=float, default=0.01)
    g.add_argument("--clip-grad", type=float, default=1.0)
    g.add_argument("--adam-beta1", type=float, default=0.9)
    g.add_argument("--adam-beta2", type=float, default=0.999)
    g.add_argument("--seed", type=int, default=1234)
    g.add_argument(
        "--mock-data", action="store_true", help="synthetic token data (the only source)"
    )
    g.add_argument("--fp16", action="store_true")
    g.add_argument("--bf16", action="store_true")

    g = parser.add_argument_group("logging and checkpoints")
    g.add_argument("--log-interval", type=int, default=1)
    g.add_argument(
        "--log-json", default=None, help="golden-values JSON (Megatron functional-test shape)"
    )
    g.add_argument("--save", default=None)
    g.add_argument("--save-interval", type=int, default=None, help="default: save at the end")
    g.add_argument("--load", default=None)
    return parser


def add_oases_args(parser):
    """The ``oases`` argument group; also chained into Megatron-LM's ``extra_args_provider``."""
    g = parser.add_argument_group("oases")
    g.add_argument(
        "--oases-schedule",
        choices=SCHEDULES,
        default="off",
        help="off = stock Megatron; overlap = two sub-batches, TMP all-reduce overlapped with the "
        "other sub-batch's compute; cross-pass = + recompute and backward merged; oases = + "
        "fine-grained recomputation (no all-reduce in recompute)",
    )
    g.add_argument(
        "--oases-trace",
        default=None,
        help="write a Chrome-trace JSON of the last iteration per rank: PATH with '{rank}' in it, "
        "or PATH.rank<R>.json",
    )
    g.add_argument(
        "--oases-plan",
        default=None,
        metavar="PLAN_JSON",
        help="per-layer TMP degrees (plan file from `oases plan`); --tensor-model-parallel-size "
        "is the TMP domain",
    )
    g.add_argument(
        "--emulate-link",
        default=None,
        metavar="PROFILE",
        help="testbed emulation, not a measurement: every collective completes no earlier than "
        "D x its ring alpha-beta time on PROFILE's links (configs/clusters/PROFILE.yaml), D = "
        "the target GPU's rate / this host's matmul rate (per rank; see oases calibrate)",
    )
    return parser


def build_parser(prog="oases train"):
    parser = argparse.ArgumentParser(
        prog=prog,
        description="Train a GPT model on Megatron-Core (pretrain_gpt.py flags), optionally with the "
        "Oases overlapped TMP schedule. Launch with torchrun.",
    )
    add_megatron_args(parser)
    add_oases_args(parser)
    return parser


def _world_size():
    return int(os.environ.get("WORLD_SIZE", "1"))


def validate_args(args, world_size=None, cuda_available=None):
    """Fill defaults the Megatron way and reject bad combinations with one clear line."""
    import torch

    world_size = _world_size() if world_size is None else world_size
    cuda = torch.cuda.is_available() if cuda_available is None else cuda_available
    tp, pp = args.tensor_model_parallel_size, args.pipeline_model_parallel_size

    def fail(msg):
        raise OasesConfigError(msg)

    if args.transformer_impl != "local":
        fail(
            "--transformer-impl transformer_engine is not supported: TE linears do their own TP "
            "communication (and need CUDA); use --transformer-impl local"
        )
    if args.fp16 or args.bf16:
        if not cuda:
            fail("--fp16/--bf16 need CUDA; on CPU train in fp32 (drop the flag)")
    if args.sequence_parallel:
        fail(
            "--sequence-parallel is not supported by megatron-oases (TMP all-reduce path only); "
            "drop --sequence-parallel"
        )
    if args.context_parallel_size != 1:
        fail("--context-parallel-size > 1 is not supported; use --context-parallel-size 1")
    if args.num_experts:
        fail("MoE layers (--num-experts) are not supported; drop --num-experts")
    if tp < 1 or pp < 1:
        fail("--tensor-model-parallel-size and --pipeline-model-parallel-size must be ≥ 1")
    if world_size % (tp * pp) != 0:
        fail(
            f"world size {world_size} is not divisible by TP×PP = {tp}×{pp}; launch a multiple of "
            f"{tp * pp} processes or change --tensor-model-parallel-size/--pipeline-model-parallel-size"
        )
    args.world_size = world_size
    args.data_parallel_size = world_size // (tp * pp)
    if args.hidden_size % args.num_attention_heads != 0:
        fail(
            f"--hidden-size {args.hidden_size} is not divisible by --num-attention-heads "
            f"{args.num_attention_heads}"
        )
    if args.num_query_groups is None:
        args.num_query_groups = args.num_attention_heads
    if args.num_attention_heads % args.num_query_groups != 0:
        fail("--num-attention-heads must be a multiple of --num-query-groups")
    if args.num_attention_heads % tp != 0:
        fail(f"--num-attention-heads {args.num_attention_heads} is not divisible by TP={tp}")
    if args.num_query_groups % tp != 0:
        fail(f"--num-query-groups {args.num_query_groups} is not divisible by TP={tp}")
    if args.hidden_size % tp != 0:
        fail(f"--hidden-size {args.hidden_size} is not divisible by TP={tp}")
    if args.ffn_hidden_size is None:
        args.ffn_hidden_size = 4 * args.hidden_size
        if args.swiglu:  # Megatron-LM: 2/3 of 4h, rounded to a multiple of 64
            args.ffn_hidden_size = int((4 * args.hidden_size * 2 / 3) / 64) * 64 or 64
    if args.ffn_hidden_size % tp != 0:
        fail(f"--ffn-hidden-size {args.ffn_hidden_size} is not divisible by TP={tp}")
    if args.num_layers % pp != 0:
        fail(f"--num-layers {args.num_layers} is not divisible by PP={pp}")
    if args.max_position_embeddings is None:
        args.max_position_embeddings = args.seq_length
    if args.seq_length > args.max_position_embeddings:
        fail("--seq-length exceeds --max-position-embeddings")
    if args.global_batch_size is None:
        args.global_batch_size = args.micro_batch_size * args.data_parallel_size
    per_step = args.micro_batch_size * args.data_parallel_size
    if args.global_batch_size % per_step != 0:
        fail(
            f"--global-batch-size {args.global_batch_size} is not divisible by micro-batch × DP = "
            f"{args.micro_batch_size}×{args.data_parallel_size}"
        )
    args.num_microbatches = args.global_batch_size // per_step
    if args.recompute_granularity == "full":
        if args.recompute_method is None:
            args.recompute_method = "uniform"
        if args.recompute_num_layers is None:
            args.recompute_num_layers = 1
    elif args.recompute_method is not None:
        fail("--recompute-method needs --recompute-granularity full")
    if args.oases_schedule in ("cross-pass", "oases") and args.recompute_granularity != "full":
        fail(
            f"--oases-schedule {args.oases_schedule} merges recompute with backward; add "
            "--recompute-granularity full or use --oases-schedule overlap"
        )
    if args.oases_schedule != "off" and args.micro_batch_size < 2:
        fail(
            f"micro-batch {args.micro_batch_size} cannot be split; use --micro-batch-size ≥ 2 or "
            "--oases-schedule off"
        )
    if args.distributed_backend is None:
        args.distributed_backend = "nccl" if cuda else "gloo"
    if args.distributed_backend == "nccl" and not cuda:
        fail("--distributed-backend nccl needs CUDA; use --distributed-backend gloo on CPU")
    mult = args.make_vocab_size_divisible_by * tp
    args.padded_vocab_size = ((args.vocab_size + mult - 1) // mult) * mult
    if args.kv_channels is None:
        args.kv_channels = args.hidden_size // args.num_attention_heads
    if getattr(args, "oases_plan", None):
        from .hetero.model import validate_plan_for_model
        from .planner.plan_file import load_plan

        plan = load_plan(args.oases_plan, num_layers=args.num_layers, tensor_model_parallel_size=tp)
        validate_plan_for_model(plan, args)
    return args
