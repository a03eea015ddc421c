"""Schedule traces (``--oases-trace``) for tests: run variants with tracing, load them, and find the
collectives that no compute of the other sub-batch hid."""

import glob
import json

from megatron_oases.launch import run_distributed


def _trace_worker(base, variants, outdir):
    from .runs import pretrain_and_capture

    for name, extra in variants:
        pretrain_and_capture(f"{base} {extra} --oases-trace {outdir}/{name}.json")
    return True


def traced_runs(base, variants, outdir, world=2):
    """{variant: [per-rank trace dict]} of one traced iteration per variant."""
    run_distributed(_trace_worker, world, base, variants, str(outdir), timeout=280)
    return {
        name: [json.load(open(p)) for p in sorted(glob.glob(f"{outdir}/{name}.rank*.json"))]
        for name, _ in variants
    }


def block_comms(trace):
    """The collectives of the transformer layers (not the embedding's or the loss's)."""
    return [e for e in trace["traceEvents"] if e["cat"] == "comm" and e["args"]["layer"] >= 0]


def end_comms(trace, block, pass_):
    """The collectives the schedule issues for a stage end (``block``: embedding or output)."""
    return [
        e
        for e in trace["traceEvents"]
        if e["cat"] == "comm"
        and e["args"].get("block") == block
        and e["args"]["pass"] == pass_
        and e["args"].get("async")
    ]


def overlapped_by_other(comm, computes):
    """Whether a compute of another sub-batch ran inside ``comm``'s issue-to-wait window."""
    sb = comm["args"]["sub_batch"]
    start, end = comm["ts"], comm["args"]["wait_us"]
    return any(
        c["args"]["sub_batch"] not in (sb, -1)
        and c["ts"] >= start
        and c["ts"] + c["dur"] <= end + 1e-3
        for c in computes
    )


def unhidden_inner_comms(trace):
    """Each pass's collectives but its last (nothing is left to hide that one behind) during which
    no compute of another sub-batch ran; asserts they were all asynchronous."""
    computes = [e for e in trace["traceEvents"] if e["cat"] == "compute"]
    comms = block_comms(trace)
    assert comms and all(e["args"]["async"] for e in comms)
    missing = []
    for mb in {e["args"]["microbatch"] for e in comms}:
        for phase in (("forward",), ("recompute", "backward")):
            seq = sorted(
                (e for e in comms if e["args"]["microbatch"] == mb and e["args"]["pass"] in phase),
                key=lambda e: e["ts"],
            )
            missing += [
                e["name"] + str(e["args"]) for e in seq[:-1] if not overlapped_by_other(e, computes)
            ]
    return missing
