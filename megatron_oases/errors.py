"""One exception type for bad user input: the CLI prints its message as one line and exits 2."""


class OasesConfigError(ValueError):
    """A configuration the user can fix; the message names the fix."""


#: Ranks other than 0 wait this long before exiting on an error, so that the launcher does not
#: stop rank 0 before it has printed the job's one error line.
ERROR_EXIT_GRACE_S = 5.0


def report_once(message, rank=None):
    """Print ``message`` on rank 0 only (every rank reaches the same verdict on the same command
    line); other ranks wait :data:`ERROR_EXIT_GRACE_S` before the caller exits."""
    import os
    import sys
    import time

    rank = int(os.environ.get("RANK", "0")) if rank is None else rank
    if rank == 0:
        print(message, file=sys.stderr, flush=True)
    else:
        time.sleep(ERROR_EXIT_GRACE_S)
