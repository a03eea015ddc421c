"""Closed-form counts for one Megatron GPT transformer layer (local spec).

All counts are *per rank* of a TMP group of degree ``d`` and per sample (one sequence of
``seq_length`` tokens); callers multiply by the samples a group processes. A layer is two blocks:

* ``attention``: input LayerNorm, QKV (column-parallel), core attention, projection (row-parallel),
  then its all-reduce;
* ``mlp``: pre-MLP LayerNorm, fc1 (column-parallel), activation, fc2 (row-parallel), then its
  all-reduce.

Activation bytes follow Korthikanti et al. ("Reducing activation recomputation", §4.1), generalised
to GQA, any FFN width, SwiGLU and any dtype, with Megatron's TP division: tensors inside the
column→row span are divided by ``d``; LayerNorm inputs, the QKV/fc1 inputs and the dropout masks after
the row-parallel all-reduce are replicated (not divided). Under sequence parallelism (SP) those
replicated tensors hold ``s/d`` of the sequence, so they are divided by ``d`` too (Korthikanti et al.
eq. for SP+TP: ``sbh·(34/t + 5as/(ht))`` in fp16).
"""

from ..device_model import block_gemm_flops as block_flops_forward  # noqa: F401  (one count)
from ..device_model import layer_dims
from ..formats.profile import core_attention_activation_bytes

BLOCKS = ("attention", "mlp")


def block_params(shape, block, degree):
    """(parameters per rank) of one block at TMP degree ``degree``."""
    h, a, g, kv, ffn, fc1 = layer_dims(shape)
    bias = not shape.get("disable_bias_linear")
    norm = 2 * h if shape.get("normalization", "LayerNorm") == "LayerNorm" else h
    if block == "attention":
        split = h * kv * (a + 2 * g) + kv * a * h + (kv * (a + 2 * g) if bias else 0)
        replicated = norm + (h if bias else 0)
    elif block == "mlp":
        split = h * fc1 + ffn * h + (fc1 if bias else 0)
        replicated = norm + (h if bias else 0)
    else:
        raise ValueError(block)
    return split / degree + replicated


def layer_params(shape, degree):
    return sum(block_params(shape, b, degree) for b in BLOCKS)


def fixed_params(shape, tp):
    """Embedding (vocab-parallel at T), position embedding, final norm, untied output layer."""
    h = shape["hidden_size"]
    v = shape["padded_vocab_size"]
    n = v * h / tp
    if shape.get("position_embedding_type", "learned_absolute") == "learned_absolute":
        n += shape["seq_length"] * h
    n += 2 * h if shape.get("normalization", "LayerNorm") == "LayerNorm" else h
    if shape.get("untie_embeddings_and_output_weights"):
        n += v * h / tp
    return n


def block_activation_bytes(shape, block, degree, dtype_bytes, sequence_parallel=False):
    """Bytes a block's forward saves for backward (no recompute), per rank per sample; under
    ``sequence_parallel`` the sequence-long tensors outside the column→row span are ``s/d``."""
    h, a, g, kv, ffn, fc1 = layer_dims(shape)
    s, p = shape["seq_length"], dtype_bytes
    drop_mask = 1 if shape.get("hidden_dropout", 0.0) > 0 else 0
    if block == "attention":
        replicated = p * s * h * 2 + drop_mask * s * h  # LN input, QKV input; dropout mask
        split = p * s * kv * (a + 2 * g) + p * s * kv * a  # Q, K, V; projection input
        # + the softmax output, attention-dropout mask and output (what selective recompute drops)
        core = core_attention_activation_bytes(shape, degree, p)
    elif block == "mlp":
        replicated = p * s * h * 2 + drop_mask * s * h  # LN input, fc1 input; dropout mask
        split, core = p * s * fc1 + p * s * ffn, 0.0  # activation input, fc2 input
    else:
        raise ValueError(block)
    return split / degree + core + replicated / (degree if sequence_parallel else 1)


def layer_activation_bytes(shape, degree, dtype_bytes, sequence_parallel=False):
    return sum(
        block_activation_bytes(shape, b, degree, dtype_bytes, sequence_parallel) for b in BLOCKS
    )


def backward_transient_bytes(shape, degree, dtype_bytes, sequence_parallel=False):
    """Working set of a layer's backward beyond its saved activations, per rank per sample:
    the attention-score gradient (two s×s tensors per local head), the fc1-sized gradient and four
    hidden-sized gradients. Under SP two of those are full-length (the all-gathered output gradient,
    the column dgrad before its reduce-scatter), two are ``s/d`` (the residual stream), and the
    column input is all-gathered again for the weight gradient (one full hidden tensor)."""
    h, a, g, kv, ffn, fc1 = layer_dims(shape)
    s, p = shape["seq_length"], dtype_bytes
    hidden = 4 * p * s * h
    if sequence_parallel:
        hidden = 2 * p * s * h + 2 * p * s * h / degree + p * s * h
    return 2 * p * a * s * s / degree + hidden + p * s * fc1 / degree


def gathered_input_bytes(shape, degree, dtype_bytes):
    """Under SP: one block's all-gathered column input beyond its ``s/d`` shard, per rank per
    sample — what the overlapped schedules keep for the weight gradient instead of re-gathering."""
    return hidden_bytes(shape, dtype_bytes) * (1 - 1 / degree)


def hidden_bytes(shape, dtype_bytes):
    """One [s, 1, h] hidden-state tensor: the layer input / a block input, per sample."""
    return shape["seq_length"] * shape["hidden_size"] * dtype_bytes


def logits_bytes(shape, tp, dtype_bytes):
    """Output layer and vocab-parallel cross entropy per sample at TMP T: logits in the model dtype
    plus fp32 softmax and its gradient."""
    return shape["seq_length"] * shape["padded_vocab_size"] / tp * (dtype_bytes + 4 + 4)


def head_flops_forward(shape, tp):
    """Forward FLOPs per rank per sample outside the transformer layers: the output layer (logits
    GEMM, vocab-parallel at T). Embedding lookups are memory-bound and not counted."""
    return 2 * shape["seq_length"] * shape["hidden_size"] * shape["padded_vocab_size"] / tp
