"""The user-facing errors: bad input (:class:`OasesConfigError`, exit 2) and a run that stopped
on a check (:class:`TrainingStopped`, exit 1), each printed as one line once per job."""

import os

#: The longest error line printed (:func:`cut_line`): a line quoting a whole input value reached
#: 106 kB. Values are quoted at most ``formats.MAX_QUOTED`` characters where they are quoted;
#: this is the bound on the whole line, whatever it quotes.
MAX_LINE_CHARS = 2000


def cut_line(text, limit=MAX_LINE_CHARS):
    """``text`` on one line of at most about ``limit`` characters: a longer one keeps its start
    (what is wrong) and its end (the fix) and says how much was cut between them."""
    text = " ".join(str(text).splitlines()) if "\n" in str(text) else str(text)
    if len(text) <= limit:
        return text
    head, tail = limit * 2 // 3, limit // 3
    return f"{text[:head]} [... {len(text) - head - tail} characters cut ...] {text[-tail:]}"


class OasesConfigError(ValueError):
    """A configuration the user can fix; the message names the fix. Its text is one line of at
    most :data:`MAX_LINE_CHARS` (:func:`cut_line`), however long the values it quotes."""

    def __init__(self, *args):
        if len(args) == 1 and isinstance(args[0], str):
            args = (cut_line(args[0]),)
        super().__init__(*args)


class TrainingStopped(Exception):
    """Megatron stopped the run on a check (NaN/Inf loss); printed as one line, exit status 1."""


class StoppedByAnotherRank(TrainingStopped):
    """This rank stops because of another rank's failure, which that rank reports: exit status
    1 without a line of its own (e.g. a checkpoint write that failed on another rank)."""


#: Ranks other than 0 wait this long before exiting on an error, so that the launcher does not
#: stop rank 0 before it has printed the job's one error line.
ERROR_EXIT_GRACE_S = 5.0


def report_once(message, rank=None):
    """Print ``message`` on rank 0 only (every rank reaches the same verdict on the same command
    line); other ranks wait :data:`ERROR_EXIT_GRACE_S` before the caller exits."""
    import sys
    import time

    rank = int(os.environ.get("RANK", "0")) if rank is None else rank
    if rank == 0:
        print(message, file=sys.stderr, flush=True)
    else:
        time.sleep(ERROR_EXIT_GRACE_S)


#: Texts of the errors a rank gets when another rank of its job died or stopped responding
#: (gloo and NCCL): the cause is that rank's, reported by it or by the launcher.
PEER_LOST = (
    "Connection closed by peer",
    "Connection reset by peer",
    "Broken pipe",
    "Timed out waiting",
    "timed out",
    "NCCL communicator was aborted",
)


def _first_of_its_group():
    """Whether this rank is the first rank of its model replica's last-stage group: tensor,
    context and data-parallel rank 0 (True when Megatron's parallel state is not set up)."""
    try:
        from megatron.core import parallel_state as mpu

        if not mpu.model_parallel_is_initialized():
            return int(os.environ.get("RANK", "0")) == 0
        return (
            mpu.get_tensor_model_parallel_rank() == 0
            and mpu.get_context_parallel_rank() == 0
            and mpu.get_data_parallel_rank() == 0
        )
    except Exception:  # noqa: BLE001 - reporting must not fail
        return int(os.environ.get("RANK", "0")) == 0


def report_stop(message):
    """A run stopped by a check that only some ranks make (a NaN loss is seen on the last
    pipeline stage, not on rank 0): the first rank of the stopping group prints at once; any
    other rank that stopped prints after :data:`ERROR_EXIT_GRACE_S` — by then the launcher has
    ended the job if the first one printed, so the line appears once."""
    import sys
    import time

    if not _first_of_its_group():
        time.sleep(ERROR_EXIT_GRACE_S)
    print(message, file=sys.stderr, flush=True)


def last_line(exc):
    """The last non-empty line of an exception's text (a spawned rank's traceback ends with the
    error itself): what a one-line report of a failed step says."""
    lines = [ln for ln in str(exc).strip().splitlines() if ln.strip()]
    return lines[-1] if lines else repr(exc)


def is_peer_lost(exc):
    """``exc`` is a collective's failure because another rank died or stopped responding."""
    return isinstance(exc, RuntimeError) and any(s in str(exc) for s in PEER_LOST)


def exit_status(exc, prog, stopped=()):
    """The exit status of an entry point that ends on ``exc``, its one line printed once per
    job; ``exc`` itself is raised again when it is none of ours:

    * :class:`OasesConfigError`: 2, printed on rank 0 (every rank reaches the same verdict).
    * ``stopped`` (a run stopped on a check, e.g. NaN loss): 1, :func:`report_stop`.
    * another rank died or hung (:func:`is_peer_lost`): 1, after :data:`ERROR_EXIT_GRACE_S` on
      rank 0 only — normally the launcher has ended the job by then, and the line that counts is
      the other rank's own error or the launcher's report of its exit. When the lost rank ran on
      another host, this host's launcher has not: the other ranks here wait one grace more, so
      that rank 0 prints before their exit makes the launcher stop it.
    """
    if isinstance(exc, OasesConfigError):
        report_once(f"{prog}: error: {exc}")
        return 2
    if isinstance(exc, StoppedByAnotherRank):
        import time

        time.sleep(ERROR_EXIT_GRACE_S)  # the failing rank prints; the launcher ends the job
        return 1
    if stopped and isinstance(exc, stopped):
        report_stop(f"{prog}: error: {exc}")
        return 1
    if is_peer_lost(exc):
        import sys
        import time

        time.sleep(ERROR_EXIT_GRACE_S)
        if int(os.environ.get("RANK", "0")) == 0:
            print(
                f"{prog}: error: lost contact with another rank of this job, which stopped or "
                f"died (its own error, or the launcher's report of its exit, says why): "
                f"{str(exc).strip().splitlines()[0][:200]}",
                file=sys.stderr,
                flush=True,
            )
        else:
            time.sleep(ERROR_EXIT_GRACE_S)
        return 1
    raise exc
