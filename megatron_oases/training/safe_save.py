"""Saves that never destroy the previous good checkpoint.

Megatron's ``torch_dist`` save writes ``SAVE/iter_NNNNNNN/`` and then the tracker file
``SAVE/latest_checkpointed_iteration.txt``, which is what ``--load`` reads. Two gaps remain, both
closed here by a reversible patch (installed for a run with ``--save``):

* Re-saving an iteration whose directory already exists (a resumed run that ends on the iteration
  it loaded, or a new run into an old ``--save`` directory) overwrites that directory in place: a
  crash half-way leaves the tracker pointing at a torn checkpoint, and files of an older layout
  stay next to the new ones. Here such a save goes to ``iter_NNNNNNN.saving`` and replaces the old
  directory only once complete (two renames; a crash between them leaves
  ``iter_NNNNNNN.replaced``, which :func:`recover` puts back before a ``--load``).
* The tracker is written with ``open(path, "w")``: a crash between truncation and write leaves it
  empty. Here it is written to a temporary file and renamed over the old one (atomic on POSIX).

And one for ``--exit-signal-handler``: Megatron's checkpoint writer reports through a queue served
by a ``multiprocessing`` manager process it starts at the first save. A SIGTERM sent to every
process of the job (SLURM at the time limit, ``scancel``, a kill of the process group) stops that
manager too, so the save the handler then makes failed on a broken pipe (and was blamed on free
space or permissions). Here a save whose queue's manager is gone gets a new one
(:func:`fresh_results_queue`); a save that the signal cuts short half-way says so
(:func:`_failure_is_one_line`).
"""

import contextlib
import os
import shutil

from ..errors import OasesConfigError, StoppedByAnotherRank, TrainingStopped
from ..patches import Patch, install_patch

TRACKER = "latest_checkpointed_iteration.txt"
STAGING = ".saving"
REPLACED = ".replaced"
PATCH_NAME = "safe-checkpoint-save"


class TrainingStoppedOnIO(TrainingStopped):
    """A save failed on I/O; the run stops with this one line (see :func:`_failure_is_one_line`)."""


def _rank():
    import torch.distributed as dist

    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def _barrier():
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.barrier()


def _broadcast(value):
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return value
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def _non_empty_dir(path):
    try:
        with os.scandir(path) as it:
            return next(it, None) is not None
    except (FileNotFoundError, NotADirectoryError):
        return False


def _swap_in(target, staging):
    """Rank 0: the complete ``staging`` directory takes ``target``'s place."""
    if _rank() == 0:
        old = target + REPLACED
        shutil.rmtree(old, ignore_errors=True)
        os.rename(target, old)
        os.rename(staging, target)
        shutil.rmtree(old, ignore_errors=True)
    _barrier()


def _causes(exc):
    """``exc`` and what it carries: causes, contexts, and torch's ``CheckpointException``'s
    per-rank failures."""
    seen, todo = [], [exc]
    while todo:
        e = todo.pop(0)
        if e is None or any(e is s for s in seen):
            continue
        seen.append(e)
        failures = getattr(e, "failures", None) or {}
        todo += [f[0] for f in failures.values()] + [e.__cause__, e.__context__]
    return seen


#: torch's zip writer (``torch.save``, used for each item of a torch_dist shard and for the
#: ``torch`` format's files) on a short write: no errno, as on a full disk. Its texts, e.g.
#: ``[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598`` or
#: ``PytorchStreamWriter failed writing file data/0: file write failed``.
ZIP_WRITE_FAILED = (
    "inline_container.cc",
    "unexpected pos",
    "PytorchStreamWriter failed",
    "file write failed",
)


def _zip_write_failure(text):
    """The zip writer's failure line in ``text`` (said to be a short write), or None."""
    for line in str(text).splitlines():
        if any(s in line for s in ZIP_WRITE_FAILED):
            line = line.strip()
            if "encountered an error: " in line:  # Megatron's writer log: "Local worker 0 ..."
                line = line.split("encountered an error: ", 1)[1]
            line = line.removeprefix("RuntimeError: ")
            return f"RuntimeError: {line} (torch's zip writer: a short write, as on a full disk)"
    return None


