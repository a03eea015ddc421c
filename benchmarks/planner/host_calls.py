"""Count the aten calls per layer and per iteration of every planner setting and write the table the
planner's host term reads (``megatron_oases/configs/host_calls.yaml``).

Calls are counted, not timed (``oases compare``'s host pass: rank 0 alone, ``torch.profiler``, L
and 2L layers), at the report's sequence length (1024) with a small hidden size, with Megatron's
default dropout (0.1, as the paper's models train). The count is mostly the code path's (the
schedule, its sub-batches, the split, the recompute setting) but not only: on the CPU path some
kernels issue nested calls by shape, and stock's calls per layer measured 717-872 without
recompute across (H, s, TP) in (64-256, 32-1024, 2-4); the GPU path differs again (the GPU check's
host step counts it there). The table is an estimate of that order.

Sharded data parallelism (``sharding``): the calls torch FSDP2 adds per layer and per
micro-batch, stock and under a split schedule (its gathers, reshards and reduce-scatters: FSDP2's
hooks, or the engine's ``unshard``), counted as the difference between ``--use-torch-fsdp2`` and
DDP at :data:`SHARDING_SHAPE` (TP 1, DP 2: two gloo ranks, rank 0's count; FSDP2 does not run on
the fake process group). Megatron-FSDP runs on CUDA only and is not counted (the planner charges
its strategies FSDP2's count: an estimate).

Usage::

    python benchmarks/planner/host_calls.py            # rewrites the packaged table
    python benchmarks/planner/host_calls.py --sharding-only  # recounts only its sharding rows
    python benchmarks/planner/host_calls.py --by-op    # calls per layer by aten op, per schedule
                                                       # (docs/host-cost.md), and the Python
                                                       # time in megatron_oases frames per layer
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


#: The sharding rows' shape: :data:`SHAPE` at TP 1 over two data-parallel ranks (one micro-batch
#: of 2 samples per rank), untied (FSDP2 needs it).
def _set(argv, flag, value):
    """``argv`` with ``flag``'s value replaced."""
    out = list(argv)
    out[out.index(flag) + 1] = value
    return out


SHARDING_SHAPE = _set(_set(SHAPE, "--tensor-model-parallel-size", "1"), "--global-batch-size", "4")
SHARDING_SHAPE += ["--untie-embeddings-and-output-weights"]
#: (row, schedule, recompute): stock, and a split schedule (the engine gathers the stage).
SHARDING_ROWS = (("torch_fsdp2/off", "off", "full"), ("torch_fsdp2/split", "oases", "full"))


def _sharding_worker(jobs):
    """A gloo rank of :func:`count_sharding`: each job's aten calls (rank 0's)."""
    from megatron_oases.compare.host import _worker

    return _worker(jobs, os.devnull)


def count_sharding(progress=print):
    """``{row: {"per_layer", "rest"}}``: the calls FSDP2 adds over DDP per layer per micro-batch
    and in the rest of a micro-batch's iteration, stock and under a split schedule."""
    from megatron_oases.compare.host import _with_layers
    from megatron_oases.launch import run_distributed
    from megatron_oases.planner.choose import launch_flags

    layers, jobs = 2, []
    for row, schedule, recompute in SHARDING_ROWS:
        for fsdp in ((), ("--use-torch-fsdp2",)):
            argv = SHARDING_SHAPE + launch_flags(schedule, recompute).split() + list(fsdp)
            for n in (layers, 2 * layers):
                argv_n = [a for a in _with_layers(argv, n) if a != "--fake-process-group"]
                jobs.append(((row, bool(fsdp)), n, argv_n))
    counts = run_distributed(_sharding_worker, 2, jobs, timeout=600 * len(jobs))[0]
    out = {}
    for row, *_ in SHARDING_ROWS:
        per, rest = {}, {}
        for fsdp in (False, True):
            c1, c2 = counts[((row, fsdp), layers)], counts[((row, fsdp), 2 * layers)]
            if isinstance(c1, dict) or isinstance(c2, dict):
                raise SystemExit(f"{row}: {(c1 if isinstance(c1, dict) else c2)['error']}")
            per[fsdp] = (c2 - c1) / layers
            rest[fsdp] = c1 - layers * per[fsdp]
        out[row] = {
            "per_layer": round(per[True] - per[False], 1),
            "rest": round(rest[True] - rest[False], 1),
        }
        progress(f"{row}: {out[row]['per_layer']} calls per layer more than DDP")
    return out


