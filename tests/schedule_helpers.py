"""Worker functions for schedule tests (run on every rank by run_distributed)."""

from megatron_oases.testing.runs import train_and_capture

GPT = (
    "--num-layers {layers} --hidden-size 64 --num-attention-heads 8 --seq-length 16 "
    "--vocab-size 500 --mock-data --lr 1e-2 "
)
LLAMA = GPT + (
    "--swiglu --normalization RMSNorm --num-query-groups 4 "
    "--position-embedding-type rope --disable-bias-linear "
    "--untie-embeddings-and-output-weights "
)


def schedules_worker(base, variants, iters=1, step=False, grads=True):
    """Run each (name, extra flags) variant in turn in this process group."""
    out = {}
    for name, extra in variants:
        r = train_and_capture(base + " " + extra, iters=iters, grads=grads, step=step)
        out[name] = {"losses": r["losses"], "grads": r["grads"], "installed": r["installed"]}
    return out