def _io_failure(exc, logged=()):
    """One line for a save that failed on I/O (disk full, permissions, a writer that died on
    an ``OSError`` or torch's zip writer on a short write), or None when the failure is
    something else (a bug: raised as it is). ``logged``: the writer's held-back log records
    (Megatron's writer raises only the class of a worker's error and logs its text)."""
    causes = _causes(exc)
    for e in causes:
        if isinstance(e, OSError):
            return f"{type(e).__name__}: {e}"
    for text in [str(e) for e in causes] + [r.getMessage() for r in logged]:
        zip_failure = _zip_write_failure(text)
        if zip_failure:
            return zip_failure
    for e in causes:  # Megatron's writer reports only the class: "error: <class 'OSError'>"
        if type(e).__name__ == "CheckpointException":  # its text holds every rank's: look inside
            continue
        if "OSError" in str(e) or "Errno" in str(e):
            return f"{type(e).__name__}: {str(e).strip().splitlines()[0]}"
    for e in causes:  # another rank's writer failed: its text stayed in that rank's log
        if "Worker failure" in str(e) and type(e).__name__ != "CheckpointException":
            return (
                f"{type(e).__name__}: {str(e).strip().splitlines()[0]} (a checkpoint writer "
                "failed, as on a full disk)"
            )
    return None


#: Megatron's checkpoint writer logs each failed write (an ERROR line per worker and rank) before
#: raising: held back during a save, and let through unless the failure became our one line.
WRITER_LOGGER = "megatron.core.dist_checkpointing.strategies.filesystem_async"


class _HeldBack:
    """A logging filter keeping the writer's records until the save's outcome is known."""

    def __init__(self):
        self.records = []

    def filter(self, record):
        self.records.append(record)
        return False


@contextlib.contextmanager
def _writer_errors_held_back():
    import logging

    logger, held = logging.getLogger(WRITER_LOGGER), _HeldBack()
    logger.addFilter(held)
    try:
        yield held.records
    except (TrainingStoppedOnIO, StoppedByAnotherRank):
        raise  # the one line says it: the writer's own ERROR lines would only repeat it
    except BaseException:
        _release(logger, held)
        raise
    else:
        _release(logger, held)
    finally:
        logger.removeFilter(held)


def _release(logger, held):
    logger.removeFilter(held)
    for record in held.records:
        logger.handle(record)
    held.records.clear()


#: What a writer's helper process that a signal stopped leaves behind: a broken connection (the
#: exception, or its class's name where Megatron's writer passes on only that).
_BROKEN_CONNECTION = (BrokenPipeError, ConnectionError, EOFError)
_BROKEN_NAMES = ("BrokenPipeError", "ConnectionResetError", "ConnectionRefusedError", "EOFError")


def _exit_signal():
    """The signal ``--exit-signal-handler`` waits for, when this rank has received it (Megatron's
    handler), else None."""
    try:
        from megatron.training import global_vars
    except ImportError:
        return None
    handler = getattr(global_vars, "_GLOBAL_SIGNAL_HANDLER", None)
    if handler is None or not getattr(handler, "_signal_received", False):
        return None
    import signal

    try:
        return signal.Signals(handler.sig).name
    except (AttributeError, ValueError):
        return str(getattr(handler, "sig", "the exit signal"))


def _broken_connection(exc, logged=()):
    """The name of the broken connection in ``exc`` (or the writer's log records), or None."""
    for e in _causes(exc):
        if isinstance(e, _BROKEN_CONNECTION):
            return type(e).__name__
    for text in [str(e) for e in _causes(exc)] + [r.getMessage() for r in logged]:
        found = next((n for n in _BROKEN_NAMES if n in text), None)
        if found:
            return found
    return None


def _cut_short_by_signal(exc, target, previous, logged=()):
    """The one line for a save that a signal (``--exit-signal-handler``'s) cut short, or None."""
    name = _exit_signal()
    if name is None:
        return None
    broken = _broken_connection(exc, logged)
    if broken is None:
        return None
    save_dir = os.path.dirname(target)
    return (
        f"saving {os.path.basename(target)} to {save_dir} was cut short by {name} "
        f"(--exit-signal-handler): the signal also stopped the checkpoint writer's helper process "
        f"({broken}); {previous}: resume with --load {save_dir}"
    )