#: ``--by-op``'s shape: small, so that each count takes seconds on a CPU.
BY_OP_SHAPE = [
    "--tensor-model-parallel-size", "2", "--hidden-size", "64", "--num-attention-heads", "4",
    "--seq-length", "128", "--max-position-embeddings", "128", "--micro-batch-size", "2",
    "--global-batch-size", "2", "--vocab-size", "128", "--hidden-dropout", "0.1",
    "--attention-dropout", "0.1",
]  # fmt: skip
#: ``--by-op``'s settings: (name, schedule, recompute, extra flags). ``off x2`` is stock on the
#: same micro-batch as two micro-batches of one sample each, the batch split's two sub-batches:
#: each op runs twice, the optimizer step (per parameter, in the per-layer count) once, so it is
#: the count a split schedule has without any call of its own.
BY_OP_SETTINGS = [
    ("off/none", "off", "none", ()),
    ("off x2/none", "off", "none", ("--micro-batch-size", "1")),
    ("overlap/none", "overlap", "none", ()),
    ("off/full", "off", "full", ()),
    ("off x2/full", "off", "full", ("--micro-batch-size", "1")),
    ("oases/full", "oases", "full", ()),
    ("cross-pass/full", "cross-pass", "full", ()),
]
#: Iterations timed under cProfile, then without it (the fastest of each counts; the unprofiled
#: time per layer is a difference of two runs, so it takes more samples to settle).
TIMED = 6
UNPROFILED = 20


def _python_time(argv):
    """The main thread's CPU time in ``train_step`` under cProfile (the fastest of :data:`TIMED`
    calls after the first), and the self time of the ``megatron_oases`` Python frames in it (s).
    Thread CPU time, not wall time: the host's own cost, unmoved by other processes on a busy
    machine (autograd runs CPU backward on this thread; intra-op worker threads are not counted)."""
    from megatron_oases.instrument.host_calls import python_time_patch
    from megatron_oases.training.pretrain import run_in_process

    record = {}
    argv = list(argv) + ["--train-iters", str(1 + TIMED + UNPROFILED)]
    patch = python_time_patch(record, 2, TIMED, unprofiled_calls=UNPROFILED)
    run_in_process(argv, demo=True, extra_patches=[patch])
    return {
        "wall_s": record["thread_s"],
        "oases_s": record["by_package"].get("megatron_oases", 0.0),
        "platform_s": record["platform_s"],
        "unprofiled_s": record["thread_s_unprofiled"],
    }


def _by_op_worker(jobs):
    """One-rank process: per (name, layers, argv) job, the second iteration's aten calls by op
    name and its cProfile'd Python time (a second run, so the profilers do not add up)."""
    import torch

    from megatron_oases.instrument.host_calls import profiled_step_patch
    from megatron_oases.training.pretrain import run_in_process

    torch.set_num_threads(1)  # every op's CPU work on the issuing thread, which is timed
    out = {}
    for name, layers, argv in jobs:
        record = {}
        run_in_process(argv, demo=True, extra_patches=[profiled_step_patch(record, 2)])
        out[(name, layers)] = {"ops": record["aten_by_op"], **_python_time(argv)}
    return out


def by_op(layers=4, settings=BY_OP_SETTINGS, shape=BY_OP_SHAPE):
    """Per setting: aten calls per layer by op name (calls at 2L − calls at L, ÷ L), the Python
    self time of megatron_oases frames per layer and the step's wall time per layer (both under
    cProfile, which slows Python frames more than aten calls: an upper bound on the share)."""
    from megatron_oases.compare.host import _with_layers
    from megatron_oases.launch import run_distributed
    from megatron_oases.planner.choose import launch_flags

    jobs = []
    for name, schedule, recompute, extra in settings:
        argv = list(shape) + launch_flags(schedule, recompute).split() + list(extra)
        for n in (layers, 2 * layers):
            jobs.append((name, n, _with_layers(argv, n)))
    res = run_distributed(_by_op_worker, 2, jobs, timeout=600 * len(jobs), one_rank=True)[0]
    out = {}
    for name, *_ in settings:
        a, b = res[(name, layers)], res[(name, 2 * layers)]
        ops = {
            k: (b["ops"].get(k, 0) - a["ops"].get(k, 0)) / layers
            for k in set(a["ops"]) | set(b["ops"])
        }
        out[name] = {
            "ops": {k: v for k, v in ops.items() if v},
            "total": sum(ops.values()),
            "oases_s": (b["oases_s"] - a["oases_s"]) / layers,
            "platform_s": (b["platform_s"] - a["platform_s"]) / layers,
            "wall_s": (b["wall_s"] - a["wall_s"]) / layers,
            "unprofiled_s": (b["unprofiled_s"] - a["unprofiled_s"]) / layers,
        }
    return out


