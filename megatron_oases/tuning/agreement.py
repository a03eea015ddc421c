"""The world's agreement after each trial step of ``--oases-schedule auto``.

Every rank and pipeline stage must feed the trial the same values, so that all switch together
and reach the same choice. After each trial step one small all-reduce (MAX), on a gloo group of its
own, gives every rank the slowest rank's time, whether some rank failed, whether every rank did,
and a check that all ran the same candidate (:func:`encode`, :func:`decode`); where ranks failed,
one ``all_gather_object`` gives each failed rank's line. A step that failed on some ranks and
completed on others stops the run (the ranks' states differ). Without a group (one rank, no process
group, the fake backend) a rank agrees with itself.

A rank whose candidate failed alone cannot be waited out: the others are inside that step's
collectives, which neither gloo nor NCCL can cancel. It waits :func:`patience` seconds for them,
then stops the run with one line (:class:`~megatron_oases.errors.TrainingStopped`).
"""

import datetime

from ..errors import TrainingStopped
from .candidates import STOCK

#: A rank whose candidate failed waits for the others at least this long, or this many times the
#: slowest agreed step so far (:func:`patience`).
FAILED_WAIT_MIN_S = 60.0
FAILED_WAIT_STEPS = 5


def patience(slowest_step_s):
    """Seconds a failed rank waits for the others at the agreement."""
    return max(FAILED_WAIT_MIN_S, FAILED_WAIT_STEPS * (slowest_step_s or 0.0))


def rank():
    """This process's rank in the world (0 without a process group)."""
    import torch.distributed as dist

    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def encode(seconds, failed, index):
    """One rank's values, so that their MAX over the world holds the slowest time, whether any and
    whether every rank failed, and the highest and lowest candidate index."""
    failed = 1.0 if failed else 0.0
    return [float(seconds), failed, -failed, float(index), -float(index)]


def decode(values):
    """``(slowest seconds, any rank failed, every rank failed, all ran the same candidate)`` from
    the MAX of every rank's :func:`encode`."""
    seconds, failed, not_failed, high, neg_low = (float(v) for v in values)
    return seconds, failed > 0, -not_failed > 0, high == -neg_low


class Agreement:
    """The world's agreement: the gloo group (open while a trial or re-timing may still run), the
    agreed values of each step and the failed ranks' lines; ``slowest``: the slowest agreed step
    time so far (it sets :func:`patience`)."""

    def __init__(self):
        self.group = None
        self.slowest = 0.0

    def open(self):
        """A group of its own (not Megatron's), where there is a world to agree with."""
        import torch.distributed as dist

        if self.group is not None or not (dist.is_available() and dist.is_initialized()):
            return
        if dist.get_world_size() == 1 or dist.get_backend() == "fake":
            return
        self.group = dist.new_group(backend="gloo")

    def close(self):
        import torch.distributed as dist

        group, self.group = self.group, None
        if group is not None and dist.is_initialized():
            dist.destroy_process_group(group)

    def agree(self, seconds, why, candidate, index):
        """``(slowest rank's seconds, every rank failed)`` after a step of ``candidate``
        (``index``: its place among the candidates) that took ``seconds`` here, or failed here
        with the line ``why``. Where it failed on some ranks and completed on others, the states
        differ now: the run stops with one line."""
        import torch
        import torch.distributed as dist

        if self.group is None:
            slowest, any_failed, all_failed, same = decode(encode(seconds, why, index))
        else:
            values = torch.tensor(encode(seconds, why, index), dtype=torch.float64)
            work = dist.all_reduce(values, op=dist.ReduceOp.MAX, group=self.group, async_op=True)
            if why is None:
                work.wait()
            else:
                self._wait_failed(work, why, candidate)
            slowest, any_failed, all_failed, same = decode(values.tolist())
        if not same:
            raise RuntimeError(
                "oases: auto: the ranks ran different candidates; pin a schedule with "
                "--oases-schedule and report it"
            )
        if not any_failed:
            self.slowest = max(self.slowest, slowest)
        elif not all_failed:
            raise TrainingStopped(
                f"--oases-schedule auto: {candidate.name} failed on some ranks and completed "
                "on others; resume from the last checkpoint with a pinned schedule (e.g. "
                f"{STOCK.flags()})"
            )
        return slowest, any_failed

    def _wait_failed(self, work, why, candidate):
        try:
            work.wait(timeout=datetime.timedelta(seconds=patience(self.slowest)))
        except RuntimeError:
            self.group = None  # abandoned: destroying it would wait for the pending op
            raise TrainingStopped(
                f"--oases-schedule auto: {candidate.name} failed on rank {rank()} ({why}) "
                "while the other ranks are still inside that step's collectives; pin a "
                f"schedule that runs here, e.g. {STOCK.flags()}"
            ) from None

    def reasons(self, why):
        """``[(rank, why)]`` of the ranks that failed (``why``: this rank's line, or None)."""
        import torch.distributed as dist

        if self.group is None:
            return [(rank(), why)]
        every = [None] * dist.get_world_size(self.group)
        dist.all_gather_object(every, why, group=self.group)
        return [(r, w) for r, w in enumerate(every) if w is not None]
