"""Measured profiles: one Megatron-Core ``TransformerLayer`` per candidate TMP degree, on real groups.

For every degree ``d`` the ranks are partitioned into groups of ``d`` and each group builds one layer
on its group, so all ranks work at once as in training. Per block half and per sub-batch size in
play (``n = m·d/T`` samples per group and its halves) the forward, recompute and backward times are
measured with the TP all-reduces switched off, the medians over ``--repeats`` (after a warm-up),
maximum over ranks; communication is timed on its own and fitted ``t = α + β·bytes``; memory counts
parameters and the bytes each half saves for backward.

Under ``--emulate-link PROFILE`` communication is timed on the testbed's emulated links
(:mod:`.worker`), and the emulated cluster is part of the cache key.

Profiles are cached under ``$OASES_CACHE_DIR`` (default ``~/.cache/megatron-oases/profiles``) by a
hardware fingerprint and a hash of shape, degrees, sizes and settings.

Layout, from the top: this module is the driver (what to measure, the cache, starting the ranks);
:mod:`.worker` is the job each rank runs (groups, max over ranks); :mod:`.probes` the single-rank
measurements; :mod:`.assemble` turns the ranks' result into the profile file.
"""

import os
import platform as _platform
import time

from ..errors import OasesConfigError
from ..formats.profile import gather_ranks, load_profile, ranks_key, save_profile, sha256_of
from ..validation import samples_per_group
from .analytic import candidate_degrees
from .assemble import assemble
from .model_config import shape_of
from .worker import profile_worker

# ---------------------------------------------------------------------- fingerprint and cache
# Bumped whenever what is measured changes, so cached profiles measured the old way are not reused
# (2: the runtime peak frees each weight gradient once accumulated, as DDP does, the meter no longer
# counts views/in-place results of pre-existing tensors, per-block peaks, values per sample count;
# 3: the layer's TransformerConfig from Megatron-LM's core_transformer_config_from_args;
# 4: core attention's forward time and the attention half's saved bytes under selective recompute).
MEASUREMENT_REVISION = 4


def hardware_fingerprint(world_size, emulate_link=None, one_rank=False):
    import torch

    cpu = _platform.processor() or _platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    try:
        from megatron.core import __version__ as mcore
    except Exception:  # noqa: BLE001
        mcore = "?"
    return {
        "cpu": cpu,
        "logical_cpus": os.cpu_count(),
        "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        "torch": torch.__version__,
        "megatron_core": mcore,
        "world_size": int(world_size),
        "threads_per_rank": int(os.environ.get("OMP_NUM_THREADS", "1")),
        "emulate_link": emulate_link,
        **({"one_rank": True} if one_rank else {}),  # only then: earlier caches stay valid
        "emulate_dilation_env": os.environ.get("OASES_EMULATE_DILATION"),
        "host_flops_env": os.environ.get("OASES_HOST_FLOPS"),
    }


def default_cache_dir():
    return os.environ.get("OASES_CACHE_DIR") or os.path.join(
        os.path.expanduser("~"), ".cache", "megatron-oases", "profiles"
    )