@contextlib.contextmanager
def _failure_is_one_line(target, written, logged=()):
    """A save that fails on I/O (disk full, permissions, a rank's writer failing on an
    ``OSError``: ``logged``, the writer's held-back log records, may hold its text) stops the run
    with one line (``TrainingStopped``, exit status 1) naming the previous checkpoint, intact:
    the tracker still names it. The partial directory ``written`` is removed (rank 0) when every
    rank has stopped writing."""
    try:
        yield
    except BaseException as exc:  # torch's CheckpointException is a BaseException
        if not isinstance(exc, Exception) and type(exc).__name__ != "CheckpointException":
            raise
        save_dir = os.path.dirname(target)
        try:
            previous = f"the previous checkpoint (iteration {read_tracker(save_dir)}) is intact"
        except OasesConfigError:
            previous = "no earlier checkpoint exists there"
        signalled = _cut_short_by_signal(exc, target, previous, logged)
        if signalled is not None:  # each rank that saw it (a rank that did not may be waiting)
            raise TrainingStoppedOnIO(signalled) from None
        cause = _io_failure(exc, logged)
        if type(exc).__name__ == "CheckpointException" and not getattr(exc, "failures", None):
            # torch tells the coordinator (rank 0) which writes failed, the others only that
            # one did: rank 0 prints the line
            raise StoppedByAnotherRank(f"saving {os.path.basename(target)} failed") from None
        if cause is None:
            raise
        errno = [r.getMessage() for r in logged if "[Errno" in r.getMessage()]
        if errno and "[Errno" not in cause:  # the writer logged the OSError's text, not raised it
            cause = "OSError: [Errno" + errno[0].split("[Errno", 1)[1]

        if _rank() == 0 and type(exc).__name__ == "CheckpointException":
            # torch reports a write failure to every rank at once, so nobody writes any more;
            # after a failure of this rank alone, others may still be writing: leave it
            shutil.rmtree(written, ignore_errors=True)
        try:
            free = f", {shutil.disk_usage(save_dir).free / 1e9:.1f} GB free there"
        except OSError:
            free = ""
        raise TrainingStoppedOnIO(
            f"saving {os.path.basename(target)} to {save_dir} failed ({cause}"
            f"{free}); {previous}: fix the cause (free space, permissions), then resume with "
            f"--load {save_dir}"
        ) from None


def guarded_save(real_save):
    """``dist_checkpointing.save`` that writes into a fresh directory when ``checkpoint_dir`` holds
    files already, and swaps it in when complete."""

    def save(sharded_state_dict, checkpoint_dir, *args, **kwargs):
        target = str(checkpoint_dir).rstrip("/")
        if not _broadcast(_non_empty_dir(target) if _rank() == 0 else None):
            with _writer_errors_held_back() as logged, _failure_is_one_line(target, target, logged):
                return real_save(sharded_state_dict, checkpoint_dir, *args, **kwargs)
        staging = target + STAGING
        if _rank() == 0:
            shutil.rmtree(staging, ignore_errors=True)  # a crashed save's leftovers
            os.makedirs(staging)
        _barrier()
        with _writer_errors_held_back() as logged, _failure_is_one_line(target, staging, logged):
            request = real_save(sharded_state_dict, staging, *args, **kwargs)
        if request is None:  # synchronous: every rank has written (the save ends on a barrier)
            _swap_in(target, staging)
        else:  # asynchronous: after Megatron's own finalisation of this save
            request.finalize_fns.append(lambda: _swap_in(target, staging))
        return request

    save.__wrapped__ = real_save
    return save


def _serving(queue):
    """Whether the manager process behind the ``multiprocessing`` queue proxy ``queue`` answers."""
    try:
        queue.qsize()
    except (OSError, EOFError):
        return False
    return True


