"""The profiling job every rank runs: process groups per degree, the probes, the max over ranks.

For every candidate degree ``d`` the ranks are partitioned into groups of ``d``
(``torch.distributed.new_group``) and each group builds one layer with ``pg_collection.tp`` = its
group, so all ranks work at once as in training; each sub-batch size in play is probed
(:mod:`.probes`) and the maximum over ranks kept. Communication is timed on its own: ``all_reduce``
on every TMP group size and ``all_gather_into_tensor`` on every re-shard group (strided ranks), at
the message sizes in play plus a spread; with sequence parallelism also the all-gather and
``reduce_scatter_tensor`` on every TMP group.

Under ``--emulate-link PROFILE`` the testbed's link emulator is installed first, so communication is
timed as emulated (and compute in host time): the profile then predicts the emulated testbed.

Separate from :mod:`.measured` because this is what runs inside each (spawned or torchrun) rank,
while the driver runs once: it picks the sizes, caches, spawns and assembles.
"""

import argparse
import time

from ..formats.profile import ranks_key, tp_ranks
from .probes import build_layer, comm_time, profile_block_times


def _max_over_ranks(values):
    import torch
    import torch.distributed as dist

    t = torch.tensor(values, dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.tolist()


def profile_worker(payload):
    """Runs on every rank (default process group up). Returns the profile pieces on every rank."""
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state, tensor_parallel

    from .. import platform

    margs = argparse.Namespace(**payload["args"])
    degrees, repeats = payload["degrees"], payload["repeats"]
    phases = {"start": time.time() - payload["t0"]}
    t_phase = time.time()

    def mark(name):
        nonlocal t_phase
        now = time.time()
        phases[name] = now - t_phase
        t_phase = now

    platform.install_cpu_shims()
    world, rank = dist.get_world_size(), dist.get_rank()
    parallel_state.destroy_model_parallel()
    # no gloo side groups on the fake process group of a one-rank run (gloo cannot join it)
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=1, create_gloo_process_groups=dist.get_backend() != "fake"
    )
    tensor_parallel.model_parallel_cuda_manual_seed(1234)
    patch = None
    if payload.get("emulate_link"):
        from ..config import EmulatedLink, OasesConfig
        from ..patches import install_patch
        from ..testbed.emulator import make_patch

        patch = make_patch(OasesConfig(emulate_link=EmulatedLink(payload["emulate_link"])))
        install_patch(patch)
    try:
        # every rank creates every group in the same order
        singles = {r: dist.new_group([r]) for r in range(world)}
        tp_groups = {}
        for d in degrees:
            for base in range(0, world, d):
                ranks = list(range(base, base + d))
                g = dist.new_group(ranks)
                if rank in ranks:
                    tp_groups[d] = g
        gather_groups = {}
        for key, (lo, hi) in payload["gathers"].items():
            for base in range(0, world, hi):
                for o in range(lo):
                    ranks = [base + o + i * lo for i in range(hi // lo)]
                    g = dist.new_group(ranks)
                    if rank in ranks:
                        gather_groups[key] = g

        mark("setup_groups")
        compute, saved, params = {}, {}, {}
        for d in degrees:
            layer = build_layer(margs, d, tp_groups[d], singles[rank])
            params[d] = sum(p.numel() for p in layer.parameters())
            compute[d], saved[d] = {}, {}
            for n in payload["sizes"][str(d)]:
                dist.barrier()
                t, b = profile_block_times(layer, margs, n, repeats)
                keys = [(blk, ph) for blk in sorted(t) for ph in sorted(t[blk])]
                flat = _max_over_ranks([t[blk][ph] for blk, ph in keys])
                compute[d][n] = {blk: {} for blk in t}
                for (blk, ph), v in zip(keys, flat):
                    compute[d][n][blk][ph] = v
                saved[d][n] = b
            del layer

        mark("compute")

        def timed(op, group):
            return [
                [n, _max_over_ranks([comm_time(op, group, n, repeats)])[0]]
                for n in payload["messages"]
            ]

        comm = {"all_reduce": {}, "all_gather": {}}
        tp_ops = ["all_reduce"]
        if payload.get("sequence_parallel"):
            comm["reduce_scatter"] = {}
            tp_ops += ["all_gather", "reduce_scatter"]
        for d in degrees:
            for op in tp_ops if d > 1 else ():
                comm[op][ranks_key(tp_ranks(d))] = timed(op, tp_groups[d])
        for key, (lo, hi) in payload["gathers"].items():
            comm["all_gather"][key] = timed("all_gather", gather_groups[key])
        mark("comm")
        dilation = getattr(getattr(patch, "emulator", None), "dilation", None)
        return {
            "phase_seconds": phases,
            "compute": compute,
            "saved": saved,
            "params": params,
            "comm": comm,
            "dilation": dilation,
            "threads": torch.get_num_threads(),
        }
    finally:
        if patch is not None:
            from ..patches import uninstall

            uninstall(patch.name)
        parallel_state.destroy_model_parallel()
