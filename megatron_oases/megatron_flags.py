"""Megatron-LM's flags and what each schedule does with them, in one place.

Every option string of Megatron-LM's parser (``megatron.training.arguments``, as
:mod:`.arguments` builds it) falls under one :class:`Rule` here: an explicit flag, else the
longest matching prefix, else its argparse group's default. A rule gives one verdict under
``--oases-schedule off`` and one under the split schedules (``overlap``, ``cross-pass``,
``oases``, which take over the same Megatron code: each model instance's decoder forward and, with
the stage's ends, its model forward, bound to that instance by ``bind_schedule`` at
``prepare_model``; process-wide, without a plan, only the sequence-parallel scatter its embedding
calls, replaced by the ``oases-schedule`` patch):

- ``honoured``: the run does what the flag says (where the schedules replace Megatron's code, they
  call the same submodules, or fall back to stock code);
- ``refused``: setting it is one error line naming the fix, before the model is built;
- ``refused without TE``: refused where Transformer Engine is not installed;
- ``irrelevant``: the schedules do not touch what it controls (data, logging, checkpoints, the
  optimizer, inference, other models), or it only modifies a flag that is itself refused or not
  set.

A refused verdict is enforced by :func:`.validation.check_megatron_flags` from the rule's
:class:`Refusal` (so the table and the behaviour cannot drift), or by the check the rule names.
``docs/reliability.md``'s table is :func:`markdown_table`'s output (``python -m
megatron_oases.megatron_flags``), and ``tests/unit/test_megatron_flags.py`` walks Megatron's
parser against :data:`RULES`. Plain data: no Megatron, no torch.
"""

from dataclasses import dataclass
from typing import Optional

HONOURED, REFUSED, NO_TE, IRRELEVANT = "honoured", "refused", "refused without TE", "irrelevant"
VERDICTS = (HONOURED, REFUSED, NO_TE, IRRELEVANT)


@dataclass(frozen=True)
class Refusal:
    """How :func:`.validation.check_megatron_flags` enforces a rule's refused verdicts.

    ``uses``: ``(flag, attribute, values that are no use of it)``; the rule refuses when an
    attribute of Megatron's args holds another value (for an attribute Megatron derives, ``flag``
    names what it counts: ``2 virtual pipeline stages``). ``message``: the one line, formatted
    with ``what`` (``--oases-schedule X`` or ``--oases-plan``), ``given`` (the flag as given) and
    ``te`` (a note where Transformer Engine is not installed, else empty). ``plan``: a per-layer
    plan under ``off`` is refused as the split schedules are. ``after_megatron``: checked on the
    args Megatron validated (what it derives), not before its own checks."""

    uses: tuple
    message: str
    plan: bool = False
    after_megatron: bool = False

    def given(self, args):
        """The flag as the user gave it (``--fp8-format hybrid``), or None when unused."""
        for flag, attribute, unused in self.uses:
            value = getattr(args, attribute, None)
            if value is None or value in unused:
                continue
            if value is True:
                return flag
            value = getattr(value, "name", value)
            return f"{flag} {value}" if flag.startswith("-") else f"{value} {flag}"
        return None


@dataclass(frozen=True)
class Rule:
    """The verdicts (``off``: under ``--oases-schedule off``; ``split``: under ``overlap``,
    ``cross-pass`` and ``oases``) of the flags it covers: ``flags`` (exact option strings), else
    ``prefixes`` (option strings starting so), else every flag of Megatron's argparse ``group``.
    ``group`` also places the rule in the docs table. ``why``: the short reason. A refused rule
    has its ``refusal`` or names the check that enforces it (``enforced_by``); ``example``:
    command-line flags that the tests show refused."""

    group: str
    off: str
    split: str
    why: str
    flags: tuple = ()
    prefixes: tuple = ()
    refusal: Optional[Refusal] = None
    enforced_by: Optional[str] = None
    example: str = ""

    def verdict(self, schedule):
        return self.off if schedule == "off" else self.split


_H, _R, _I = HONOURED, REFUSED, IRRELEVANT
#: The ``te`` of a refusal's message where Transformer Engine is not installed.
NOT_INSTALLED = " (and Transformer Engine is not installed here)"
#: What the split schedules' refusals end with.
_OR_OFF = "drop it or use --oases-schedule off"


def _irrelevant(group, why, **kw):
    """Irrelevant under every schedule: no schedule touches what its flags control."""
    return Rule(group, _I, _I, why, **kw)


