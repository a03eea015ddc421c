"""The planner's host term: the time the host needs to issue a planned setting's iteration.

A GPU cannot run an iteration faster than its host issues the kernels, and splitting a micro-batch
into sub-batches issues more calls (each block twice, plus the schedule's bookkeeping). Per
setting (schedule, recompute, split) the packaged table ``configs/host_calls.yaml`` gives the aten
calls per layer per micro-batch and the rest of a micro-batch's iteration (embedding, loss,
optimizer), counted by ``benchmarks/planner/host_calls.py`` at one shape with dropout: calls
follow the code path mostly, but some kernels issue nested calls by shape (±10-15 % across shapes
on the CPU path), so the table is an estimate of that order. The host time of an iteration =
calls × the cluster profile's ``host_us_per_call``. Sharded data parallelism (FSDP) adds its own
calls per layer and per micro-batch (:func:`sharding_calls`).

**The queue.** The host issues asynchronously and runs ahead of the device; it waits for the
device only at the iteration's end (the loss is read back). So an iteration takes at least the
longer of the two timelines: ``max(device time, host time)``. Layers of one stage are alike, so
the per-layer imbalance a finer model would see (some layers host-bound, others not) is left out,
and so is the part of the host's issue the device hides at the start of the iteration.
"""

import functools

import yaml

from .. import resources
from ..errors import OasesConfigError

TABLE_PATH = resources.data_path("host_calls.yaml")
#: The version of the host-call table (configs/host_calls.yaml, rewritten by
#: benchmarks/planner/host_calls.py): bump it (to the day's date) in the same commit that changes
#: its counts; the planner's reports record it (tests/unit/test_report_versions.py).
HOST_TABLE_VERSION = "2026-12-07"


def setting_key(schedule, recompute, split="batch"):
    """``"oases/full"``, ``"overlap/selective+ln/sequence"``: a setting's row in the table."""
    return f"{schedule}/{recompute}" + ("/sequence" if split == "sequence" else "")


@functools.lru_cache(maxsize=4)
def _load(path):
    with open(path) as f:
        return yaml.safe_load(f)


def load_table(path=TABLE_PATH):
    return _load(path)["settings"]


def sharding_calls(sharding, schedule, table=None):
    """(calls per layer per micro-batch, rest per micro-batch) that sharding strategy
    ``sharding`` adds to ``schedule``'s: torch FSDP2's, counted stock and under a split schedule
    (the table's ``sharding`` rows); Megatron-FSDP's are not counted, so its strategies are
    charged FSDP2's count, stock and split (an estimate of that order)."""
    if not sharding:
        return 0.0, 0.0
    table = _load(TABLE_PATH).get("sharding", {}) if table is None else table
    key = "torch_fsdp2/" + ("off" if schedule == "off" else "split")
    if key not in table:
        raise OasesConfigError(
            f"no host-call count for {key}: rerun benchmarks/planner/host_calls.py --sharding-only"
        )
    return float(table[key]["per_layer"]), float(table[key]["rest"])


def calls_per_layer(schedule, recompute, split="batch", subs=2, table=None):
    """(calls per layer per micro-batch, rest per micro-batch) of one setting; with ``subs`` other
    than the table's 2 sub-batches the schedule's calls above stock's grow with the sub-batches
    beyond the first (an estimate: the table counts 2)."""
    table = table or load_table()
    key = setting_key(schedule, recompute, split)
    if key not in table:
        raise OasesConfigError(
            f"no host-call count for {key}: rerun benchmarks/planner/host_calls.py"
        )
    row = table[key]
    per_layer, rest = float(row["per_layer"]), float(row["rest"])
    if schedule != "off" and subs != 2:
        stock = table[setting_key("off", recompute)]
        per_layer = stock["per_layer"] + (per_layer - stock["per_layer"]) * (subs - 1)
    return per_layer, rest


def host_time(schedule, recompute, split, subs, layers, num_microbatches, host_us_per_call,
              recompute_num_layers=None, table=None, sharding=None):  # fmt: skip
    """(seconds, calls) the host needs to issue one iteration of one pipeline stage's ``layers``
    (``recompute_num_layers``: Megatron's block method, only the first that many layers
    recomputed, the others issued as without recompute; ``sharding``: a data-parallel sharding
    strategy, whose calls come on top, :func:`sharding_calls`)."""
    per, rest = calls_per_layer(schedule, recompute, split, subs, table)
    if recompute_num_layers is not None and recompute == "full":
        # layers past the first N keep their activations: stock's, or the per-pass overlap's
        # (which is how cross-pass and oases run a layer they do not recompute)
        kept, _ = calls_per_layer(
            "off" if schedule == "off" else "overlap", "none", split, subs, table
        )
        n = min(recompute_num_layers, layers)
        layer_calls = n * per + (layers - n) * kept
    else:
        layer_calls = layers * per
    shard_per, shard_rest = sharding_calls(sharding, schedule)
    layer_calls += layers * shard_per
    rest += shard_rest
    calls = num_microbatches * (layer_calls + rest)
    return calls * host_us_per_call * 1e-6, calls
