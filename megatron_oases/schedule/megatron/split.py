"""How a micro-batch becomes sub-batches (``--oases-split``): whole samples, or sequence chunks.

``batch`` (the paper's): sub-batch i is a run of samples, cut along b of [s, b, h] (and of the
[b, s] token tensors); sub-batches never meet, and an attention mask is cut per sample.

``sequence``: sub-batch i is the i-th run of consecutive positions of every sample, cut along s.
Everything in a transformer layer is per token except core attention, where causal attention
lets chunk i read the keys and values of chunks 0..i-1 (:class:`PrefixAttention`). This splits a
micro-batch of one sample, whose memory a two-sample split cannot fit (the notes' 1.2 GB case),
and halves the largest temporaries of attention's backward (scores of s/2 query rows). Its
ordering assumptions, which the engine keeps:

- forward: chunk c's attention of a layer runs before chunk i > c's (program order, sub-batch 0
  first);
- backward: chunk i > c's attention backward runs before chunk c's (the engine runs the backward
  programs last chunk first), so chunk c's keys and values have every gradient they get when
  its own attention backward runs through them.

Each rule about the cut lives here and in ``engine/split.py`` (:class:`BatchSplit`, which needs
no Megatron); the engine and the stage ends ask a split rather than naming a dimension.
"""

import contextlib

import torch
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.identity_op import IdentityFuncOp, IdentityOp

from ...errors import OasesConfigError
from ...validation import SUB_BATCHES
from ..engine.executor import holding
from ..engine.split import BatchSplit, split_sizes


class SequenceSplit(BatchSplit):
    """Sub-batches of consecutive sequence chunks; see the module docstring."""

    hidden_dim, token_dim = 0, 1  # s of [s, b, h]; s of [b, s]

    def __init__(self, hidden_shape, parts=SUB_BATCHES, device=None):
        s = hidden_shape[0]
        if s < parts:
            raise OasesConfigError(
                f"sequence of {s} cannot be cut into {parts} chunks; use --oases-split batch"
            )
        self.total = s
        self.sizes = split_sizes(s, parts)
        self.offsets = [sum(self.sizes[:i]) for i in range(len(self.sizes))]
        self.device = device

    def masks(self, mask):
        """Chunk i's rows of the causal mask over the positions it may read, [.., n_i, o_i+n_i]
        (True = masked, Megatron's convention); built when Megatron passes none (its softmax
        would otherwise build a square causal mask, wrong for a later chunk)."""
        out = []
        for off, n in zip(self.offsets, self.sizes):
            if mask is None:
                rows = torch.arange(off, off + n, device=self.device).unsqueeze(1)
                cols = torch.arange(off + n, device=self.device).unsqueeze(0)
                chunk = (cols > rows).view(1, 1, n, off + n)
            else:
                chunk = mask[..., off : off + n, : off + n]
            out.append(chunk)
        return out

    def rotary(self, rotary_pos_emb):
        """Each chunk's rows of the RoPE frequencies [s, 1, 1, d] (or a (q, k) pair of them)."""

        def rows(t, off, n):
            if t is None:
                return None
            if isinstance(t, tuple):
                return tuple(rows(x, off, n) for x in t)
            return t[off : off + n]

        return [rows(rotary_pos_emb, off, n) for off, n in zip(self.offsets, self.sizes)]

    def backward_order(self):
        return list(reversed(range(len(self.sizes))))

    def prefix_attention(self, blocks):
        return PrefixAttention(blocks.layers, len(self.sizes))


def make_split(kind, hidden, parts=SUB_BATCHES):
    """The split of a micro-batch whose layer input is ``hidden`` [s, b, h]."""
    cls = SequenceSplit if kind == "sequence" else BatchSplit
    return cls(hidden.shape, parts, device=hidden.device)