def _refused(group, off, split, why, *, flag, unused, message, example, attribute=None, plan=False):
    """The rule of one flag that a :class:`Refusal` enforces: any value of ``attribute``
    (argparse's: the flag's name in snake case, unless given) but those in ``unused``."""
    attribute = attribute or flag.lstrip("-").replace("-", "_")
    refusal = Refusal(((flag, attribute, unused),), message, plan=plan)
    return Rule(group, off, split, why, flags=(flag,), refusal=refusal, example=example)


def _split_only(flags, why, uses, reason, example, group="transformer configuration", **kw):
    """Honoured by stock Megatron, refused under the split schedules (which bypass it)."""
    fix = "drop one of them" if kw.get("plan") else _OR_OFF
    refusal = Refusal(uses, "{what} does not support {given}: " + reason + "; " + fix, **kw)
    return Rule(group, _H, _R, f"{why}: {reason}", flags=flags, refusal=refusal, example=example)


def _local_spec_ignores(flags, uses, example, group="transformer configuration"):
    """A switch of Transformer Engine's layer spec, which the local spec ignores: refused."""
    message = (
        "{given} switches Transformer Engine's layer spec, which this package does not build "
        "(the local spec it runs would ignore it){te}; drop it"
    )
    why = "Transformer Engine's layer spec only: the local spec ignores it"
    return Rule(group, _R, _R, why, flags=flags, refusal=Refusal(uses, message), example=example)


_TC = "transformer configuration"

