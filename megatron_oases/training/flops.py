"""Megatron-LM's model-FLOP count (``num_floating_point_operations``), reimplemented.

The 0.16 wheel lacks ``megatron.training``; this follows the same formula: per token,
3 (fwd, dgrad, wgrad) × 2 × (QKV and output-projection GEMMs, GQA-aware; attention scores and
values with causal halving; MLP GEMMs, ×1.5 for SwiGLU; logits). Recompute is not counted.
"""


def num_floating_point_operations(
    batch_size,
    seq_length,
    num_layers,
    hidden_size,
    ffn_hidden_size,
    num_attention_heads,
    num_query_groups,
    padded_vocab_size,
    kv_channels=None,
    swiglu=False,
):
    kv_channels = kv_channels or hidden_size // num_attention_heads
    q_ratio = kv_channels * num_attention_heads / hidden_size
    gated = 1.5 if swiglu else 1.0
    expansion = 3 * 2 * 2
    return (
        expansion
        * batch_size
        * seq_length
        * num_layers
        * hidden_size
        * hidden_size
        * (
            q_ratio * (1 + num_query_groups / num_attention_heads + seq_length / hidden_size / 2)
            + ffn_hidden_size / hidden_size * gated
            + padded_vocab_size / (2 * num_layers * hidden_size)
        )
    )
