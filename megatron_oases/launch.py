"""Starting ranks: the one place that builds ``torchrun`` command lines (``oases compare``,
benchmarks, tests) and that spawns gloo ranks in-process (``oases profile``, memory measurement,
tests).

:func:`run_distributed` is modelled on nanotron's test helpers: spawn, a free port, a hard timeout
so a hang fails fast, and each rank's return value (or traceback) sent back through a queue.
"""

import io
import multiprocessing as mp
import os
import socket
import subprocess
import sys
import traceback
from datetime import timedelta


def find_free_port():
    """A TCP port free on this host now, for a rendezvous on 127.0.0.1."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torchrun_command(argv, nproc, module="megatron_oases", program=None):
    """``python -m torch.distributed.run --nproc_per_node N --master_port P -m <module> argv`` (or
    ``... PROGRAM argv``), run by this interpreter so that the child ranks see the same environment
    (virtualenv, CPU shims)."""
    target = [program] if program is not None else ["-m", module]
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node",
        str(nproc),
        "--master_port",
        str(find_free_port()),
        *target,
        *argv,
    ]


def _worker(rank, world_size, port, fn, args, queue):
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world_size),
        OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"),
    )
    try:
        import torch
        import torch.distributed as dist

        torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
        dist.init_process_group(
            "gloo", rank=rank, world_size=world_size, timeout=timedelta(seconds=120)
        )
        result = fn(*args)
        # Serialise here: tensors sent through a Queue use shared-memory fds that die with us.
        buf = io.BytesIO()
        torch.save(result, buf)
        queue.put((rank, True, buf.getvalue()))
    except BaseException:  # noqa: BLE001 - every failure must reach the parent
        queue.put((rank, False, traceback.format_exc()))
    finally:
        try:
            import torch.distributed as dist

            if dist.is_initialized():
                dist.destroy_process_group()
        except Exception:  # noqa: BLE001
            pass


def run_distributed(fn, world_size, *args, timeout=300):
    """Run ``fn(*args)`` on ``world_size`` gloo ranks; return the list of per-rank results.

    Raises ``RuntimeError`` with the failing rank's traceback, or on timeout (all ranks killed).
    """
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = find_free_port()
    procs = [
        ctx.Process(target=_worker, args=(r, world_size, port, fn, args, queue))
        for r in range(world_size)
    ]
    for p in procs:
        p.start()
    results, errors = {}, []
    import queue as queue_mod

    try:
        while len(results) + len(errors) < world_size:
            try:
                rank, ok, payload = queue.get(timeout=timeout)
            except queue_mod.Empty:
                raise RuntimeError(
                    f"distributed run timed out after {timeout}s "
                    f"(ranks done: {sorted(results)}, failed: {[r for r, _ in errors]})"
                )
            if ok:
                import torch

                results[rank] = torch.load(io.BytesIO(payload), weights_only=False)
            else:
                errors.append((rank, payload))
                break  # one rank failed: the others may hang on a collective
    finally:
        for p in procs:
            p.join(timeout=1 if errors else 10)
            if p.is_alive():
                p.kill()
    if errors:
        rank, tb = errors[0]
        raise RuntimeError(f"rank {rank} failed:\n{tb}")
    return [results[r] for r in range(world_size)]


def run_torchrun(argv, nproc, timeout=300, env=None, module="megatron_oases"):
    """Launch ``python -m torch.distributed.run --nproc_per_node N -m <module> argv``."""
    full_env = dict(os.environ, OMP_NUM_THREADS="1", **(env or {}))
    return subprocess.run(
        torchrun_command(argv, nproc, module),
        capture_output=True,
        text=True,
        timeout=timeout,
        env=full_env,
    )