#: Every rule, by Megatron's argparse group (its order is the docs table's).
RULES = (
    # --- transformer configuration: TransformerConfig's fields -------------------------------
    Rule(
        _TC,
        _H,
        _H,
        "model shape and numerics inside the layers' own submodules (attention, MLP, norms, "
        "bias-dropout-add), which the split schedules call as Megatron's TransformerLayer does",
    ),
    Rule(
        _TC,
        _H,
        _H,
        "parity-tested under every schedule (tests/e2e: schedule parity, sequence parallel, PP=2)",
        flags=("--tensor-model-parallel-size", "--pipeline-model-parallel-size"),
    ),
    Rule(
        _TC,
        _H,
        _H,
        "parity-tested under every schedule (tests/e2e/test_sequence_parallel.py); not with a "
        "per-layer plan (one line)",
        flags=("--sequence-parallel",),
    ),
    Rule(
        _TC,
        _H,
        _R,
        "GTP weight shards are prefetched in a fixed layer order that sub-batches break",
        flags=("--tensor-parallel-num-weight-shards",),
        enforced_by="validation.check_megatron_features",
        example="--tensor-model-parallel-size 2 --tensor-parallel-num-weight-shards 4",
    ),
    _refused(
        _TC,
        _H,
        _R,
        "the schedules' blocks run the whole sequence on every rank",
        flag="--context-parallel-size",
        unused=(1,),
        message="{what} does not support --context-parallel-size > 1 (the schedules' blocks run "
        "the whole sequence); drop one of them",
        example="--context-parallel-size 2",
        plan=True,
    ),
    Rule(
        _TC,
        _H,
        _I,
        "context parallelism only (refused under the split schedules)",
        flags=("--hierarchical-context-parallel-sizes", "--max-seqlen-per-dp-cp-rank"),
    ),
    _split_only(
        ("--hybrid-context-parallel",),
        "Megatron's packed sequences over CP ranks",
        (("--hybrid-context-parallel", "hybrid_context_parallel", (False,)),),
        "it packs sequences (cu_seqlens), which the split schedules do not run",
        "--hybrid-context-parallel",
    ),
    Rule(
        _TC,
        _H,
        _I,
        "MoE layers only (--num-experts, refused under the split schedules)",
        flags=(
            "--overlap-moe-expert-parallel-comm",
            "--overlap-dispatch-backward-with-experts-wgrad",
            "--ep-overlap-early-attn-memory-release",
            "--high-priority-a2a-comm-stream",
            "--use-grouped-gemm-for-shared-expert",
            "--use-fused-weighted-squared-relu",
        ),
        prefixes=("--moe-", "--expert-"),
    ),
    Rule(
        _TC,
        _H,
        _H,
        "the schedules compute in the model's dtype (--bf16 parity-tested: "
        "tests/e2e/test_parity_dp_bf16.py)",
        flags=("--fp16", "--bf16"),
    ),
    _refused(
        _TC,
        _R,
        _R,
        "Transformer Engine's userbuffer overlap of TE linears; this package runs Megatron's "
        "local linears (Megatron would raise per rank without TE, do nothing with it)",
        flag="--tp-comm-overlap",
        unused=(False,),
        message="--tp-comm-overlap overlaps Transformer Engine's linears (userbuffers), which this "
        "package does not build{te}: drop it (--oases-schedule overlap, cross-pass or oases "
        "overlap the TP communication of Megatron's local linears)",
        example="--tensor-model-parallel-size 2 --sequence-parallel --tp-comm-overlap",
    ),
    _irrelevant(
        _TC,
        "only with --tp-comm-overlap (refused)",
        flags=("--tp-comm-overlap-rs-dgrad", "--tp-comm-bootstrap-backend"),
        prefixes=("--no-tp-comm-", "--disable-tp-comm-"),
    ),
    Rule(
        _TC,
        _H,
        _H,
        "the split schedules' loss falls back to Megatron's (parity-tested)",
        flags=("--cross-entropy-loss-fusion", "--cross-entropy-fusion-impl"),
    ),
    Rule(
        _TC,
        _R,
        _R,
        "Transformer Engine only: Megatron refuses it with --transformer-impl local",
        flags=("--delay-wgrad-compute",),
        enforced_by="Megatron's validate_args",
        example="--delay-wgrad-compute",
    ),
    Rule(
        _TC,
        _R,
        _R,
        "Transformer Engine only: Megatron refuses it with --transformer-impl local",
        flags=("--fine-grained-activation-offloading",),
        enforced_by="Megatron's validate_args",
        example="--fine-grained-activation-offloading --offload-modules core_attn",
    ),
    _irrelevant(
        _TC,
        "only with --fine-grained-activation-offloading (refused)",
        flags=(
            "--offload-modules",
            "--min-offloaded-tensor-size",
            "--delay-offload-until-cuda-graph",
            "--delta-offload-bytes-across-pp-ranks",
            "--activation-offload-fraction",
            "--fine-grained-offloading-max-inflight-offloads",
        ),
    ),
    _irrelevant(
        _TC,
        "Megatron's pipeline schedule and its p2p communication, which the schedules do not "
        "replace (the interleaved ones only with virtual stages)",
        flags=(
            "--use-ring-exchange-p2p",
            "--overlap-p2p-communication-warmup-flush",
            "--microbatch-group-size-per-virtual-pipeline-stage",
            "--pipeline-model-parallel-comm-backend",
        ),
    ),
    _split_only(
        ("--defer-embedding-wgrad-compute",),
        "the output layer's deferred weight gradients, done by Megatron's pipeline schedule",
        (("--defer-embedding-wgrad-compute", "defer_embedding_wgrad_compute", (False,)),),
        "the output layer runs inside the schedule's programs, where its deferred "
        "weight-gradient GEMMs are not wired",
        "--defer-embedding-wgrad-compute",
    ),
    _irrelevant(
        _TC, "only with --defer-embedding-wgrad-compute", flags=("--wgrad-deferral-limit",)
    ),
    _split_only(
        ("--mtp-num-layers",),
        "Multi-Token Prediction layers after the decoder",
        (("--mtp-num-layers", "mtp_num_layers", (0,)),),
        "MTP's extra layers are not built into the schedules' programs",
        "--mtp-num-layers 1 --position-embedding-type rope",
    ),
    Rule(_TC, _H, _I, "only with --mtp-num-layers", prefixes=("--mtp-",)),
    Rule(
        _TC,
        _H,
        _H,
        "where layers sit on the stages: the schedules run the layers a stage holds",
        flags=("--account-for-embedding-in-pipeline-split", "--account-for-loss-in-pipeline-split"),
    ),
    Rule(
        _TC,
        _H,
        _H,
        "core attention swapped in after the build (megatron_oases/attention.py, "
        "parity-tested); --oases-split sequence takes unfused attention only (one line)",
        flags=("--attention-backend",),
    ),
    _irrelevant(
        _TC,
        "Megatron-Core 0.19 reads it nowhere (a legacy flag)",
        flags=("--apply-residual-connection-post-layernorm",),
    ),
    _irrelevant(
        _TC,
        "weight initialisation: the same weights under every schedule",
        flags=(
            "--no-initialization",
            "--use-cpu-initialization",
            "--init-method-std",
            "--embedding-init-method-std",
            "--init-model-with-meta-device",
        ),
    ),
    _split_only(
        ("--multi-latent-attention",),
        "MLA's attention (its own down/up projections)",
        (("--multi-latent-attention", "multi_latent_attention", (False,)),),
        "the schedules' blocks are built and tested for Megatron's self-attention",
        "--multi-latent-attention",
    ),
    _split_only(
        ("--experimental-attention-variant",),
        "gated delta net and DSA attention",
        (("--experimental-attention-variant", "experimental_attention_variant", ()),),
        "the schedules' blocks are built and tested for Megatron's self-attention",
        "--experimental-attention-variant gated_delta_net",
    ),
    Rule(
        _TC,
        _H,
        _I,
        "only with --experimental-attention-variant",
        prefixes=("--dsa-", "--no-dsa-", "--disable-dsa-", "--linear-"),
    ),
    _local_spec_ignores(
        (
            "--use-te-activation-func",
            "--use-transformer-engine-op-fuser",
            "--use-grouped-gemm-for-dense-mlp",
            "--fused-residual-rmsnorm",
            "--symmetric-ar-type",
        ),
        (
            ("--use-te-activation-func", "use_te_activation_func", (False,)),
            ("--use-transformer-engine-op-fuser", "use_transformer_engine_op_fuser", (False,)),
            ("--use-grouped-gemm-for-dense-mlp", "use_grouped_gemm_for_dense_mlp", (False,)),
            ("--fused-residual-rmsnorm", "fused_residual_rmsnorm", (False,)),
            ("--symmetric-ar-type", "symmetric_ar_type", ()),
        ),
        "--use-te-activation-func",
    ),
    Rule(
        _TC,
        _H,
        _H,
        "the schedules' own recomputation (parity-tested); cross-pass and oases need full "
        "recomputation of one layer per checkpoint, overlap takes selective recomputation of "
        "core_attn and layernorm (one line otherwise)",
        flags=(
            "--recompute-granularity",
            "--recompute-method",
            "--recompute-num-layers",
            "--recompute-modules",
        ),
    ),
    _split_only(
        ("--distribute-saved-activations",),
        "Megatron's checkpointed layers keep their input split over the TP group",
        (("--distribute-saved-activations", "distribute_saved_activations", (False,)),),
        "the schedules recompute from inputs they keep whole",
        "--tensor-model-parallel-size 2 --recompute-granularity full --recompute-method uniform "
        "--recompute-num-layers 1 --distribute-saved-activations",
        plan=True,
    ),
    _refused(
        _TC,
        _R,
        _R,
        "FP8 needs Transformer Engine's linears; Megatron's local linears would train in "
        "bf16/fp32 and ignore it (without TE and with full recomputation, Megatron raises per "
        "rank)",
        flag="--fp8-format",
        attribute="fp8",
        unused=(),
        message="{given}: FP8 needs Transformer Engine's linears, which this package does not "
        "build{te}: Megatron's local linears would ignore it and train in bf16/fp32; drop "
        "--fp8-format",
        example="--bf16 --fp8-format hybrid",
    ),
    _refused(
        _TC,
        _R,
        _R,
        "FP4 needs Transformer Engine's linears, as FP8 does",
        flag="--fp4-format",
        attribute="fp4",
        unused=(),
        message="{given}: FP4 needs Transformer Engine's linears, which this package does not "
        "build{te}: Megatron's local linears would ignore it; drop --fp4-format",
        example="--bf16 --fp4-format e2m1",
    ),
    _irrelevant(
        _TC,
        "only with --fp8-format / --fp4-format (refused)",
        flags=(
            "--no-fp8-wgrad",
            "--disable-fp8-wgrad",
            "--first-last-layers-bf16",
            "--num-layers-at-start-in-bf16",
            "--num-layers-at-end-in-bf16",
        ),
        prefixes=("--fp8-", "--fp4-"),
    ),
    _refused(
        _TC,
        _R,
        _R,
        "needs NVIDIA's kitchen extension (not installed: Megatron has no --kitchen-* flags "
        "here), without which the local spec ignores it",
        flag="--use-kitchen-attention",
        unused=(False,),
        message="--use-kitchen-attention needs NVIDIA's kitchen extension, which is not installed "
        "(Megatron's local spec would ignore it); drop it",
        example="--use-kitchen-attention",
    ),
    _irrelevant(_TC, "only with --use-kitchen-attention", flags=("--kitchen-attention-backend",)),
    _split_only(
        ("--enable-cuda-graph", "--external-cuda-graph", "--cuda-graph-impl"),
        "Megatron's CUDA graphs of whole layers (CUDA only)",
        (
            ("--cuda-graph-impl", "cuda_graph_impl", ("none",)),
            ("--enable-cuda-graph", "enable_cuda_graph", (False,)),
            ("--external-cuda-graph", "external_cuda_graph", (False,)),
        ),
        "the schedules call the layers' submodules, around which no layer graph is captured "
        "(--oases-cuda-graphs graphs the schedules' blocks)",
        "--cuda-graph-impl local",
    ),
    _irrelevant(
        _TC,
        "only with Megatron's CUDA graphs, or inference",
        flags=("--cuda-graph-warmup-steps", "--inference-cuda-graph-scope"),
    ),
    _irrelevant(
        _TC,
        "debug dump of module inputs and outputs (the stage's ends run stock with it)",
        flags=("--config-logger-dir",),
    ),
    _irrelevant(
        _TC,
        "inference only (the schedules run in training only)",
        flags=(
            "--flash-decode",
            "--nccl-all-reduce-for-prefill",
            "--mlp-chunks-for-prefill",
        ),
        prefixes=("--inference-",),
    ),
    Rule(
        _TC,
        _H,
        _I,
        "Mamba layers only (their '--hybrid-layer-pattern' symbol is refused under the split "
        "schedules)",
        flags=("--is-hybrid-model", "--disable-mamba-mem-eff-path"),
        prefixes=("--mamba-",),
    ),
    _split_only(
        ("--mlp-chunks-for-training",),
        "the MLP run in sequence chunks inside TransformerLayer",
        (("--mlp-chunks-for-training", "mlp_chunks_for_training", (1,)),),
        "the schedules call the MLP on a whole sub-batch",
        "--mlp-chunks-for-training 2",
    ),
    Rule(
        _TC,
        _R,
        _R,
        "the local spec only (TE linears do their own TP communication; without TE nothing "
        "else can be built)",
        flags=("--transformer-impl",),
        enforced_by="validation.check_transformer_impl",
        example="--transformer-impl transformer_engine",
    ),
    _refused(
        _TC,
        NO_TE,
        _R,
        "Transformer Engine's offload context around the layer loop (without TE Megatron "
        "asserts per rank); the split schedules replace that loop",
        flag="--cpu-offloading-num-layers",
        unused=(0,),
        message="{given} needs Transformer Engine's offload context around Megatron's layer "
        "loop{te}, which the split schedules and per-layer plans replace; drop it (or run "
        "--oases-schedule off, without --oases-plan, with Transformer Engine)",
        example="--cpu-offloading-num-layers 1",
        plan=True,
    ),
    _irrelevant(
        _TC,
        "only with --cpu-offloading-num-layers",
        flags=("--cpu-offloading-retain-pinned-cpu-buffers",),
    ),
    # --- network size ---------------------------------------------------------------------------
    Rule(
        "network size",
        _H,
        _H,
        "model shape, position embeddings, activations: inside the embedding and the layers' "
        "submodules",
    ),
    _irrelevant(
        "network size",
        "other models (T5, BERT) or ONNX export",
        flags=(
            "--encoder-num-layers",
            "--decoder-num-layers",
            "--relative-attention-num-buckets",
            "--relative-attention-max-distance",
            "--bert-no-binary-head",
            "--onnx-safe",
        ),
    ),
    # --- the loop around the model ------------------------------------------------------------
    _irrelevant("regularization", "Megatron's optimizer, the same under every schedule"),
    _irrelevant("profiling", "profilers around Megatron's loop"),
    _irrelevant(
        "training", "Megatron's loop: batch schedule, exits, GC, optimizer choice and offload"
    ),
    Rule(
        "training",
        _H,
        _H,
        "the split schedules cut it into sub-batches (at least --oases-sub-batches samples, or "
        "--oases-split sequence; one line otherwise)",
        flags=("--micro-batch-size",),
    ),
    Rule(
        "training",
        _H,
        _H,
        "legacy spellings of the recompute settings",
        flags=("--recompute-activations", "--checkpoint-activations"),
    ),
    Rule(
        "training",
        _H,
        _H,
        "fusions inside the layers' submodules and linears",
        flags=(
            "--no-masked-softmax-fusion",
            "--no-bias-gelu-fusion",
            "--no-bias-swiglu-fusion",
            "--no-bias-dropout-fusion",
            "--no-rope-fusion",
            "--rope-type",
            "--use-flash-attn",
            "--no-persist-layer-norm",
            "--no-gradient-accumulation-fusion",
        ),
    ),
    _irrelevant(
        "training", "only with --tp-comm-overlap (refused)", flags=("--tp-comm-overlap-cfg",)
    ),
    _irrelevant("rl", "Megatron-LM's reinforcement-learning scripts"),
    _irrelevant("RNG and initialization", "seeds and initialisation, as stock"),
    _refused(
        "RNG and initialization",
        NO_TE,
        NO_TE,
        "Transformer Engine's RNG tracker: without TE Megatron quietly keeps its own",
        flag="--te-rng-tracker",
        unused=(False,),
        message="--te-rng-tracker needs Transformer Engine, which is not installed here (Megatron "
        "would quietly keep its own RNG tracker); drop it",
        example="--te-rng-tracker",
    ),
    _irrelevant("learning rate and weight decay", "Megatron's learning-rate schedule"),
    _irrelevant(
        "checkpointing",
        "checkpoints hold the same model under every schedule (a plan's in the stock layout)",
    ),
    _irrelevant("mixed precision", "loss scaling and gradient reduction: Megatron's optimizer"),
    Rule(
        "mixed precision",
        _H,
        _H,
        "inside attention",
        flags=("--attention-softmax-in-fp32",),
    ),
    _irrelevant(
        "mixed precision",
        "GPTModel stores it and never reads it (Megatron-Core 0.19)",
        flags=("--fp16-lm-cross-entropy",),
    ),
    _irrelevant(
        "mixed precision",
        "only with --fp8-format (refused)",
        flags=("--reuse-grad-buf-for-mxfp8-param-ag",),
    ),
    _irrelevant(
        "distributed init",
        "process groups, DDP and the distributed optimizer around the model (parity-tested: "
        "--use-distributed-optimizer --overlap-grad-reduce --overlap-param-gather)",
    ),
    Rule(
        "distributed init",
        _H,
        _H,
        "torch FSDP2: the split schedules gather each layer's sharded parameters one ahead and "
        "hand its gradients to FSDP2's post-backward once (schedule/engine/fsdp.py); "
        "parity-tested against stock FSDP2 (tests/e2e/"
        "test_fsdp_e2e.py), keeping them gathered from forward to backward under "
        "--torch-fsdp2-no-reshard-after-forward; with --oases-plan or --oases-cuda-graphs refused; "
        "--save/--load (torch_dist, torch_dcp) bit-exact through the fsdp2-checkpoint patch",
        flags=("--use-torch-fsdp2", "--torch-fsdp2-no-reshard-after-forward"),
    ),
    Rule(
        "distributed init",
        _H,
        _H,
        "Megatron-FSDP, every --data-parallel-sharding-strategy, on CPU ranks too (the "
        "megatron-fsdp-cpu patch; parity-tested against DDP: tests/e2e/test_megatron_fsdp_e2e.py); "
        "the split schedules gather each layer themselves, one ahead, and hand each parameter's "
        "gradient over once per layer through its delayed weight-gradient entry "
        "(schedule/megatron/fsdp_params.py; parity-tested against stock Megatron-FSDP: "
        "tests/e2e/test_megatron_fsdp_split_e2e.py); with PP > 1 this megatron-core's "
        "Megatron-FSDP fails on any device (refused), with --oases-plan or --oases-cuda-graphs "
        "refused; --save/--load (fsdp_dtensor) bit-exact through the megatron-fsdp-checkpoint "
        "patch",
        flags=("--use-megatron-fsdp",),
    ),
    _irrelevant(
        "distributed init",
        "only with FSDP",
        flags=(
            "--data-parallel-sharding-strategy",
            "--outer-dp-sharding-strategy",
            "--enable-full-sharding-in-hsdp",
            "--suggested-communication-unit-size",
            "--keep-fp8-transpose-cache",
        ),
    ),
    _irrelevant(
        "distributed init",
        "NCCL user buffers, Megatron-FSDP's double buffer and manual registration (CUDA only): "
        "refused under --use-megatron-fsdp on CPU ranks (validation.check_megatron_fsdp, with "
        "CUDA graphs, FP8 and more than one --num-distributed-optimizer-instances)",
        flags=("--use-nccl-ub", "--fsdp-double-buffer", "--fsdp-manual-registration"),
    ),
    _irrelevant(
        "distributed init",
        "Megatron-FSDP divides gradients inside their reduction (NCCL's PREMUL_SUM), or before "
        "it: CPU runs under --use-megatron-fsdp add the flag (gloo has no PREMUL_SUM)",
        flags=("--no-gradient-reduce-div-fusion",),
    ),
    Rule(
        "distributed init",
        _H,
        _H,
        "where layers sit on the stages (--decoder-first-pipeline-num-layers parity-tested); a "
        "layout with several chunks per rank is the interleaved schedule (below)",
        flags=(
            "--decoder-first-pipeline-num-layers",
            "--decoder-last-pipeline-num-layers",
            "--pipeline-model-parallel-layout",
        ),
    ),
    Rule(
        "distributed init",
        _H,
        _H,
        "the interleaved pipeline schedule: each model chunk is scheduled on its own (its ends "
        "by its own pre/post-process flags), per-layer plans included; parity-tested "
        "(tests/e2e/test_interleaved_e2e.py)",
        flags=("--num-layers-per-virtual-pipeline-stage", "--num-virtual-stages-per-pipeline-rank"),
    ),
    Rule("distributed init", _H, _I, "context parallelism only", flags=("--cp-comm-type",)),
    _irrelevant("validation", "evaluation runs stock code (the schedules run in training only)"),
    _irrelevant("data and dataloader", "the same batches under every schedule"),
    Rule(
        "data and dataloader",
        _H,
        _H,
        "the sequence the layers see (--oases-split sequence: at least one token per chunk, and "
        "--reset-attention-mask needs --oases-split batch; one line otherwise)",
        flags=("--seq-length", "--reset-attention-mask"),
    ),
    _split_only(
        ("--dataloader-inter-document-masking",),
        "packed sequences (cu_seqlens) from the dataloader (under off Megatron-LM's "
        "pretrain_gpt.py makes them; oases-pretrain-gpt's dataset ignores the flag)",
        (
            (
                "--dataloader-inter-document-masking",
                "dataloader_inter_document_masking",
                (False,),
            ),
        ),
        "it packs sequences (cu_seqlens), which the split schedules do not run",
        "--dataloader-inter-document-masking",
        group="data and dataloader",
    ),
    _irrelevant("tokenizer", "the same tokens under every schedule"),
    _irrelevant("autoresume", "job control around Megatron's loop"),
    _irrelevant("biencoder", "other models (ICT, REALM)"),
    _irrelevant("vision", "other models (ViT, DINO)"),
    _refused(
        "moe",
        _H,
        _R,
        "the schedules' blocks are dense attention and MLP halves",
        flag="--num-experts",
        unused=(0,),
        message="{what} does not support MoE layers; drop --num-experts",
        example="--num-experts 4",
        plan=True,
    ),
    Rule("mla", _H, _I, "MLA only (--multi-latent-attention, refused under the split schedules)"),
    _local_spec_ignores(
        ("--mla-down-proj-fusion",),
        (("--mla-down-proj-fusion", "mla_down_proj_fusion", (False,)),),
        "--mla-down-proj-fusion",
        group="mla",
    ),
    _irrelevant("mla", "inference only", flags=("--cache-mla-latents",)),
    _split_only(
        ("--heterogeneous-layers-config-path", "--heterogeneous-layers-config-encoded-json"),
        "a configuration per layer",
        (
            ("--heterogeneous-layers-config-path", "heterogeneous_layers_config_path", ()),
            (
                "--heterogeneous-layers-config-encoded-json",
                "heterogeneous_layers_config_encoded_json",
                (),
            ),
        ),
        "the schedules' blocks are built and tested for uniform GPT layers",
        "--heterogeneous-layers-config-path layers.json",
        group="heterogeneous architecture",
    ),
    _irrelevant("logging", "logs and metrics of Megatron's loop"),
    _irrelevant("Logits Distillation", "only with --logits-save-dir / --logits-load-dir"),
    _split_only(
        ("--logits-save-dir", "--logits-load-dir"),
        "hooks on the output layer that save or compare logits per micro-batch",
        (
            ("--logits-save-dir", "logits_save_dir", ()),
            ("--logits-load-dir", "logits_load_dir", ()),
        ),
        "the split schedules run the output layer once per sub-batch, which those hooks do not "
        "expect",
        "--logits-save-dir logits",
        group="Logits Distillation",
    ),
    _irrelevant("straggler", "monitoring around Megatron's loop"),
    _irrelevant("workload inspector", "monitoring around Megatron's loop"),
    _irrelevant("inference", "inference only (the schedules run in training only)"),
    _irrelevant(
        "inference",
        "only with Megatron's CUDA graphs (refused under the split schedules)",
        flags=("--cuda-graph-scope", "--cuda-graph-modules"),
    ),
    _irrelevant(
        "Transformer-Engine",
        "only with --fp8-format / --fp4-format (refused)",
        flags=("--fp8-param-gather", "--fp4-param-gather"),
    ),
    _local_spec_ignores(
        ("--te-precision-config-file",),
        (("--te-precision-config-file", "te_precision_config_file", ()),),
        "--te-precision-config-file precision.yaml",
        group="Transformer-Engine",
    ),
    _irrelevant(
        "experimental",
        "a YAML config, the precision-aware optimizer (optimizer state dtypes), Megatron-FSDP "
        "buffers (FSDP only)",
    ),
    Rule(
        "experimental",
        _H,
        _H,
        "the model built: the split schedules run '*' (attention) and '-' (MLP) layers of "
        "TransformerLayer structure (one line for other hybrid symbols)",
        flags=("--spec", "--hybrid-layer-pattern", "--hybrid-override-pattern"),
    ),
    _irrelevant("one logger", "monitoring around Megatron's loop"),
    _irrelevant("In-process restart", "job control around Megatron's loop"),
    _irrelevant("ft_package", "job control around Megatron's loop"),
    _irrelevant("rerun engine", "result checks in Megatron's loop, the same under every schedule"),
    _irrelevant("msc", "storage client for data and checkpoints"),
    _irrelevant("sft", "only with --sft"),
    _split_only(
        ("--sft",),
        "Megatron's SFT data (packed sequences)",
        (("--sft", "sft", (False,)),),
        "it packs sequences (cu_seqlens), which the split schedules do not run",
        "--sft",
        group="sft",
    ),
    _irrelevant("fault injector", "testing aid around Megatron's loop"),
    _irrelevant("options", "help", flags=("-h", "--help")),
)