def fresh_results_queue(real, module):
    """Megatron's ``get_write_results_queue`` (``module``: its ``filesystem_async``), with a new
    queue when the manager process serving the one it keeps is gone (stopped by a signal to the
    job's processes)."""

    def get_write_results_queue(*args, **kwargs):
        queue = getattr(module, "_results_queue", None)
        if queue is not None and not _serving(queue):
            module._results_queue = None  # the dead manager's proxy: Megatron makes a new one
        return real(*args, **kwargs)

    get_write_results_queue.__wrapped__ = real
    return get_write_results_queue


class _AtomicFile:
    """A text file written to ``path + '.tmp-PID'`` and renamed over ``path`` on close."""

    def __init__(self, path, mode):
        self.path = path
        self.tmp = f"{path}.tmp-{os.getpid()}"
        self.file = open(self.tmp, mode)

    def write(self, data):
        return self.file.write(data)

    def close(self):
        if self.file.closed:
            return
        self.file.flush()
        os.fsync(self.file.fileno())
        self.file.close()
        os.replace(self.tmp, self.path)

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb):
        if exc_type is None:
            self.close()
        else:
            self.file.close()
            os.unlink(self.tmp)
        return False


class _AtomicTracker:
    """Megatron's ``maybe_msc`` with the tracker file written atomically (local paths only)."""

    def __init__(self, real):
        self._real = real

    def __getattr__(self, name):
        attr = getattr(self._real, name)
        if name != "open":
            return attr

        def open_(path, mode="r", *args, **kwargs):
            if mode == "w" and not args and not kwargs and os.path.basename(str(path)) == TRACKER:
                if os.path.isdir(os.path.dirname(str(path)) or "."):
                    return _AtomicFile(str(path), mode)
            return attr(path, mode, *args, **kwargs)

        return open_


def make_patch():
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.strategies import filesystem_async
    from megatron.training import checkpointing

    from ..compat import require_symbol

    require_symbol(dist_checkpointing, "save", called_by=(checkpointing.save_checkpoint,))
    require_symbol(checkpointing, "maybe_msc", called_by=(checkpointing.save_checkpoint,))
    queue = require_symbol(
        filesystem_async,
        "get_write_results_queue",
        called_by=(filesystem_async.FileSystemWriterAsync.prepare_write_data,),
    )
    if not hasattr(filesystem_async, "_results_queue"):
        require_symbol(filesystem_async, "_results_queue")  # the one line: an unsupported version
    return Patch(
        PATCH_NAME,
        [
            (dist_checkpointing, "save", guarded_save(dist_checkpointing.save)),
            (checkpointing, "maybe_msc", _AtomicTracker(checkpointing.maybe_msc)),
            (
                filesystem_async,
                "get_write_results_queue",
                fresh_results_queue(queue, filesystem_async),
            ),
        ],
    )


def install(args):
    """Install for a run that saves (idempotent; ``patches.uninstall_all()`` reverts it)."""
    if getattr(args, "save", None):
        install_patch(make_patch())


def read_tracker(directory, fix=None):
    """The text of ``directory``'s tracker, stripped, read through the one bounded reader
    (:func:`megatron_oases.formats.read_text`, at most ``MAX_CONTROL_BYTES``): a tracker that is
    missing, not a regular file (a symlink to ``/dev/zero`` was read until ``MemoryError``, a
    FIFO hung the job), oversized or binary is one :class:`OasesConfigError` line naming it and
    ``fix``."""
    from ..formats import MAX_CONTROL_BYTES, read_text

    path = os.path.join(directory, TRACKER)
    return read_text(path, "tracker", fix, limit=MAX_CONTROL_BYTES).strip()


def recover(load_dir):
    """Undo a save that crashed between its two renames: the tracker's ``iter_N`` is missing but
    ``iter_N.replaced`` (the previous complete checkpoint) is there. Returns True if it acted.
    A tracker it cannot read is left to :func:`.checkpoint_check.check_tracker`'s line."""
    try:
        iteration = int(read_tracker(load_dir))
    except (OasesConfigError, ValueError):
        return False
    target = os.path.join(load_dir, f"iter_{iteration:07d}")
    if os.path.isdir(target) or not os.path.isdir(target + REPLACED):
        return False
    try:
        os.rename(target + REPLACED, target)
    except FileNotFoundError:  # another rank did it first
        pass
    return True
