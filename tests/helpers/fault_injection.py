"""Test-only: the ``oases`` command with a fault injected, chosen by ``OASES_FAULT``.

Never imported by the package: tests launch this file as the torchrun program
(``torchrun ... tests/helpers/fault_injection.py train ...``); it installs the fault, then runs
``megatron_oases.cli.main`` on the rest of the command line.

``OASES_FAULT=KIND:rank=R:iter=N``

* ``kill``: SIGKILL rank R inside iteration N, at its first forward (the other ranks are in the
  middle of the iteration, waiting in a collective).
* ``stop``: SIGSTOP rank R there instead (a hung rank: the others time out).
* ``linkdown``: rank R takes its host's network interface (``GLOO_SOCKET_IFNAME``) down there: the
  host drops off the network (two-host tests, ``tests/helpers/netns.py``; needs root).
* ``term``: rank R sends SIGTERM to every process of the job (its process group: the launcher,
  every rank and their helper processes) there, as SLURM does at the time limit or on ``scancel``.
* ``kill-save``: SIGKILL rank R while it writes its shard of the checkpoint of iteration N, after
  writing part of the shard file.
* ``enospc``: that write fails as on a full disk (``OSError(ENOSPC)``), part of the file written.
"""

import errno
import functools
import os
import signal
import sys


def parse(spec):
    kind, *fields = spec.split(":")
    opts = dict(f.split("=", 1) for f in fields)
    return kind, int(opts["rank"]), int(opts["iter"])


def _die(kind):
    if kind == "linkdown":
        import subprocess

        subprocess.run(["ip", "link", "set", os.environ["GLOO_SOCKET_IFNAME"], "down"], check=True)
    elif kind == "stop":
        os.kill(os.getpid(), signal.SIGSTOP)
    elif kind == "term":
        os.killpg(os.getpgid(0), signal.SIGTERM)
    else:
        os.kill(os.getpid(), signal.SIGKILL)


def install_iteration_fault(kind, iteration):
    """Fail at the first forward of ``iteration`` (Megatron's ``train_step``, by module name)."""
    from megatron.training import get_args, training

    real = training.train_step

    def train_step(forward_step_func, *args, **kwargs):
        if get_args().curr_iteration + 1 == iteration:

            def failing_forward(*a, **k):
                sys.stdout.flush()
                print(
                    f"fault_injection: {kind} at iteration {iteration}", file=sys.stderr, flush=True
                )
                _die(kind)
                return forward_step_func(*a, **k)

            return real(failing_forward, *args, **kwargs)
        return real(forward_step_func, *args, **kwargs)

    training.train_step = train_step


def install_save_fault(kind, iteration):
    """Fail while writing a shard file of ``iter_{iteration:07d}`` (Megatron's torch_dist writer
    writes each shard with ``_write_item``, item after item)."""
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    real = filesystem_async._write_item
    tag = f"iter_{iteration:07d}"

    @functools.wraps(real)  # Megatron inspects its signature
    def write_item(*args, **kwargs):
        stream = next((a for a in args if hasattr(a, "write") and hasattr(a, "name")), None)
        result = real(*args, **kwargs)
        if stream is not None and tag in os.path.dirname(str(stream.name)):
            stream.flush()  # part of the shard is on disk
            if kind == "enospc":
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(stream.name))
            _die("kill")
        return result

    filesystem_async._write_item = write_item


def main():
    from megatron_oases.training import quiet

    quiet.install()  # as the CLI does, before Megatron is imported here
    spec = os.environ.get("OASES_FAULT")
    if spec:
        kind, rank, iteration = parse(spec)
        if int(os.environ.get("RANK", "0")) == rank:
            if kind in ("kill", "stop", "linkdown", "term"):
                install_iteration_fault(kind, iteration)
            elif kind in ("kill-save", "enospc"):
                install_save_fault(kind, iteration)
            else:
                raise SystemExit(f"unknown OASES_FAULT kind {kind!r}")
    from megatron_oases.cli import main as oases

    return oases(sys.argv[1:])


if __name__ == "__main__":
    sys.exit(main())
