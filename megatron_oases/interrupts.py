"""Ctrl-C and SIGTERM in a command: one line, exit status 130 (SIGINT) or 143 (SIGTERM), no
traceback (:func:`exit_status`).

SIGTERM is raised as :class:`Terminated`, a ``KeyboardInterrupt``, while :func:`handled` runs, so
that every cleanup written for Ctrl-C runs for it too (``oases compare`` stops a variant's ranks
and writes the report of the variants that finished). A torchrun rank keeps SIGTERM's default:
torchrun stops its ranks with it and waits for them, and Megatron's ``--exit-signal-handler``
installs its own handler for the training loop.
"""

import contextlib
import os
import signal
import sys
import threading

#: Exit statuses of a command ended by SIGINT (Ctrl-C) and by SIGTERM: 128 + the signal's number,
#: what a shell reports for a process the signal killed.
SIGINT_STATUS = 128 + signal.SIGINT
SIGTERM_STATUS = 128 + signal.SIGTERM


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised in the main thread while :func:`handled` runs."""


def _raise_terminated(signum, frame):
    raise Terminated()


def in_torchrun_rank():
    """This process is a rank torchrun started (torchelastic sets ``TORCHELASTIC_RUN_ID``)."""
    return "TORCHELASTIC_RUN_ID" in os.environ


@contextlib.contextmanager
def handled():
    """While the block runs, SIGTERM raises :class:`Terminated` (the previous handler is put back
    after it). Not in a torchrun rank (see the module's docstring), and not off the main thread,
    where Python sets no handler."""
    install = not in_torchrun_rank() and threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGTERM, _raise_terminated) if install else None
    try:
        yield
    finally:
        if install:
            signal.signal(signal.SIGTERM, signal.SIG_DFL if previous is None else previous)


def describe(exc):
    """How ``exc`` (a ``KeyboardInterrupt``) came: ``SIGTERM`` or ``Ctrl-C (SIGINT)``."""
    return "SIGTERM" if isinstance(exc, Terminated) else "Ctrl-C (SIGINT)"


def exit_status(exc, prog):
    """A command ended by ``exc`` (a ``KeyboardInterrupt``): one line on stderr, ``prog:
    interrupted by ...`` with what the command left (the exception's notes), printed by rank 0
    only (every rank of a job is stopped alike); returns 143 for :class:`Terminated`, else 130."""
    if os.environ.get("RANK", "0") == "0":
        notes = "; ".join(getattr(exc, "__notes__", ()))
        line = f"{prog}: interrupted by {describe(exc)}" + (f": {notes}" if notes else "")
        try:
            print(line, file=sys.stderr, flush=True)
        except (OSError, ValueError):  # stderr closed with the terminal: the status still says it
            pass
    return SIGTERM_STATUS if isinstance(exc, Terminated) else SIGINT_STATUS
