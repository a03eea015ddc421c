"""Deterministic mock data: each global sample index maps to one learnable token sequence.

A sample is an arithmetic progression modulo the vocabulary with a random start and stride, so the
loss falls as the model learns it. Sample ``i`` of iteration ``t`` depends only on (seed, t, i), so
every parallel layout (and every schedule) sees exactly the same global batch.
"""

import torch
from megatron.core import parallel_state


def mock_sample(seed, iteration, index, seq_length, vocab_size):
    gen = torch.Generator().manual_seed((seed * 7919 + iteration) * 1000003 + index)
    start = torch.randint(0, vocab_size, (1,), generator=gen)
    stride = torch.randint(1, max(2, min(vocab_size, 17)), (1,), generator=gen)
    return (start + stride * torch.arange(seq_length + 1)) % vocab_size


def mock_batch(args, iteration, microbatch):
    """Micro-batch ``microbatch`` of this DP rank at ``iteration`` as a dict of [b, s] tensors."""
    dp_rank = parallel_state.get_data_parallel_rank()
    mbs = args.micro_batch_size
    per_rank = args.global_batch_size // args.data_parallel_size
    first = dp_rank * per_rank + microbatch * mbs
    seqs = torch.stack(
        [
            mock_sample(args.seed, iteration, first + j, args.seq_length, args.vocab_size)
            for j in range(mbs)
        ]
    )
    tokens = seqs[:, :-1].contiguous()
    labels = seqs[:, 1:].contiguous()
    position_ids = torch.arange(args.seq_length).unsqueeze(0).expand(mbs, -1).contiguous()
    return {
        "tokens": tokens,
        "labels": labels,
        "loss_mask": torch.ones_like(tokens, dtype=torch.float32),
        "position_ids": position_ids,
    }


def mock_data_iterator(args, iteration):
    """Iterator over this iteration's micro-batches (what Megatron's schedules pull from)."""
    return (mock_batch(args, iteration, m) for m in range(args.num_microbatches))
