"""The ``batch`` sub-batch cut (the paper's): sub-batch i is a run of whole samples, cut along b
of [s, b, h] (and of the [b, s] token tensors); sub-batches never meet, and an attention mask is
cut per sample. The interface every split offers the engine (the ``sequence`` cut, which needs
Megatron's attention, is ``schedule/megatron/split.py``'s :class:`SequenceSplit`)."""

import torch

from ...validation import SUB_BATCHES, check_splittable


def split_sizes(n, parts=SUB_BATCHES):
    """``n`` cut into ``parts`` runs, larger first: 3 → [2, 1]."""
    base, extra = divmod(n, parts)
    return [base + (1 if i < extra else 0) for i in range(parts)]


class BatchSplit:
    """Sub-batches of whole samples."""

    hidden_dim, token_dim = 1, 0  # b of [s, b, h]; b of [b, s]

    def __init__(self, hidden_shape, parts=SUB_BATCHES, device=None):
        b = hidden_shape[1]
        check_splittable(b, parts=parts)
        self.total = b
        self.sizes = split_sizes(b, parts)

    def _cut(self, t, dim):
        if t is None or len(self.sizes) == 1:
            return [t] * len(self.sizes)
        return list(torch.split(t, self.sizes, dim=dim))

    def hidden(self, t):
        return self._cut(t, self.hidden_dim)

    def tokens(self, t):
        """A [b, s] tensor (ids, positions, labels, per-token loss) per sub-batch; shared when it
        is not per-sample."""
        if t is None or t.dim() < 2 or t.size(self.token_dim) != self.total:
            return [t] * len(self.sizes)
        return self._cut(t, self.token_dim)

    def masks(self, mask):
        """The attention mask per sub-batch: cut when it is per-sample, shared otherwise."""
        if mask is None or mask.dim() == 0 or mask.size(0) != self.total or self.total == 1:
            return [mask] * len(self.sizes)
        return list(torch.split(mask, self.sizes, dim=0))

    def rotary(self, rotary_pos_emb):
        return [rotary_pos_emb] * len(self.sizes)

    def backward_order(self):
        """The order of the backward programs (sub-batch indices)."""
        return list(range(len(self.sizes)))

    def prefix_attention(self, blocks):
        """The cross-sub-batch attention state (:class:`PrefixAttention`), None for samples."""
        return None

    def join_hidden(self, pieces):
        return torch.cat(pieces, dim=self.hidden_dim)

    def join_tokens(self, pieces):
        return torch.cat(pieces, dim=self.token_dim)
