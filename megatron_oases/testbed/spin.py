"""A stand-in for a collective's kernels on CUDA: ``blocks`` one-warp programs that spin on the
GPU's global nanosecond timer for a given time, in one launch (Triton; imported only on CUDA).

NCCL runs one block per channel on as many SMs; each program here is one such block. Used by
:class:`~.link_model.CudaLink`, which falls back to ``torch.cuda._sleep`` (one block, SM clock
cycles) where this cannot be built.
"""

import triton
import triton.language as tl


@triton.jit
def _now(x):
    # %globaltimer: the GPU's nanosecond clock (unlike clock64, independent of the SM clock)
    return tl.inline_asm_elementwise(
        "mov.u64 $0, %globaltimer;", "=l,r", [x], dtype=tl.int64, is_pure=False, pack=1
    )


@triton.jit
def _spin_kernel(ns, out_ptr):
    pid = tl.program_id(0)
    start = _now(pid)
    now = start
    while now - start < ns:
        now = _now(pid)
    tl.store(out_ptr + pid, now - start)


_buffers = {}


def spin(ns, blocks, device):
    """Enqueue a spin of ``ns`` nanoseconds on ``blocks`` SMs on the current stream."""
    import torch

    key = (str(device), blocks)
    out = _buffers.get(key)
    if out is None:
        out = _buffers[key] = torch.zeros(blocks, dtype=torch.int64, device=device)
    _spin_kernel[(blocks,)](max(1, int(ns)), out, num_warps=1)
