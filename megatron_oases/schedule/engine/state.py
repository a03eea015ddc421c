"""What one sub-batch carries through a micro-batch's forward and backward programs.

Block j's tensors follow the block picture of :mod:`.blocks` (``input`` H_j, ``norm_output`` L_j,
``partial`` P_j, ``reduced`` R_j, ``output`` H_{j+1}). A program's ops hand tensors to each other
through these fields; an op *takes* a tensor (:meth:`Slots.take`: read and clear) once it is its
last reader, so nothing outlives its use, as a popped dict entry would not.
"""

from dataclasses import dataclass, field
from typing import Any, Optional


class Slots:
    """Named tensor slots; :meth:`take` is read-and-clear, failing loudly on an empty slot (an op
    order bug, never a silent None)."""

    def take(self, name):
        slots = self.__dict__  # not getattr/setattr: called a few hundred times per layer
        value = slots[name]
        if value is None:
            raise RuntimeError(f"oases: schedule slot {type(self).__name__}.{name} is empty")
        slots[name] = None
        return value


@dataclass(eq=False)
class BlockState(Slots):
    """Block j of one sub-batch (see :mod:`.blocks`)."""

    input: Any = None  # H_j where it is saved for recomputation (then ln_j's input, a sink)
    residual: Any = None  # H_j without a graph, bda_j's residual (see BlockOps.block_input)
    norm_output: Any = None  # L_j, kept with its graph for ln_j's backward
    partial: Any = None  # P_j: main_j's graph root (a list: one per run of tokens, see pieces)
    bias: Any = None  # main_j's bias, for bda_j (kept for the whole micro-batch)
    reduced: Any = None  # R_j: the reduction of P_j (forward or recompute)
    output: Any = None  # H_{j+1} with bda_j's graph, for bda_j's backward
    gathered: Any = None  # SP: the all-gathered L_j main_j runs on (or its re-gather)
    outbox: Any = None  # the tensor the next collective of this block sends
    rng_main: Any = None  # RNG snapshot before main_j (recomputed blocks)
    rng_bda: Any = None  # RNG snapshot before bda_j (recomputed blocks)
    norm_checkpoint: Any = None  # --recompute-modules layernorm: frees L_j until backward
    reduced_grad: Any = None  # gradient of R_j
    norm_grad: Any = None  # gradient of L_j (main_j's input gradient, reduced)
    input_grad: Any = None  # gradient of H_j
    # the runs of tokens forward built the block in (tail pieces, see .forward): their count,
    # and per run the partial sum waiting for its all-reduce and main_j's input gradient
    pieces: Optional[int] = None
    piece_outbox: dict = field(default_factory=dict)
    piece_grads: dict = field(default_factory=dict)

    def add_input_grad(self, g):
        """A part of H_j's gradient (the residual's, ln_j's input's)."""
        self.input_grad = g if self.input_grad is None else self.input_grad + g


@dataclass(eq=False)
class EndState(Slots):
    """The stage ends' working tensors (:mod:`.stage_ends`)."""

    lookup: Any = None  # the embedding lookup's partial sum, then its reduction
    rng: Any = None  # RNG snapshot before the embedding's forward
    scatter_input: Any = None  # SP: the embedding output before its scatter (backward)
    scatter_grad: Any = None  # SP: the scattered shard's gradient, then its all-gather
    norm_output: Any = None  # the final norm's output with its graph
    head_input: Any = None  # the output layer's input (under SP: the shard, then its gather)
    head_input_grad: Any = None  # its gradient, then that gradient's reduction
    loss: Any = None  # per-token loss with its graph
    loss_grad: Any = None  # the per-token loss's gradient


@dataclass(eq=False)
class SubBatch:
    """One sub-batch: its cut of the micro-batch's input, mask and RoPE, and its blocks."""

    index: int
    input: Any  # the layers' input (None until the embedding ops deliver it)
    mask: Any
    rotary: Any
    rows: int  # dim 0 (sequence) of its [s, b, h] hidden states
    num_blocks: int
    blocks: list = field(default_factory=list)  # BlockState per block, and one for the output
    ends: EndState = field(default_factory=EndState)
    output: Any = None  # the layers' output (the stage's, or the output end's input)
    loss: Any = None  # the output end's per-token loss, detached

    def __post_init__(self):
        # blocks[num_blocks].input_grad: the gradient of the layers' output
        self.blocks = [BlockState() for _ in range(self.num_blocks + 1)]

    def __getitem__(self, j):  # the schedule's own code reads ``sb.blocks[j]``: no call
        return self.blocks[j]