def rule_for(option, group):
    """The rule of ``option`` (an option string of Megatron's parser in argparse ``group``): its
    flag's rule, else the longest matching prefix's, else the group's default; None if none."""
    for rule in RULES:
        if option in rule.flags:
            return rule
    matches = [(len(p), rule) for rule in RULES for p in rule.prefixes if option.startswith(p)]
    if matches:
        return max(matches, key=lambda m: m[0])[1]
    return next((r for r in RULES if r.group == group and not r.flags and not r.prefixes), None)


def refusals():
    """The rules :func:`.validation.check_megatron_flags` enforces (their own :class:`Refusal`)."""
    return tuple(rule for rule in RULES if rule.refusal is not None)


def _cell(verdict):
    return f"**{verdict}**" if verdict in (REFUSED, NO_TE) else verdict


def _flags_cell(rule):
    names = [f"`{f}`" for f in rule.flags] + [f"`{p}*`" for p in rule.prefixes]
    return ", ".join(names) if names else "the rest of the group"


def _why(rule):
    if rule.refusal is not None and rule.refusal.plan:
        return rule.why + "; refused with a per-layer plan (`--oases-plan`) under `off` too"
    return rule.why


def markdown_table():
    """``docs/reliability.md``'s table of Megatron's flags, one row per rule, grouped as
    Megatron's parser groups them."""
    lines = [
        "| Megatron group | flags | `off` | `overlap`, `cross-pass`, `oases` | why |",
        "| --- | --- | --- | --- | --- |",
    ]
    groups = list(dict.fromkeys(rule.group for rule in RULES))
    for group in groups:
        rules = [r for r in RULES if r.group == group]
        rules.sort(key=lambda r: bool(r.flags or r.prefixes))  # the group's default first
        for i, rule in enumerate(rules):
            label = group if i == 0 else ""
            lines.append(
                f"| {label} | {_flags_cell(rule)} | {_cell(rule.off)} | {_cell(rule.split)} | "
                f"{_why(rule)} |"
            )
    return "\n".join(lines) + "\n"


if __name__ == "__main__":  # python -m megatron_oases.megatron_flags: the docs table
    print(markdown_table(), end="")