def print_by_op(table, pairs=(("overlap/none", "off x2/none"), ("oases/full", "off x2/full"),
                              ("cross-pass/full", "off x2/full"))):  # fmt: skip
    """Each schedule's calls per layer by op beside stock's on two micro-batches (the inherent
    part: each sub-batch runs every op of stock's once), and its Python-frame share."""
    for name, stock in pairs:
        if name not in table or stock not in table:
            continue
        s, t = table[name], table[stock]
        print(f"\n== {name} vs {stock}: {s['total']:.0f} calls per layer "
              f"(stock on two micro-batches {t['total']:.0f}, beyond: "
              f"{s['total'] - t['total']:+.0f})")  # fmt: skip
        ops = sorted(set(s["ops"]) | set(t["ops"]))
        rows = [(k, s["ops"].get(k, 0), t["ops"].get(k, 0)) for k in ops]
        rows = [r for r in rows if r[1] != r[2]]
        for k, a, b in sorted(rows, key=lambda r: -(r[1] - r[2])):
            print(f"  {k:40s} {a:8.1f} {b:8.1f} {a - b:+8.1f}")
    print(
        "\nPython self time in megatron_oases frames per layer (cProfile), of the layer's "
        "(in brackets: less the CPU platform stand-ins, which a GPU host does not run):"
    )
    for name, r in table.items():
        wall = r["wall_s"] if r["wall_s"] > 0 else float("nan")
        share = 100 * r["oases_s"] / wall
        schedule = 100 * (r["oases_s"] - r["platform_s"]) / wall
        print(f"  {name:18s} {1e3 * r['oases_s']:8.2f} ms of {1e3 * r['wall_s']:8.2f} ms "
              f"({share:.1f} % [{schedule:.1f} %]), {r['total']:.0f} aten calls; unprofiled "
              f"{1e3 * r['unprofiled_s']:.2f} ms per layer")  # fmt: skip


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=TABLE_PATH)
    p.add_argument("--by-op", action="store_true", help="print calls per layer by op instead")
    p.add_argument("--json", help="with --by-op: also write the table here")
    p.add_argument(
        "--sharding-only", action="store_true", help="recount only the sharding rows of --out"
    )
    args = p.parse_args(argv)
    if args.by_op:
        table = by_op()
        if args.json:
            import json

            with open(args.json, "w") as f:
                json.dump(table, f, indent=1, sort_keys=True)
        print_by_op(table)
        return 0
    import yaml

    if args.sharding_only:
        with open(args.out) as f:
            doc = yaml.safe_load(f)
    else:
        doc = {
            "measured": datetime.date.today().isoformat(),
            "command": "python benchmarks/planner/host_calls.py",
            "shape": " ".join(SHAPE),
            "settings": count_settings(SHAPE, nproc=2, progress=print),
        }
    doc["sharding_measured"] = datetime.date.today().isoformat()
    doc["sharding_shape"] = " ".join(SHARDING_SHAPE)
    doc["sharding"] = count_sharding(progress=print)
    header = (
        "# aten calls per layer per micro-batch (and the rest of one micro-batch's iteration) of\n"
        "# each planner setting, counted by benchmarks/planner/host_calls.py (do not edit by\n"
        "# hand). The planner's host term: calls x the cluster profile's host_us_per_call.\n"
        "# sharding: the calls torch FSDP2 adds to a setting, stock (off) and under a split\n"
        "# schedule, per layer per micro-batch and in the rest (Megatron-FSDP: not counted).\n"
    )
    with open(args.out, "w") as f:
        f.write(header + yaml.safe_dump(doc, sort_keys=False))
    print(f"wrote {args.out}")
    print(
        "if its counts changed: bump HOST_TABLE_VERSION (megatron_oases/planner/host_model.py) "
        "in the same commit; tests/unit/test_report_versions.py then names the reports to "
        "regenerate"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
