"""The forward program of one sub-batch: per block ln → main → reduction → bda, the stage ends
around them, and the stage's last block cut into runs of tokens (tail pieces). Design notes:
``docs/schedules.md``."""

import torch

from ...validation import TAIL_PIECES
from .regather import shard_saved


def forward_program(ops, sb, last_sub_batch, layer_checkpoint, embedding=None, output=None):
    """Sub-batch ``sb``'s forward ops. ``last_sub_batch``: its collective ends the pass, so its
    last block runs in tail pieces. ``layer_checkpoint``: recomputed layers keep only their input
    (Megatron's full recompute) rather than each block's (fine-grained). ``embedding`` /
    ``output``: the stage's ends (:mod:`.stage_ends`), or None."""
    J = ops.blocks.num_blocks
    program = []
    if embedding is not None:
        deliver = lambda h: setattr(sb, "input", h)  # noqa: E731
        program += embedding.forward_ops(sb, deliver)
    for j in range(J):
        n = tail_pieces(ops, sb, j, last_sub_batch)
        if n > 1:
            program += _pieces(ops, sb, j, n, layer_checkpoint)
            continue
        block = sb.blocks[j]
        first = lambda j=j: _block_start(ops, sb, j, layer_checkpoint)  # noqa: E731
        program += ops.to_main(sb, j, "forward", first, lambda x, j=j: _main(ops, sb, j, x))
        done = ops.store(block, "reduced")
        program.append(ops.reduce(lambda b=block: b.take("outbox"), done, j, "forward"))

    def tail():
        sb.output = _bda(ops, sb, J - 1, layer_checkpoint)

    program.append(ops.light(tail, J - 1, "forward"))
    if output is not None:
        program += output.forward_ops(sb, ops.anchor, ops.store(sb.blocks[J], "input_grad"))
    return program


def tail_pieces(ops, sb, j, last_sub_batch):
    """Pieces block j of ``sb`` runs in forward: :data:`TAIL_PIECES` for the stage's last block
    of the last sub-batch (the pass's last collective), one elsewhere. Not under SP: a piece's
    reduce-scatter would not give a rank its own run of the sequence."""
    if ops.sp or j != ops.blocks.num_blocks - 1 or not last_sub_batch:
        return 1
    if ops.blocks.attention(j):  # attention mixes tokens: its runs of tokens are not separable
        return 1
    return min(TAIL_PIECES, sb.rows)


def _bda(ops, sb, j, layer_checkpoint):
    """H_{j+1} = bda_j(R_j, bias_j, H_j) in forward, recording what backward needs."""
    block = sb.blocks[j]
    keeps = ops.keeps(j)
    with torch.set_grad_enabled(keeps):
        if not keeps:  # recomputed in backward
            block.rng_bda = ops.rng.snapshot()
            out = ops.blocks.bda(j, block.take("reduced"), block.bias, block.input)
            if layer_checkpoint and not ops.blocks.starts_layer(j):
                block.input = None  # keep only layer inputs
            return out
        R = ops.reduced_input(block)
        checkpoint, block.norm_checkpoint = block.norm_checkpoint, None
        if checkpoint is not None:
            # main_j (and under SP the all-gather) has consumed ln_j's output: free it until
            # R_j's gradient arrives, which comes before main_j's backward and the re-gather
            checkpoint.discard_output_and_register_recompute(R)
        out = block.output = ops.blocks.bda(j, R, block.bias, block.take("residual"))
        return out


def _block_start(ops, sb, j, layer_checkpoint, main=None):
    """bda_{j-1}, ln_j, then ``main`` on ln_j's output (default: main_j; under SP it runs after
    the all-gather instead)."""
    block = sb.blocks[j]
    H = sb.input if j == 0 else _bda(ops, sb, j - 1, layer_checkpoint)
    keeps = ops.keeps(j)
    with torch.set_grad_enabled(keeps):
        if keeps:
            x = ops.block_input(block, H)
            norm_output, block.norm_checkpoint = ops.blocks.ln_discardable(j, x)
            block.norm_output = norm_output
        else:
            block.input = H  # saved for recomputation (a layer checkpoint drops it after bda_j)
            norm_output = ops.blocks.ln(j, H)
        if ops.sp or main is not None:
            ops.norm_output_ready(block, norm_output, main)
        else:  # the common case without a closure
            _main(ops, sb, j, norm_output)


