"""``split``: the compute cost of splitting: one micro-batch of 2 against two of 1, no
communication (stock, no recompute)."""

from .common import fake_group, flags, on_cuda, one_rank_job, shapes, variant_flags

LIMIT_S = 60
OPTIONS = ()


def run(dry):
    """Compute cost of the split: stock without recompute at micro-batch 2 against micro-batch 1
    twice, no communication cost (the fake group's collectives return at once)."""
    s = shapes(dry)
    fake_group(2)
    out = {}
    for name in ("megatron-norecompute", "megatron-halfmb-norecompute"):
        argv = flags(
            f"--num-layers 2 {s['timing']} --vocab-size {s['vocab']} --mock-data "
            "--tensor-model-parallel-size 2 --micro-batch-size 2 --global-batch-size 2 "
            "--hidden-dropout 0 --attention-dropout 0"
        )
        argv += (["--bf16"] if on_cuda() else []) + variant_flags(name, 2, 2)
        out[name] = one_rank_job(argv, 3 if dry else 6)["median_s"]
    out["half_x2_over_full"] = out["megatron-halfmb-norecompute"] / out["megatron-norecompute"]
    return out


def report(split, env=None):
    return [
        "",
        "## Split cost",
        "",
        f"micro-batch 1 twice ÷ micro-batch 2 once (stock, no recompute, no communication): "
        f"{split['half_x2_over_full']:.3f}",
    ]
