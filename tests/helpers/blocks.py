"""A stand-in block table for the engine's unit tests: the block picture of
:mod:`megatron_oases.schedule.megatron.blocks` without Megatron (the engine's
:class:`BlockTable` with stand-in layers) and without a process group.

Each block j is ``H_j ─ln_j→ L_j ─main_j→ (P_j, bias_j) ─bda_j→ H_{j+1}`` with ln a LayerNorm,
main two linears whose second returns its bias apart (a row-parallel linear's
``skip_bias_add``), and bda ``residual + 2 · (reduced + bias)`` (dropout's scale without its mask: the reference
could not draw the same masks in the same order). A block's TP group is None, so the executor hands every
collective's input on unchanged and the engine's programs are compared with plain autograd over
the same blocks (:func:`reference`).
"""

import contextlib

import torch
import torch.nn.functional as F

from megatron_oases.schedule.engine.blocks import BlockTable


class StandInLayer(torch.nn.Module):
    """One layer with the blocks ``kinds`` (``("attention", "mlp")`` as a GPT layer, one of them
    as a hybrid layer), each a norm and two linears."""

    def __init__(self, kinds, hidden, ffn, layer_number, dtype=torch.float64):
        super().__init__()
        self.kinds, self.layer_number = tuple(kinds), layer_number
        self.norm = torch.nn.ModuleDict({k: torch.nn.LayerNorm(hidden, dtype=dtype) for k in kinds})
        self.fc1 = torch.nn.ModuleDict(
            {k: torch.nn.Linear(hidden, ffn, dtype=dtype) for k in kinds}
        )
        self.fc2 = torch.nn.ModuleDict(
            {k: torch.nn.Linear(ffn, hidden, dtype=dtype) for k in kinds}
        )
        with torch.no_grad():  # LayerNorm starts at (1, 0): give its parameters a gradient to check
            for norm in self.norm.values():
                norm.weight.uniform_(0.5, 1.5)
                norm.bias.uniform_(-0.5, 0.5)


class StandInBlocks(BlockTable):
    """A :class:`BlockTable` over :class:`StandInLayer` s, as the adapter's ``LayerBlocks`` over
    Megatron's layers: the table's lookups (``first_block``, ``layer_blocks``, ``starts_layer``,
    ...) as they are, what a block computes stood in for."""

    DROPOUT_SCALE = 2.0

    def __init__(self, layers, sequence_parallel=False):
        self.layers = list(layers)
        self.table = self.table_of(self.layers, lambda layer: layer.kinds)
        self.graphs = None
        self.attention_mask = self.rotary_pos_emb = self.attention_bias = None
        self.sp = sequence_parallel
        self.callback = None  # the engine's yield points (yield_points), else None

    @property
    def sequence_parallel(self):
        return self.sp

    def tp_group(self, j):
        return None  # no process group: a collective's result is its input

    def ln(self, j, h):
        layer, kind, _ = self.table[j]
        return layer.norm[kind](h)

    def ln_discardable(self, j, h):
        return self.ln(j, h), None

    @contextlib.contextmanager
    def yield_points(self, callback):
        """As :meth:`LayerBlocks.yield_points`: after the first linear in forward, on its output's
        gradient in backward (the hook outlives the context, as Megatron's does)."""
        self.callback = callback
        try:
            yield
        finally:
            self.callback = None

    def main(self, j, x, mask=None, rotary_pos_emb=None):
        """(partial sum, bias) of block j: the second linear's bias is left to bda."""
        layer, kind, _ = self.table[j]
        fc1, fc2 = layer.fc1[kind], layer.fc2[kind]
        y = F.gelu(F.linear(x, fc1.weight, fc1.bias))
        callback = self.callback
        if callback is not None:
            if torch.is_grad_enabled() and y.requires_grad:
                y.register_hook(lambda grad: callback())
            callback()
        return F.linear(y, fc2.weight), fc2.bias

    def bda(self, j, reduced, bias, residual):
        """``residual + dropout(reduced + bias)`` with dropout's 1/(1-p) scale and no mask: affine,
        and not symmetric in (reduced, residual), so a swap of the two shows."""
        return residual + (reduced + bias) * self.DROPOUT_SCALE


def make_blocks(layout="gpt", layers=2, hidden=8, ffn=16, sequence_parallel=False, seed=0):
    """``layers`` GPT layers (attention and MLP blocks each), or for ``layout="hybrid"`` a
    ``*-*-`` pattern of ``layers`` one-block layers."""
    torch.manual_seed(seed)
    if layout == "gpt":
        kinds = [("attention", "mlp")] * layers
    else:
        kinds = [("attention",) if i % 2 == 0 else ("mlp",) for i in range(layers)]
    stack = [StandInLayer(k, hidden, ffn, i + 1) for i, k in enumerate(kinds)]
    return StandInBlocks(stack, sequence_parallel)


def parameters(blocks):
    return [p for layer in blocks.layers for p in layer.parameters()]


def reference(blocks, hidden):
    """The blocks in plain autograd, one after another."""
    h = hidden
    for j in range(blocks.num_blocks):
        partial, bias = blocks.main(j, blocks.ln(j, h))
        h = blocks.bda(j, partial, bias, h)
    return h
