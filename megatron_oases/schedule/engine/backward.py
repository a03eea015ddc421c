"""The backward programs of each schedule, in *rounds*: a round is one program per sub-batch,
executed interleaved; rounds follow each other with a barrier between them. Design notes:
``docs/schedules.md``.

- :func:`kept_graphs`: blocks whose graphs forward kept (``overlap`` without recompute, and the
  blocks after Megatron's ``--recompute-method block`` layers in every schedule); each block's
  backward through its kept (or recomputed) graph is :func:`block_backward`;
- :func:`fine_grained`: ``oases``: forward saved every block's input, so recomputation starts
  from there and issues no reduction; bda's backward comes from its RNG snapshot alone;
- :func:`layer_phases`: a recomputed layer's recompute pass (its forward reductions issued
  again) and backward pass; ``cross-pass`` chains them in one program, ``overlap`` with
  recompute runs each pass as its own round (the paper's basic pipelined schedule).

As in :mod:`.forward`, each function takes the micro-batch's :class:`~.ops.BlockOps` (``ops``),
the sub-batch and the block; the ops it returns are made by ``ops``' factories.
"""

import torch

_engine = torch.autograd.Variable._execution_engine


def backward(outputs, grads, freed=False):
    """``torch.autograd.backward(outputs, grads)`` without its Python layer (argument
    normalisation, gradients made where None is given), which the schedule's calls do not need;
    the shape check is kept. ``freed``: ``outputs[0]``'s data was freed in forward (a kept
    graph's root, :meth:`.ops.BlockOps.free_data`), so its check is skipped, as in Megatron's
    ``custom_backward``."""
    if len(outputs) == 1:  # the common case: one root, no loop or tuple() calls
        out, g = outputs[0], grads[0]
        if not freed and out.shape != g.shape:
            _shape_error(out, g)
        outputs, grads = (out,), (g,)
    else:
        skip = 1 if freed else 0
        for out, g in zip(outputs[skip:], grads[skip:]):
            if out.shape != g.shape:
                _shape_error(out, g)
        outputs, grads = tuple(outputs), tuple(grads)
    _engine.run_backward(
        tensors=outputs,
        grad_tensors=grads,
        keep_graph=False,
        create_graph=False,
        inputs=(),
        allow_unreachable=True,
        accumulate_grad=True,
    )


def _shape_error(out, g):
    raise RuntimeError(
        f"oases: gradient of shape {tuple(g.shape)} for an output of shape {tuple(out.shape)}"
    )


def kept_graphs(ops, sb):
    """Backward of the blocks that kept their graphs (from ``first_kept`` on)."""
    program = []
    for j in reversed(range(ops.first_kept, ops.blocks.num_blocks)):
        program += block_backward(ops, sb, j)
    return program


# ---------------------------------------------------------------------- one block's backward
def block_backward(ops, sb, j):
    """Block j's backward ops through its kept (or recomputed) graph, in order."""
    block = sb.blocks[j]
    if ops.joins(block):
        first = [ops.compute(lambda: _joined_grad(ops, sb, j), j, "backward")]
        return first + _input_gradient_reductions(ops, sb, j) + [_norm_grad_op(ops, sb, j)]
    first = [ops.light(lambda: _bda_grad(ops, sb, j), j, "backward")]
    return first + main_backward(ops, sb, j) + [_norm_grad_op(ops, sb, j)]


def main_backward(ops, sb, j):
    """Block j's main backward between its collectives: under SP the all-gather of R_j's
    gradient (the row-parallel reduce-scatter's backward) first; then the input-gradient
    reduction of the column-parallel linear (all-reduce, or reduce-scatter under SP)."""
    block, program = sb.blocks[j], []
    if ops.regathers(j):  # main_j's input again, in the same collective
        program.append(_regather(ops, sb, j))
    elif ops.sp:
        get = lambda: block.take("reduced_grad")  # noqa: E731
        done = ops.store(block, "reduced_grad")
        program.append(ops.collective("all_gather", get, done, j, "backward"))
    program.append(ops.compute(lambda: _main_grad(ops, sb, j), j, "backward"))
    return program + _input_gradient_reductions(ops, sb, j)


def _input_gradient_reductions(ops, sb, j):
    """The reduction of main_j's input gradient; for a kept graph built in tail pieces
    (pieces of tokens) one per piece, queued together, joined when the last is taken."""
    block = sb.blocks[j]
    n, block.pieces = block.pieces, None
    if n is None:
        get = lambda: block.take("norm_grad")  # noqa: E731
        return [ops.reduce(get, ops.store(block, "norm_grad"), j, "backward")]
    parts = [None] * n

    def done(i, t):
        parts[i] = t
        if i == n - 1:
            block.norm_grad = torch.cat(parts)

    return ops.queued(j, "backward", n, lambda i: block.piece_grads.pop(i), done)


