"""The tiny models every multi-rank test uses, as Megatron-LM flags (one GPT, one LLaMA-style)."""

from .runs import variants_worker  # noqa: F401  (re-exported for tests)

#: The tiny shape every multi-rank test shares (layers, parallelism and batch vary per test).
SHAPE = (
    "--hidden-size 64 --num-attention-heads 8 --seq-length 16 "
    "--max-position-embeddings 16 --vocab-size 500 --mock-data --lr 1e-2 "
)
#: Tiny GPT: learned absolute positions, LayerNorm, GELU MLP with biases, tied embeddings.
GPT = "--num-layers {layers} " + SHAPE
#: Tiny LLaMA-style: SwiGLU, RMSNorm, GQA (8 heads / 4 groups), RoPE, no biases, untied output.
LLAMA = GPT + (
    "--swiglu --normalization RMSNorm --group-query-attention --num-query-groups 4 "
    "--position-embedding-type rope --disable-bias-linear "
    "--untie-embeddings-and-output-weights "
)
#: Megatron's full recomputation the way the schedules do it (one layer at a time).
RECOMPUTE = "--recompute-granularity full --recompute-method uniform --recompute-num-layers 1 "
#: Megatron's full recomputation of only a stage's first ``n`` layers (the rest keep everything).
BLOCK = "--recompute-granularity full --recompute-method block --recompute-num-layers {n} "
#: Megatron's selective recomputation of core attention and the norms' outputs.
SELECTIVE_LN = "--recompute-granularity selective --recompute-modules core_attn layernorm "
NO_DROP = "--hidden-dropout 0 --attention-dropout 0 "
DROP = "--hidden-dropout 0.2 --attention-dropout 0.2 "