def sizes_in_play(micro_batch, tp, degrees):
    """Samples per group per (sub-)batch for each degree: n = m·d/T, ⌈n/2⌉, ⌊n/2⌋ (and 1, 2)."""
    out = {}
    for d in degrees:
        s = {1, 2}
        n = samples_per_group(micro_batch, d, tp)
        if n == int(n):
            s |= {n, n - n // 2, n // 2}
        out[d] = sorted(x for x in s if x >= 1)
    return out


# ---------------------------------------------------------------------- driver
def measured_profile(
    margs,
    degrees=None,
    nproc=None,
    emulate_link=None,
    repeats=3,
    cache_dir=None,
    use_cache=True,
    timeout=3600,
    one_rank=False,
):
    """Measure (or load from cache) a profile for ``margs``; returns the profile dict (on rank 0
    under torchrun; None on the other ranks). ``one_rank``: rank 0 alone on the fake process
    group, the other ranks virtual (timing-only; needs ``emulate_link``)."""
    import json

    T = margs.tensor_model_parallel_size
    degrees = sorted(degrees or candidate_degrees(margs, T))
    world = nproc or int(os.environ.get("WORLD_SIZE", "0")) or max(degrees)
    if max(degrees) > world or world % max(degrees):
        raise OasesConfigError(
            f"measuring degree {max(degrees)} needs a multiple of {max(degrees)} ranks; got {world}"
        )
    if margs.fp16 or margs.bf16:
        raise OasesConfigError(
            "measured profiles run in fp32 on CPU; drop fp16/bf16 from the model"
        )
    m = margs.micro_batch_size
    sizes = sizes_in_play(m, T, degrees)
    shape = shape_of(margs)
    shape["name"] = getattr(margs, "name", None)
    hid = margs.seq_length * margs.hidden_size * 4
    msgs = sorted(
        {n * hid for ns in sizes.values() for n in ns} | {m * hid} | {hid // 4, hid * 4 * max(1, m)}
    )
    gathers = {}
    top = max(degrees)
    for i, lo in enumerate(degrees):
        for hi in degrees[i + 1 :]:
            gathers[ranks_key(gather_ranks(lo, hi))] = (lo, hi)
    for d in degrees:
        if d < T and T <= world and T % d == 0:
            gathers.setdefault(ranks_key(gather_ranks(d, T)), (d, T))
    del top
    if one_rank and not emulate_link:
        raise OasesConfigError(
            "--one-rank needs --emulate-link PROFILE: the virtual ranks' collectives take no "
            "time otherwise"
        )
    if emulate_link:  # a bad cluster profile: one line here, not a traceback in every rank
        from ..testbed.clusters import load_cluster

        load_cluster(emulate_link)
    fp = hardware_fingerprint(world, emulate_link, one_rank)
    settings = {
        "shape": shape,
        "T": T,
        "degrees": degrees,
        "sizes": sizes,
        "messages": msgs,
        "repeats": repeats,
        "micro_batch_size": m,
        "data_parallel_size": margs.data_parallel_size,
        "method": MEASUREMENT_REVISION,
    }
    sp = bool(getattr(margs, "sequence_parallel", False))
    if sp:  # only then, so that caches of profiles without SP stay valid
        settings["sequence_parallel"] = True
    cache_key = sha256_of({"hardware": fp, "settings": settings})
    cache_dir = cache_dir or default_cache_dir()
    cache_path = os.path.join(cache_dir, f"profile-{cache_key[:20]}.json")
    in_torchrun = (
        "WORLD_SIZE" in os.environ and "RANK" in os.environ and "MASTER_ADDR" in os.environ
    )
    rank = int(os.environ.get("RANK", "0")) if in_torchrun else 0
    if use_cache and os.path.exists(cache_path):
        data = load_profile(cache_path).data
        data["from_cache"] = True
        return data if rank == 0 else None

    payload = {
        "args": dict(vars(margs)),  # Megatron's validated args: the layer's TransformerConfig
        "degrees": degrees,
        "repeats": repeats,
        "sizes": {str(d): v for d, v in sizes.items()},
        "messages": msgs,
        "gathers": gathers,
        "sequence_parallel": sp,
        "emulate_link": emulate_link,
        "t0": time.time(),
    }
    if in_torchrun and one_rank:
        raise OasesConfigError("--one-rank starts its own process; run it without torchrun")
    if in_torchrun:
        import torch.distributed as dist

        if not dist.is_initialized():
            dist.init_process_group("gloo")
        if dist.get_world_size() != world:
            raise OasesConfigError("--nproc disagrees with the torchrun world size")
        result = profile_worker(payload)
    else:
        from ..launch import run_distributed

        quiet = {"PYTHONWARNINGS": "ignore"}
        old = {k: os.environ.get(k) for k in quiet}
        os.environ.update(quiet)  # spawned ranks inherit it: no Megatron import warnings
        try:
            result = run_distributed(
                profile_worker, world, payload, timeout=timeout, one_rank=one_rank
            )[0]
        finally:
            for k, v in old.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
    if rank != 0:
        return None
    data = assemble(margs, shape, T, degrees, result, fp, cache_key, emulate_link)
    os.makedirs(cache_dir, exist_ok=True)
    save_profile(data, cache_path)  # whole or not at all: a cut cache is never read back
    return data