def _regather(ops, sb, j):
    """One all-gather of R_j's gradient and main_j's saved input shard (a collective each
    would leave the second with no compute to hide behind)."""
    block = sb.blocks[j]

    def done(gathered):
        block.reduced_grad, block.gathered = gathered

    get = lambda: (block.take("reduced_grad"), block.norm_output.detach())  # noqa: E731
    return ops.collective("all_gather", get, done, j, "backward")


def _norm_grad_op(ops, sb, j):
    """ln_j's backward as a (light) op of block j's backward program."""
    return ops.light(lambda: _norm_grad(ops, sb, j), j, "backward")


def _joined_grad(ops, sb, j):
    """bda_j's and main_j's backward in one call (R_j joined, :meth:`.ops.BlockOps.reduced_input`)."""
    block = sb.blocks[j]
    g = sb.blocks[j + 1].take("input_grad")
    _backward_through_main(ops, sb, j, [block.take("output")], [g])
    block.input_grad = g  # the residual's (see BlockOps.block_input); ln_j's adds to it


def _backward_through_main(ops, sb, j, roots, grads, freed=False):
    """``backward`` from roots whose graph holds main_j's: with the sequence split, the later
    chunks' key/value gradients join the call (attention), and it runs in the sub-batch's
    chunk (Megatron's selective recompute re-runs core attention in there)."""
    prefix = ops.prefix
    if prefix is None:
        backward(roots, grads, freed)
        return
    attention, layer = ops.blocks.attention(j), ops.blocks.layer_index(j)
    if attention:
        more, more_grads = prefix.backward_roots(layer, sb.index)
        roots, grads = roots + more, grads + more_grads
    with prefix.running(sb.index):
        backward(roots, grads, freed)
    if attention:
        prefix.collect(layer, sb.index)


def _bda_grad(ops, sb, j):
    """bda_j's backward through its kept graph: R_j's gradient lands in its sink; the
    residual's is the output gradient itself (see :meth:`.ops.BlockOps.block_input`)."""
    g = sb.blocks[j + 1].take("input_grad")
    backward([sb.blocks[j].take("output")], [g])
    sb.blocks[j].input_grad = g


def _main_grad(ops, sb, j):
    block = sb.blocks[j]
    P, g = block.take("partial"), block.take("reduced_grad")
    if isinstance(P, list):  # forward ran it in tail pieces (pieces of tokens), data freed
        # one backward call per piece: each piece's weight gradient is accumulated before the
        # next piece's is computed (one call over all pieces could hold several at once), and
        # each piece's input-gradient all-reduce starts before the next piece's backward
        for p, gi in zip(P, torch.tensor_split(g, len(P), dim=0)):
            backward([p], [gi], freed=True)
        return
    freed = P.numel() != g.numel()  # data freed in forward (kept graph) unless kept
    _backward_through_main(ops, sb, j, [P], [g], freed)
    if ops.regathers(j):
        block.gathered = None  # main_j's input gradient has landed in norm_grad


def _norm_grad(ops, sb, j):
    """ln_j's backward; its input gradient adds to the residual's (:meth:`.ops.BlockOps.block_input`)."""
    block = sb.blocks[j]
    backward([block.take("norm_output")], [block.take("norm_grad")])


# ---------------------------------------------------------------------- recomputed blocks
def fine_grained(ops, sb):
    """``oases``: backward of the recomputed blocks (below ``first_kept``), each recomputed
    from its saved input H_j only, so the recomputation runs as soon as the previous
    collective is issued."""
    J = ops.first_kept
    program = [ops.light(lambda: _bda_grad_from_rng(ops, sb, J - 1), J - 1, "backward")]
    for j in reversed(range(J)):
        norm = lambda j=j: _recompute_norm(ops, sb, j, residual=False)  # noqa: E731
        program += _recompute_to_main(ops, sb, j, norm, early=True)
        program += main_backward(ops, sb, j)
        program.append(_norm_grad_op(ops, sb, j))
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
    with ops.rng.replay(block.take("rng_bda")):
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
        program += block_backward(ops, sb, j)
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
    with ops.rng.replay(block.take("rng_bda")):
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
    with ops.rng.replay(block.take("rng_main")):
        block.partial, _ = ops.main(sb, j, ops.sink(x, ops.store(block, "norm_grad")))
