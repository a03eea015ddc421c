"""The backward programs of each schedule, as *runs*: a run is one program per sub-batch, executed
interleaved; runs follow each other with a barrier between them. Design notes:
``docs/schedules.md``.

- :func:`kept_graphs`: blocks whose graphs forward kept (``overlap`` without recompute, and the
  blocks after Megatron's ``--recompute-method block`` layers in every schedule);
- :func:`fine_grained`: ``oases``: forward saved every block's input, so recomputation starts
  from there and issues no reduction; bda's backward comes from its RNG snapshot alone;
- :func:`layer_phases`: a recomputed layer's recompute pass (its forward reductions issued
  again) and backward pass; ``cross-pass`` chains them in one program, ``overlap`` with
  recompute runs each pass as its own run (the paper's basic pipelined schedule).
"""

import torch

from .ops import backward
from .rng import replay


def kept_graphs(ops, sb):
    """Backward of the blocks that kept their graphs (from ``first_kept`` on)."""
    program = []
    for j in reversed(range(ops.first_kept, ops.blocks.num_blocks)):
        program += ops.block_backward(sb, j)
    return program


def fine_grained(ops, sb):
    """``oases``: backward of the recomputed blocks (below ``first_kept``), each recomputed
    from its saved input H_j only, so the recomputation runs as soon as the previous
    collective is issued."""
    J = ops.first_kept
    program = [ops.light(lambda: _bda_grad_from_rng(ops, sb, J - 1), J - 1, "backward")]
    for j in reversed(range(J)):
        norm = lambda j=j: _recompute_norm(ops, sb, j, residual=False)  # noqa: E731
        program += _recompute_to_main(ops, sb, j, norm, early=True)
        program += ops.main_backward(sb, j)
        program.append(ops.norm_grad_op(sb, j))
        if j > 0:
            bda = lambda j=j: _bda_grad_from_rng(ops, sb, j - 1)  # noqa: E731
            program.append(ops.light(bda, j - 1, "backward"))
    return program


def _bda_grad_from_rng(ops, sb, j):
    """Backward of bda_j from its RNG snapshot: bda is affine, so a zero probe input gives the
    exact gradients (dropout mask · g for R_j and bias, identity for the residual)."""
    block = sb.blocks[j]
    g = sb.blocks[j + 1].take("input_grad")
    zeros = _zeros(ops, g)
    probe = zeros.detach().requires_grad_()  # bda writes to neither (out of place in training)
    with replay(block.take("rng_bda")):
        out = ops.blocks.bda(j, probe, block.bias, zeros)
    backward([out], [g])
    block.reduced_grad = probe.grad
    block.input_grad = g  # residual path; ln_j's backward adds its own


def _zeros(ops, like):
    """A zero tensor shaped like ``like``, one per shape for the micro-batch's backward: the
    probes' storage and the residual input, two zeros_like per bda backward otherwise."""
    key = (like.shape, like.dtype, like.device)
    if key not in ops.zeros:
        ops.zeros[key] = torch.zeros_like(like)
    return ops.zeros[key]


def layer_phases(ops, sb, layer):
    """Recompute ops (with the layer's forward reductions) and backward ops of one layer (its
    blocks: attention and MLP of a GPT layer, one of them of a hybrid layer)."""
    blocks = ops.blocks.layer_blocks(layer)
    first = blocks[0]
    # the layer's first block from its saved input only (each next one needs the recomputed
    # reduction of the one before)
    recompute = _recompute_to_main(
        ops, sb, first, lambda: _recompute_norm(ops, sb, first), early=True
    )
    recompute.append(_recomputed_reduction(ops, sb, first))
    for a, m in zip(blocks, blocks[1:]):
        norm = lambda a=a, m=m: _recompute_bda_and_norm(ops, sb, a, m)  # noqa: E731
        recompute += _recompute_to_main(ops, sb, m, norm)
        recompute.append(_recomputed_reduction(ops, sb, m))
    last = blocks[-1]
    recompute.append(ops.light(lambda: _recompute_bda(ops, sb, last), last, "recompute"))
    program = []
    for j in reversed(blocks):
        program += ops.block_backward(sb, j)
    return recompute, program


def cross_pass(ops, sb, layers):
    """``cross-pass``: each recomputed layer's recompute then backward, in one op sequence."""
    program = []
    for layer in reversed(range(layers)):
        recompute, back = layer_phases(ops, sb, layer)
        program += recompute + back
    return program


def _recomputed_reduction(ops, sb, j):
    block = sb.blocks[j]
    get = lambda: block.partial.data  # noqa: E731  (no graph: see forward._main's outbox)
    return ops.reduce(get, ops.store(block, "reduced"), j, "recompute")


def _recompute_bda(ops, sb, j):
    """bda_j again from the recomputed reduction, its graph kept for backward."""
    block = sb.blocks[j]
    R = ops.reduced_input(block)
    with replay(block.take("rng_bda")):
        block.output = ops.blocks.bda(j, R, block.bias, block.take("residual"))
    return block.output


def _recompute_bda_and_norm(ops, sb, a, m):
    """Recompute bda_a (it needs the recomputed reduction) and block m's ln (and main)."""
    sb.blocks[m].input = _recompute_bda(ops, sb, a)
    _recompute_norm(ops, sb, m)


def _recompute_to_main(ops, sb, j, first, early=False):
    """Recompute block j from its saved input H_j up to its partial sum. Under sequence
    parallelism this re-gathers the ln output (an all-gather in recompute, overlapped like every
    collective) rather than keeping the gathered input from forward: that would hold t× the
    block input per block, undoing SP's activation saving."""
    main = lambda x: _recompute_main(ops, sb, j, x)  # noqa: E731
    return ops.to_main(sb, j, "recompute", first, main, early=early)


def _recompute_norm(ops, sb, j, residual=True):
    """ln_j again from block j's input. ``residual``: keep it for bda_j's recomputation (not
    for ``oases``, whose bda backward needs its RNG snapshot alone, :func:`_bda_grad_from_rng`)."""
    block = sb.blocks[j]
    x = ops.block_input(block, block.take("input"), residual=residual)
    norm_output = block.norm_output = ops.blocks.ln(j, x)
    if ops.sp:
        ops.norm_output_ready(block, norm_output, None)
    else:  # without a closure
        _recompute_main(ops, sb, j, norm_output)


def _recompute_main(ops, sb, j, x):
    block = sb.blocks[j]
    with replay(block.take("rng_main")):
        block.partial, _ = ops.main(sb, j, ops.sink(x, ops.store(block, "norm_grad")))
