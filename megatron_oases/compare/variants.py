"""The variants ``oases compare`` runs: stock Megatron and the Oases schedule ablation (paper Table 3)."""

from dataclasses import dataclass

from ..errors import OasesConfigError
from ..recompute_settings import RECOMPUTE_ARGV, block_argv


@dataclass(frozen=True)
class Variant:
    name: str
    flags: tuple
    label: str
    paper: str  # the closest column of the paper's Table 3
    # Megatron's recompute setting: "full", "selective" (core attention), "selective+ln" (core
    # attention and the norms' outputs), "block" (full, the first half of each stage's layers)
    # or "none"
    recompute: str = "full"
    available: bool = True
    note: str = ""
    split_micro_batch: bool = False  # halve the micro-batch, double the micro-batches
    needs_cuda: bool = False  # runs on a CUDA GPU only (--oases-cuda-graphs)
    needs_plan: bool = False  # takes compare's --oases-plan PATH (per-layer TMP degrees)

    @property
    def stock(self):
        """Stock Megatron (``--oases-schedule off``): the side a memory budget compares against."""
        return self.flags[:2] == ("--oases-schedule", "off")

    def resolved_flags(self, base_args, plan=None):
        """Flags for this variant given the validated base (stock) arguments and compare's
        ``--oases-plan`` (used by ``needs_plan`` variants only)."""
        if self.needs_plan:
            if not plan:
                raise OasesConfigError(
                    f"variant {self.name} needs --oases-plan PATH (a plan file from `oases plan`)"
                )
            return tuple(self.flags) + ("--oases-plan", plan)
        if self.recompute == "block":
            # Megatron's block method counts per pipeline stage
            per_stage = base_args.num_layers // base_args.pipeline_model_parallel_size
            if per_stage < 2:
                raise OasesConfigError(
                    f"variant {self.name} recomputes half of each stage's layers: it needs at "
                    "least 2 layers per pipeline stage"
                )
            return tuple(self.flags) + block_argv(per_stage // 2)
        if not self.split_micro_batch:
            return tuple(self.flags)
        mb = base_args.micro_batch_size
        if mb < 2 or mb % 2:
            raise OasesConfigError(
                f"variant {self.name} halves the micro-batch: use an even --micro-batch-size >= 2"
            )
        return tuple(self.flags) + (
            "--micro-batch-size",
            str(mb // 2),
            "--global-batch-size",
            str(base_args.global_batch_size),
        )


# Megatron's full recompute of every layer, one layer per checkpoint.
_FULL = RECOMPUTE_ARGV["full"]
_SELECTIVE = RECOMPUTE_ARGV["selective"]  # core attention
# Also the two norms' outputs (freed after the linear that reads them, recomputed in backward).
_SELECTIVE_LN = RECOMPUTE_ARGV["selective+ln"]
VARIANTS = {
    v.name: v
    for v in (
        Variant(
            "megatron",
            ("--oases-schedule", "off") + _FULL,
            "stock Megatron-Core, full recompute",
            "Megatron-LM",
        ),
        Variant(
            "megatron-selective",
            ("--oases-schedule", "off") + _SELECTIVE,
            "stock Megatron-Core, selective recompute (core attention)",
            "-",
            recompute="selective",
        ),
        Variant(
            "megatron-selective-ln",
            ("--oases-schedule", "off") + _SELECTIVE_LN,
            "stock Megatron-Core, selective recompute (core attention and layer norms)",
            "-",
            recompute="selective+ln",
        ),
        Variant(
            "megatron-norecompute",
            ("--oases-schedule", "off"),
            "stock Megatron-Core, no recompute",
            "-",
            recompute="none",
        ),
        Variant(
            "megatron-block",
            ("--oases-schedule", "off"),
            "stock, full recompute of the first half of each stage's layers (--recompute-method block)",
            "-",
            recompute="block",
        ),
        Variant(
            "megatron-halfmb",
            ("--oases-schedule", "off") + _FULL,
            "stock, full recompute, micro-batch/2 x 2 (control: sub-batch-sized ops, no overlap)",
            "-",
            split_micro_batch=True,
        ),
        Variant(
            "megatron-halfmb-norecompute",
            ("--oases-schedule", "off"),
            "stock, no recompute, micro-batch/2 x 2 (half the activations)",
            "-",
            recompute="none",
            split_micro_batch=True,
        ),
        Variant(
            "overlap",
            ("--oases-schedule", "overlap") + _FULL,
            "two sub-batches, per-pass overlap",
            "Merak (pipelined passes)",
        ),
        Variant(
            "overlap-selective",
            ("--oases-schedule", "overlap") + _SELECTIVE,
            "two sub-batches, per-pass overlap, selective recompute (core attention)",
            "-",
            recompute="selective",
        ),
        Variant(
            "overlap-selective-ln",
            ("--oases-schedule", "overlap") + _SELECTIVE_LN,
            "two sub-batches, per-pass overlap, selective recompute (core attention, layer norms)",
            "-",
            recompute="selective+ln",
        ),
        Variant(
            "overlap-norecompute",
            ("--oases-schedule", "overlap"),
            "two sub-batches, per-pass overlap, no recompute",
            "-",
            recompute="none",
        ),
        Variant(
            "cross-pass",
            ("--oases-schedule", "cross-pass") + _FULL,
            "+ recompute and backward merged",
            "Cross-pass schedule",
        ),
        Variant(
            "oases",
            ("--oases-schedule", "oases") + _FULL,
            "+ fine-grained recomputation",
            "+ Fine-grained recomputation",
        ),
        Variant(
            "oases-graphs",
            ("--oases-schedule", "oases", "--oases-cuda-graphs") + _FULL,
            "oases, each block's attention / MLP replayed from a CUDA graph",
            "-",
            needs_cuda=True,
        ),
        Variant(
            "overlap-norecompute-graphs",
            ("--oases-schedule", "overlap", "--oases-cuda-graphs"),
            "two sub-batches, no recompute, each block's attention / MLP from a CUDA graph",
            "-",
            recompute="none",
            needs_cuda=True,
        ),
        Variant(
            "oases-block",
            ("--oases-schedule", "oases"),
            "oases, full recompute of the first half of each stage's layers, the rest kept",
            "-",
            recompute="block",
        ),
        Variant(
            "oases-halfmb",
            ("--oases-schedule", "oases", "--oases-split", "sequence") + _FULL,
            "oases, micro-batch/2 x 2, each micro-batch split into two sequence chunks "
            "(--oases-split sequence: fits where micro-batch/2 has one sample)",
            "-",
            split_micro_batch=True,
        ),
        *(
            Variant(
                f"overlap-halfmb-{name}",
                ("--oases-schedule", "overlap", "--oases-split", "sequence") + flags,
                f"overlap, {what}, micro-batch/2 x 2 split into two sequence chunks",
                "-",
                recompute=recompute,
                split_micro_batch=True,
            )
            for name, flags, what, recompute in (
                ("selective", _SELECTIVE, "selective recompute (core attention)", "selective"),
                (
                    "selective-ln",
                    _SELECTIVE_LN,
                    "selective recompute (core attention, layer norms)",
                    "selective+ln",
                ),
                ("norecompute", (), "no recompute", "none"),
            )
        ),
        Variant(
            "oases-3sb",
            ("--oases-schedule", "oases", "--oases-sub-batches", "3") + _FULL,
            "oases with three sub-batches (1/3 of the pass-end all-reduce exposed)",
            "-",
        ),
        Variant(
            "oases+planner",
            ("--oases-schedule", "oases") + _FULL,
            "+ per-layer TMP planner (--oases-plan)",
            "+ Planner (Oases)",
            needs_plan=True,
        ),
    )
}
# Every stock recompute setting with its Oases twin (:func:`twin`): a best-against-best line must
# set like against like (without overlap-norecompute a run with memory to spare compared the best
# stock setting, without recompute, against Oases schedules that all recomputed).
DEFAULT_VARIANTS = (
    "megatron",
    "megatron-norecompute",
    "overlap",
    "overlap-norecompute",
    "cross-pass",
    "oases",
)
# With --memory-budget: every stock memory setting against every Oases one (cross-pass is left out:
# it keeps what oases keeps, and oases is the faster of the two).
MEMORY_VARIANTS = (
    "megatron",
    "megatron-selective",
    "megatron-selective-ln",
    "megatron-norecompute",
    "megatron-halfmb",
    "megatron-halfmb-norecompute",
    "overlap",
    "overlap-selective",
    "overlap-selective-ln",
    "overlap-norecompute",
    "oases",
    "oases-halfmb",
    "overlap-halfmb-selective",
    "overlap-halfmb-selective-ln",
    "overlap-halfmb-norecompute",
)


def twins(variant):
    """The Oases variants that keep what the stock ``variant`` keeps: the same recompute setting
    and micro-batch (none for an Oases variant), in the table's order; those that need a CUDA GPU
    or a plan file are left out."""
    if not variant.stock:
        return []
    return [
        v
        for v in VARIANTS.values()
        if not v.stock
        and v.recompute == variant.recompute
        and v.split_micro_batch == variant.split_micro_batch
        and not (v.needs_cuda or v.needs_plan)
    ]


def missing_twins(names):
    """``[(stock name, its first twin)]`` for each stock variant of ``names`` none of whose Oases
    twins (:func:`twins`) is among ``names``."""
    out = []
    for name in names:
        pair = twins(VARIANTS[name]) if name in VARIANTS else []
        if pair and not any(v.name in names for v in pair):
            out.append((name, pair[0].name))
    return out


# Flags compare sets itself, per variant or per run.
RESERVED = (
    "--oases-schedule",
    "--recompute-granularity",
    "--recompute-method",
    "--recompute-num-layers",
    "--recompute-modules",
    "--log-json",
    "--oases-trace",
    "--train-iters",
    "--emulate-link",
    "--save",
    "--load",
    "--oases-plan",
    "--oases-sub-batches",
    "--oases-split",
    "--fake-process-group",
    "--oases-cuda-graphs",
)


def parse_variants(spec, default=DEFAULT_VARIANTS):
    names = [s.strip() for s in (spec or ",".join(default)).split(",") if s.strip()]
    unknown = [n for n in names if n not in VARIANTS]
    if unknown:
        raise OasesConfigError(
            f"unknown variant(s) {', '.join(unknown)}; choose from {', '.join(VARIANTS)}"
        )
    if len(set(names)) != len(names):
        raise OasesConfigError(f"--variants lists a variant twice: {spec}")
    for n in names:
        if not VARIANTS[n].available:
            raise OasesConfigError(f"variant {n} is not available: {VARIANTS[n].note}")
    cuda_only = [n for n in names if VARIANTS[n].needs_cuda]
    if cuda_only:
        import torch

        if not torch.cuda.is_available():
            raise OasesConfigError(
                f"variant(s) {', '.join(cuda_only)} need a CUDA GPU (--oases-cuda-graphs) and "
                "this host has none; leave them out of --variants"
            )
    return [VARIANTS[n] for n in names]


def estimate_memory_gb(args, recompute, dtype_bytes=2):
    """Rough per-GPU memory of a run on the target (mixed precision + Adam), in GB.

    Model states: 16 bytes per parameter shard (fp16 weight and gradient, fp32 master and two Adam
    moments). Activations per layer and micro-batch (Korthikanti et al. 2022):
    ``s·b·h·(10 + 24/t + 5·a·s/(h·t))`` bytes, or ``s·b·h·(34/t + 5·a·s/(h·t))`` with sequence
    parallelism; selective recompute drops the attention-score term ``5·a·s/(h·t)``, and with
    ``layernorm`` also the two norms' outputs (``4·s·b·h``, ``/t`` under SP); with full
    recompute only each layer's input (``2·s·b·h``, ``/t`` under SP) plus one layer's working set
    (which holds that layer's input).
    1F1B keeps up to PP micro-batches in flight.
    With ``"block"`` (Megatron's ``--recompute-method block``) the stage's first
    ``recompute_num_layers`` layers count as under full recompute, the rest as without (whose
    activations are freed before the recomputation's working set is needed).
    ``recompute``: ``"full"``/True, ``"selective"``, ``"selective+ln"``, ``"block"`` or
    ``"none"``/False.
    """
    t, pp = args.tensor_model_parallel_size, args.pipeline_model_parallel_size
    h, s, b, a = args.hidden_size, args.seq_length, args.micro_batch_size, args.num_attention_heads
    layers = args.num_layers // pp
    ffn = args.ffn_hidden_size
    per_layer_params = 4 * h * h + 2 * h * ffn * (1.5 if args.swiglu else 1.0)
    params = layers * per_layer_params / t + args.padded_vocab_size * h / t
    states = 16 * params
    sp = getattr(args, "sequence_parallel", False)
    linear = 34 / t if sp else 10 + 24 / t  # per s·b·h, without the attention scores
    if recompute == "selective+ln":
        linear -= 4 / t if sp else 4
    full_layer = s * b * h * (linear + 5 * a * s / (h * t)) * dtype_bytes / 2
    in_flight = min(pp, args.num_microbatches)
    layer_input = dtype_bytes * s * b * h / (t if sp else 1)
    # full: every layer's input, and the recomputed layer's working set (its input included)
    if recompute in (True, "full"):
        act = in_flight * layers * layer_input - layer_input + full_layer
    elif recompute == "block":
        n = min(args.recompute_num_layers or 0, layers)
        # backward frees the kept layers before it recomputes the first ones
        kept = (layers - n) * full_layer
        act = in_flight * (n * layer_input + kept)
        if not kept:
            act += full_layer - layer_input
    elif recompute in ("selective", "selective+ln"):
        act = in_flight * layers * s * b * h * linear * dtype_bytes / 2 + full_layer
    else:
        act = in_flight * layers * full_layer
    return (states + act) / 1e9