def _main(ops, sb, j, x):
    """main_j on its (gathered) input; the RNG snapshot is taken right before it, as the other
    sub-batch may run between ln_j and main_j under SP."""
    block = sb.blocks[j]
    keeps = ops.keeps(j)
    with torch.set_grad_enabled(keeps):
        if not keeps:
            block.rng_main = ops.rng.snapshot()
            P, block.bias = ops.main(sb, j, x)
        elif ops.regathers(j):  # x's storage is freed after this call; see .regather
            with shard_saved(x, lambda: block.gathered):
                P, block.bias = ops.main(sb, j, ops.sink(x, ops.store(block, "norm_grad")))
        else:
            P, block.bias = ops.main(sb, j, ops.sink(x, ops.store(block, "norm_grad")))
        # the reduction's buffer: P's storage in a tensor of its own (P's .data is freed below);
        # .data, not detach(): no aten call, and no saved tensor aliases P (see free_data)
        block.outbox = P.data if P.requires_grad else P  # recomputed: no graph to cut
        if keeps:  # backward needs P's grad_fn only; its data goes to the reduction
            if not ops.joins(block):  # else bda_j's input joins P's graph, see reduced_input
                ops.free_data(P)
            block.partial = P


def _pieces(ops, sb, j, n, layer_checkpoint):
    """Forward ops of MLP block j on ``n`` runs of tokens, each run's all-reduce issued as soon
    as its main op is done while the sub-batch goes on with the next run (``Comm(switch=False)``),
    so the other sub-batch resumes only after the last run, as for a whole block. The pass then
    ends on 1/n of the block's all-reduce, which the other sub-batch's output layer and loss (or
    a stage's last bda) can hide.

    Exact because Megatron's MLP is per token and draws no random numbers (dropout is in the
    bda). A kept graph is one graph per run, each run's input its own sink, so backward has one
    input gradient per run, each all-reduced as Megatron's fc1 starts it. Memory as for a whole
    block: each run's partial sum is copied into its rows of one block-sized buffer, reduced
    there in place (a concatenation would hold the block's output twice)."""
    block, keeps, runs, rows, out = sb.blocks[j], ops.keeps(j), [], [], []

    def start(x):  # ln_j's output
        cut = torch.tensor_split(x, n, dim=0)
        rows.extend(r.size(0) for r in cut)
        if keeps:
            store = lambda i: lambda g: block.piece_grads.__setitem__(i, g)  # noqa: E731
            runs.extend(ops.sink(r, store(i)) for i, r in enumerate(cut))
            block.pieces = n
        else:
            block.rng_main = ops.rng.snapshot()
            runs.extend(cut)
        piece(0)

    def piece(i):
        with torch.set_grad_enabled(keeps):
            P, block.bias = ops.main(sb, j, runs[i])
        runs[i] = None
        if not out:
            out.append(P.new_empty((sum(rows),) + tuple(P.shape[1:])))
        start_row = sum(rows[:i])
        block.piece_outbox[i] = out[0][start_row : start_row + rows[i]].copy_(P.data)
        if keeps:  # backward needs the runs' grad_fn only (see _main)
            ops.free_data(P)
            block.partial = (block.partial or []) + [P]

    def done(i, t):  # the runs' results arrive in issue order, reduced in place in out
        if i == n - 1:
            block.reduced = out.pop()

    comms = ops.queued(j, "forward", n, lambda i: block.piece_outbox.pop(i), done)
    first = lambda: _block_start(ops, sb, j, layer_checkpoint, main=start)  # noqa: E731
    program = [ops.compute(first, j, "forward")]
    for i in range(n):
        if i:
            program.append(ops.compute(lambda i=i: piece(i), j, "forward"))
        program.append(comms[i])
    return program
