"""The one place that builds ``torchrun`` command lines (tests, ``oases compare``, benchmarks)."""

import socket
import sys


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
