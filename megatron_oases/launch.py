"""Starting ranks: the one place that builds ``torchrun`` command lines (``oases compare``,
benchmarks, tests) and that spawns gloo ranks in-process (``oases profile``, memory measurement,
tests).

One-rank runs (``--one-rank``): only global rank 0 of a job of N ranks runs, in one process, on
PyTorch's fake process group (Megatron's own ``--fake-process-group``): every collective returns at
once without reducing anything, so the run is for timing only (with the link emulator giving each
collective its modelled time). :func:`one_rank_command` and ``run_distributed(one_rank=True)``.

:func:`run_distributed` is modelled on nanotron's test helpers: fresh processes, a free port, a
hard timeout so a hang fails fast, and each rank's return value (or traceback) sent back through a
queue. Its ranks are forked from a fork server that imported torch and Megatron-Core once (a
clean process of its own that never touches a GPU), so a rank skips most of the 7-12 s of
imports per rank on a 2-CPU host (most of the test suite's time); each rank gets the caller's
environment of the moment, as a spawned one would.
"""

import io
import multiprocessing as mp
import os
import socket
import subprocess
import sys
import time
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


def one_rank_command(argv, world_size, module="megatron_oases"):
    """``(command, env)`` running only rank 0 of a ``world_size``-rank job: ``python -m <module>
    argv --fake-process-group`` with the torchrun variables Megatron reads for a fake job."""
    env = {
        "RANK": "0",
        "LOCAL_RANK": "0",
        "WORLD_SIZE": str(world_size),
        "LOCAL_WORLD_SIZE": "1",  # one process on this host (the emulator's CPU share)
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(find_free_port()),
    }
    return [sys.executable, "-m", module, *argv, "--fake-process-group"], env


def init_fake_process_group(world_size):
    """Rank 0 of ``world_size`` on PyTorch's fake backend (collectives return at once)."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", rank=0, world_size=world_size, store=FakeStore())


#: What the fork server imports once for every rank it starts: torch and Megatron-Core, after
#: the entry point's warning filters (``training.quiet_fork_server``, named here, not imported).
#: Not ``megatron.training``: ranks forked after importing it failed to compile Megatron's fused
#: cross-entropy (an inductor assertion, ``any_leaf != all_leaf``; spawned ranks compile it), so
#: each rank imports the training loop itself (seconds, against the ~8 s saved).
FORKSERVER_PRELOAD = [
    "megatron_oases.training.quiet_fork_server",
    "torch",
    "torch.distributed",
    "megatron.core",
]


def _start_context():
    """The fork server where the platform has one (Linux, macOS), else spawn."""
    if "forkserver" not in mp.get_all_start_methods():
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(FORKSERVER_PRELOAD)
    return ctx


def _take_environment(environ):
    """A forked rank starts with the fork server's environment: take the caller's instead,
    including what the interpreter and torch read only at their start: ``PYTHONWARNINGS`` and
    ``TORCH_COMPILE_DISABLE`` (torch's switch for ``torch.compile``, which Megatron's fused
    functions use; read when the fork server imported torch)."""
    os.environ.clear()
    os.environ.update(environ)
    action = environ.get("PYTHONWARNINGS")
    if action in ("ignore", "default", "error", "always", "module", "once"):
        import warnings

        warnings.simplefilter(action)
    import torch._dynamo

    torch._dynamo.config.disable = environ.get("TORCH_COMPILE_DISABLE", "0") == "1"  # torch's rule


def _worker(rank, world_size, port, fn, args, queue, one_rank=False, environ=None):
    if environ is not None:
        _take_environment(environ)
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world_size),
        OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"),
    )
    import faulthandler

    faulthandler.enable()  # a rank that crashes hard (signal) still says where
    try:
        import torch
        import torch.distributed as dist

        torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
        if one_rank:
            os.environ["LOCAL_WORLD_SIZE"] = "1"
            init_fake_process_group(world_size)
        else:
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


def output_to(log_path):
    """In a spawned rank: send this process's stdout and stderr (Megatron's output) to
    ``log_path``; returns a line-buffered file on the original stdout for the rank's progress."""
    console = os.fdopen(os.dup(1), "w", buffering=1)
    sys.stdout.flush()
    sys.stderr.flush()
    fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    return console


def run_distributed(fn, world_size, *args, timeout=300, one_rank=False):
    """Run ``fn(*args)`` on ``world_size`` gloo ranks; return the list of per-rank results.
    ``one_rank``: only rank 0 runs, on the fake process group (a list of one result).

    Raises ``RuntimeError`` with the failing rank's traceback, or on timeout (all ranks killed).
    """
    ctx = _start_context()
    queue = ctx.Queue()
    port = find_free_port()
    ranks = 1 if one_rank else world_size
    environ = dict(os.environ)
    procs = [
        ctx.Process(target=_worker, args=(r, world_size, port, fn, args, queue, one_rank, environ))
        for r in range(ranks)
    ]
    for p in procs:
        p.start()
    results, errors = {}, []
    interrupted = False
    import queue as queue_mod

    try:
        deadline = time.monotonic() + timeout
        while len(results) + len(errors) < ranks:
            try:
                rank, ok, payload = queue.get(timeout=min(5.0, max(0.1, timeout)))
            except queue_mod.Empty:
                dead = [r for r, p in enumerate(procs) if p.exitcode not in (None, 0)]
                dead = [r for r in dead if r not in results]
                if dead:  # killed by a signal (segfault, OOM killer): it reported nothing
                    errors.append(
                        (dead[0], f"the process died with exit code {procs[dead[0]].exitcode}")
                    )
                    break
                if time.monotonic() < deadline:
                    continue
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
    except KeyboardInterrupt:  # Ctrl-C or SIGTERM: the ranks are killed at once, not awaited
        interrupted = True
        raise
    finally:
        signalled = []  # ranks a signal ended before we killed anything (segfault, OOM killer)
        for r, p in enumerate(procs):
            p.join(timeout=0 if interrupted else 1 if errors else 10)
            if p.is_alive():
                p.kill()
                if interrupted:
                    p.join(timeout=5)
            elif (p.exitcode or 0) < 0:
                signalled.append(r)
    if errors:
        rank, tb = errors[0]
        # a rank killed by a signal reports nothing, and its peers then fail on the lost
        # connection, sometimes first: name the root cause, then what the peer saw
        others = [r for r in signalled if r != rank and r not in results]
        if others and "died with exit code" not in tb:
            r = others[0]
            raise RuntimeError(
                f"rank {r} failed:\nthe process died with exit code {procs[r].exitcode} "
                f"(then rank {rank} failed:\n{tb})"
            )
        raise RuntimeError(f"rank {rank} failed:\n{tb}")
    return [results[r] for r in range(ranks)]


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


def die_with_launcher():
    """Under ``torchrun`` (``TORCHELASTIC_RUN_ID`` set, Linux): ask the kernel to SIGKILL this
    rank when its launcher dies. A launcher killed with SIGKILL cannot stop its ranks, which
    would otherwise train on as orphans (and hold ``--save``'s lock). Returns True if set."""
    if "TORCHELASTIC_RUN_ID" not in os.environ or not sys.platform.startswith("linux"):
        return False
    import ctypes
    import signal

    try:
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(1, int(signal.SIGKILL), 0, 0, 0) != 0:  # PR_SET_PDEATHSIG
            return False
    except (OSError, AttributeError):
        return False
    if os.getppid() == 1:  # the launcher died before the request: nothing will signal us
        os.kill(os.getpid(), signal.SIGKILL)
    return True
