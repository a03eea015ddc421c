"""Count the aten calls per layer and per iteration of every planner setting and write the table the
planner's host term reads (``megatron_oases/configs/host_calls.yaml``).

Calls are counted, not timed (``oases compare``'s host pass: rank 0 alone, ``torch.profiler``, L
and 2L layers), at the report's sequence length (1024) with a small hidden size, with Megatron's
default dropout (0.1, as the paper's models train). The count is mostly the code path's (the
schedule, its sub-batches, the split, the recompute setting) but not only: on the CPU path some
kernels issue nested calls by shape, and stock's calls per layer measured 717-872 without
recompute across (H, s, TP) in (64-256, 32-1024, 2-4); the GPU path differs again (the GPU check's
host step counts it there). The table is an estimate of that order.

Usage::

    python benchmarks/planner/host_calls.py            # rewrites the packaged table
"""

import argparse
import datetime
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, ROOT)

from megatron_oases.planner.host_model import TABLE_PATH, setting_key  # noqa: E402

SHAPE = [
    "--tensor-model-parallel-size", "2", "--num-layers", "2", "--hidden-size", "256",
    "--num-attention-heads", "8", "--seq-length", "1024", "--max-position-embeddings", "1024",
    "--micro-batch-size", "2", "--global-batch-size", "2", "--vocab-size", "512",
    "--hidden-dropout", "0.1", "--attention-dropout", "0.1",
]  # fmt: skip


def count_settings(shape_argv, nproc=2, progress=print):
    """``{setting key: {"per_layer", "rest"}}`` for every setting ``oases plan --schedule auto``
    plans (:data:`~megatron_oases.planner.choose.SETTINGS`, both splits where they apply): calls
    per layer per micro-batch, and the rest of a one-micro-batch iteration (embedding, loss,
    optimizer)."""
    import tempfile

    from megatron_oases.compare.host import count_calls
    from megatron_oases.compare.variants import Variant
    from megatron_oases.planner.choose import SETTINGS, launch_flags
    from megatron_oases.profiler.model_config import parse_offline
    from megatron_oases.validation import SPLIT_SCHEDULES

    variants = []
    for schedule, recompute in SETTINGS:
        for split in ("batch", "sequence") if schedule in SPLIT_SCHEDULES else ("batch",):
            key = setting_key(schedule, recompute, split)
            flags = tuple(launch_flags(schedule, recompute, split=split).split())
            variants.append(Variant(key, flags, key, "-"))
    parsed = {
        v.name: parse_offline(list(shape_argv) + list(v.flags), world_size=nproc, demo=True)
        for v in variants
    }
    with tempfile.TemporaryDirectory() as d:
        counts = count_calls(variants, shape_argv, parsed, nproc, d, 600, progress)
    out = {}
    for v in variants:
        c = counts[v.name]
        if "error" in c:
            raise SystemExit(f"{v.name}: {c['error']}")
        L = parsed[v.name].num_layers
        per_layer = c["aten_calls_per_layer"]
        out[v.name] = {
            "per_layer": round(per_layer, 1),
            "rest": round(c["aten_calls_per_iteration"] - L * per_layer, 1),
        }
        progress(f"{v.name}: {out[v.name]['per_layer']} calls per layer")
    return out


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=TABLE_PATH)
    args = p.parse_args(argv)
    import yaml

    table = count_settings(SHAPE, nproc=2, progress=print)
    doc = {
        "measured": datetime.date.today().isoformat(),
        "command": "python benchmarks/planner/host_calls.py",
        "shape": " ".join(SHAPE),
        "settings": table,
    }
    header = (
        "# aten calls per layer per micro-batch (and the rest of one micro-batch's iteration) of\n"
        "# each planner setting, counted by benchmarks/planner/host_calls.py (do not edit by\n"
        "# hand). The planner's host term: calls x the cluster profile's host_us_per_call.\n"
    )
    with open(args.out, "w") as f:
        f.write(header + yaml.safe_dump(doc, sort_keys=False))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
