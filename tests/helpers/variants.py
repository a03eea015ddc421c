"""Variant tables the tests share, defined once: schedules, TP×PP layouts, tiny models' command
lines, the planner's model. Both tiers (``tests/unit``, ``tests/e2e``) import them from here."""

from megatron_oases.validation import SPLIT_SCHEDULES

from . import GPT, NO_DROP, RECOMPUTE, SHAPE

# ---------------------------------------------------------------------------------- schedules
#: Stock Megatron and each schedule that splits a micro-batch, as ``(name, flags)`` variants
#: (recomputation as the base command line has it).
SCHEDULE_VARIANTS = [("stock", "--oases-schedule off")] + [
    (s, f"--oases-schedule {s}") for s in SPLIT_SCHEDULES
]
#: One traced iteration of stock and of each split schedule, the recomputing ones with full
#: recomputation (``overlap`` keeps its activations).
TRACED = [
    ("stock", RECOMPUTE + "--oases-schedule off"),
    ("oases", RECOMPUTE + "--oases-schedule oases"),
    ("cross-pass", RECOMPUTE + "--oases-schedule cross-pass"),
    ("overlap", "--oases-schedule overlap"),
]

# ----------------------------------------------------------------- multi-rank layouts (TP × PP)
#: Two iterations: the second loss also checks the first optimizer step.
ITERS = "--train-iters 2 "


def layout(model, layers, tp, mbs, gbs, pp=1):
    """``(world size, flags)`` of ``model`` (:data:`helpers.GPT` / :data:`helpers.LLAMA`) with
    ``layers`` layers at TP ``tp`` × PP ``pp`` and the given micro- and global batch sizes."""
    flags = model.format(layers=layers) + f"--tensor-model-parallel-size {tp} "
    if pp > 1:
        flags += f"--pipeline-model-parallel-size {pp} "
    return tp * pp, flags + f"--micro-batch-size {mbs} --global-batch-size {gbs}"


#: The schedule and trace tests' model: 2 GPT layers, TP=2, two samples per micro-batch, one
#: iteration (``tests/e2e/test_schedule_behaviour.py``; with ``--sequence-parallel`` in
#: ``tests/e2e/test_sequence_parallel.py``).
TP2_BASE = layout(GPT, 2, tp=2, mbs=2, gbs=4)[1] + " --train-iters 1 "

# ------------------------------------------------------------ Megatron-LM's own loop and CLI
#: Megatron-LM flags of the tiny model; dropout 0 so that schedules can be compared exactly.
MEGATRON_LM_TINY = (
    "--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 32 "
    "--max-position-embeddings 32 --micro-batch-size 2 --global-batch-size 4 --lr 1e-3 "
    "--log-interval 1 --attention-dropout 0 --hidden-dropout 0 --tensor-model-parallel-size 2"
).split()
#: Megatron's mock data with its null tokenizer.
MEGATRON_LM_MOCK = "--mock-data --tokenizer-type NullTokenizer --vocab-size 512".split()

# ---------------------------------------------------- oases compare (Megatron-LM flags after --)
#: ``oases compare``'s tiny model in the tests (the rest: the demo's defaults). The tests slice it:
#: TP first, micro-batch size last.
COMPARE_TINY = "--tensor-model-parallel-size 2 --num-layers 2 --hidden-size 64 --micro-batch-size 2"
COMPARE_TINY = COMPARE_TINY.split()
#: The ``oases+planner`` variant's model: a degree-1 layer gets micro-batch/2 samples, split again
#: into two sub-batches.
COMPARE_PLANNER_TINY = (
    "--tensor-model-parallel-size 2 --num-layers 2 --hidden-size 64 --num-attention-heads 4 "
    "--seq-length 32 --max-position-embeddings 32 --vocab-size 128 --micro-batch-size 4 "
    "--global-batch-size 4"
).split()
#: TP=4, which one rank stands for (``--one-rank``).
TINY_TP4 = (
    "--tensor-model-parallel-size 4 --num-layers 2 --hidden-size 64 --num-attention-heads 4 "
    "--micro-batch-size 2"
).split()

# -------------------------------------------------------------- per-layer plans (layer_degrees)
#: The per-layer plan tests' model without its layer count (each case sets it and the layout):
#: dropout 0, two iterations, full recomputation.
LAYER_DEGREES_BASE = SHAPE + NO_DROP + ITERS + RECOMPUTE

# ---------------------------------------------------------------------- megatron-core versions
#: The version tests' model: 2 GPT layers, TP=2, four samples per micro-batch, full recomputation.
VERSIONS_TINY = layout(GPT, 2, tp=2, mbs=4, gbs=8)[1] + " " + RECOMPUTE

# ------------------------------------------------------------------------------------ planner
#: The planner's models (the paper's Table 4), relative to the checkout's root (pytest's cwd).
MODELS = "benchmarks/planner/models.yaml"


def h2048_args():
    """Megatron's arguments of the paper's H=2048, L=24 model (Table 4)."""
    from megatron_oases.profiler.model_config import model_args, read_model_file

    return model_args(read_model_file(f"{MODELS}:h2048"))


def h2048_profile(cluster):
    """The H=2048 model's analytic profile on ``cluster`` (a packaged cluster profile's name)."""
    from megatron_oases.formats.profile import Profile
    from megatron_oases.profiler.analytic import analytic_profile

    return Profile(analytic_profile(h2048_args(), cluster))