class PrefixAttention:
    """Core attention of sequence chunks: chunk i's keys and values are those of chunks 0..i-1
    (detached leaves, whose gradients it collects) followed by its own.

    A forward pre-hook on each layer's ``core_attention`` sees the chunk's (query, key, value)
    after RoPE; the engine says which chunk runs (:meth:`running`). For layer ``l``:

    - ``kv[l, c]``: chunk c's key and value, kept in forward until the last chunk has read them
      (a copy when they are in no autograd graph, a recomputed layer's forward, so that the QKV
      output is freed: that copy is the sequence split's one extra activation, (parts-1)/parts
      of a layer's keys and values per recomputed layer);
    - ``leaves[l, i]``: the leaves through which chunk i reads the prefix, made in forward and
      reused by every re-run (the schedule's recompute, Megatron's selective recompute inside
      backward), so the gradients of all runs land on the same leaves;
    - ``roots[l, c]``: chunk c's key and value in the graph its attention backward runs through
      (the forward's when kept, the recomputation's otherwise), and ``grads[l, c]`` summed from
      the later chunks' leaves: :meth:`backward_roots` hands both to that backward.
    """

    def __init__(self, layers, parts):
        # by position in the stage; a hybrid stack's MLP layers have no attention to share
        self.layers = {
            l: layer
            for l, layer in enumerate(layers)
            if not isinstance(layer.self_attention, (IdentityOp, IdentityFuncOp))
        }
        self.parts = parts
        for layer in self.layers.values():
            if type(layer.self_attention.core_attention) is not DotProductAttention:
                raise OasesConfigError(
                    "--oases-split sequence needs Megatron's unfused DotProductAttention (got "
                    f"{type(layer.self_attention.core_attention).__name__}); drop "
                    "--attention-backend or use --oases-split batch"
                )
        self.chunk, self.in_forward = None, True
        self.kv, self.leaves, self.roots, self.grads = {}, {}, {}, {}

    def running(self, chunk):
        return holding(self, "chunk", chunk)

    @contextlib.contextmanager
    def hooks(self):
        handles = [
            layer.self_attention.core_attention.register_forward_pre_hook(
                lambda module, args, kwargs, l=l: self._pre_hook(l, args, kwargs),
                with_kwargs=True,
            )
            for l, layer in self.layers.items()
        ]
        try:
            yield
        finally:
            for handle in handles:
                handle.remove()

    def _pre_hook(self, l, args, kwargs):
        i, last = self.chunk, self.parts - 1
        if i is None:
            raise RuntimeError("oases: core attention ran outside a sequence chunk's op")
        query, key, value, *rest = args
        # the graph chunk i's attention backward runs through; not Megatron's selective
        # recompute re-running core attention inside backward, on detached copies (leaves)
        if i < last and key.grad_fn is not None:
            self.roots[l, i] = (key, value)
        if self.in_forward:
            if i < last:
                keep = (lambda t: t) if key.requires_grad else (lambda t: t.detach().clone())
                self.kv[l, i] = (keep(key), keep(value))
            if i > 0 and (l, i) not in self.leaves:
                self.leaves[l, i] = [
                    tuple(t.detach().requires_grad_() for t in self.kv[l, c]) for c in range(i)
                ]
            if i == last:  # every later chunk has its leaves
                for c in range(last):
                    self.kv.pop((l, c))
        if i == 0:
            return None
        if (l, i) not in self.leaves:
            raise RuntimeError(f"oases: chunk {i} re-ran layer {l}'s attention after backward")
        prefix = self.leaves[l, i]
        key = torch.cat([k for k, _ in prefix] + [key], dim=0)
        value = torch.cat([v for _, v in prefix] + [value], dim=0)
        return (query, key, value, *rest), kwargs

    def start_backward(self):
        self.in_forward = False

    def collect(self, l, i):
        """After chunk i's attention backward of layer l: its prefix leaves' gradients go to the
        earlier chunks' sums."""
        for c, (k, v) in enumerate(self.leaves.pop((l, i), [])):
            if k.grad is None or v.grad is None:
                raise RuntimeError(f"oases: chunk {i}'s attention left chunk {c} no gradient")
            if (l, c) in self.grads:
                gk, gv = self.grads[l, c]
                self.grads[l, c] = (gk + k.grad, gv + v.grad)
            else:
                self.grads[l, c] = (k.grad, v.grad)

    def backward_roots(self, l, c):
        """Chunk c's key and value and their gradients from the later chunks, for its attention
        backward of layer l (nothing for the last chunk)."""
        if c == self.parts - 1:
            return [], []
        root, grads = self.roots.pop((l, c), None), self.grads.pop((l, c), None)
        if root is None or grads is None:
            raise RuntimeError(
                f"oases: chunk {c}'s attention backward of layer {l} found no gradient from the "
                "later chunks (sequence split ordering); use --oases-split batch and report it"
            )
        return list(root), list(grads)

    def check_empty(self):
        left = [n for n in ("kv", "leaves", "roots", "grads") if getattr(self, n)]
        if left:
            raise RuntimeError(f"oases: sequence split left {', '.join(left)} after backward")
