"""Launch ``oases train`` once per variant (torchrun subprocess) and collect its metrics and trace."""

import os
import re
import signal
import statistics
import subprocess
import threading
import time

from ..errors import OasesConfigError
from ..instrument.golden import read_golden
from ..launch import one_rank_command, torchrun_command
from ..viz.analysis import load_traces, run_metrics, trace_files

_SHARE = re.compile(r"\[oases\] emulator rank (\d+):.*CPU share while not blocked ([\d.]+)")
_ITER = re.compile(r"iteration\s+(\d+)/\s*(\d+).*?elapsed time per iteration \(ms\): ([\d.]+)")


def train_command(variant, train_argv, vdir, nproc, iters, emulate_link=None, one_rank=False):
    """The command line of one variant and the environment it adds: torchrun over ``nproc``
    ranks, or (``one_rank``) one process standing for rank 0 of ``nproc``."""
    argv = [
        "train",
        *train_argv,
        *variant.flags,
        "--train-iters",
        str(iters),
        "--log-interval",
        "1",
        "--log-json",
        os.path.join(vdir, "golden.json"),
        "--oases-trace",
        os.path.join(vdir, "trace.rank{rank}.json"),
    ]
    if emulate_link:
        argv += ["--emulate-link", emulate_link]
    if one_rank:
        return one_rank_command(argv, nproc)
    return torchrun_command(argv, nproc), {}


_ERROR = re.compile(r"^(?:\[rank\d+\]: )?(?:oases train: error: .*|[\w.]*(?:Error|Exception)\b.*)$")


def _first_error(lines):
    """The first exception or ``oases train: error:`` line of a failed run's output."""
    for line in lines:
        m = _ERROR.match(line.strip())
        if m and "ChildFailedError" not in line and "elastic" not in line:
            return line.strip()
    return None


def _stream(proc, log_path, on_line, failed):
    """Copy the ranks' output to ``log_path``. A write that fails (a full ``--out`` disk) stops
    the run at once (nothing else would drain its output: the ranks would block on a full pipe
    until the timeout) and is kept in ``failed``; the output is read to its end either way."""
    log = None
    try:
        log = open(log_path, "w")
    except OSError as exc:
        _stop(proc, failed, exc)
    for line in proc.stdout:
        if log is not None:
            try:
                log.write(line)
                log.flush()
            except OSError as exc:
                _stop(proc, failed, exc)
                log = _close(log)
        on_line(line.rstrip("\n"))
    _close(log)


def _stop(proc, failed, exc):
    failed.append(exc)
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def _close(log):
    """Close ``log``; a full disk may refuse the buffered rest, which no longer matters."""
    if log is not None:
        try:
            log.close()
        except OSError:
            pass
    return None


def run_variant(
    variant,
    train_argv,
    out_dir,
    nproc,
    warmup,
    iters,
    emulate_link=None,
    env=None,
    timeout=1800,
    progress=print,
    tokens=None,
    subdir=None,
    comm_model=None,
    one_rank=False,
):
    """Run one variant; returns its result dict (status ok/failed, timings, losses, trace metrics)."""
    vdir = os.path.join(out_dir, variant.name, *([subdir] if subdir else []))
    _fresh_variant_dir(vdir, out_dir)
    cmd, launch_env = train_command(
        variant, train_argv, vdir, nproc, warmup + iters, emulate_link, one_rank=one_rank
    )
    result = {
        "name": variant.name,
        "label": variant.label,
        "paper": variant.paper,
        "flags": list(variant.flags),
        "command": cmd,
        "dir": vdir,
        "status": "failed",
    }
    watch = _OutputWatcher(variant.name, warmup, progress)
    full_env = dict(os.environ, PYTHONUNBUFFERED="1", **(env or {}), **launch_env)
    rc, result["wall_s"] = _run_logged(cmd, full_env, vdir, out_dir, variant.name, watch, timeout)
    if watch.cpu_shares:
        result["host_cpu_share"] = sum(watch.cpu_shares.values()) / len(watch.cpu_shares)
    result["returncode"] = rc
    if rc != 0:
        why = f"timed out after {timeout}s" if rc is None else f"exit code {rc}"
        cause = _first_error(watch.tail)
        log = os.path.relpath(os.path.join(vdir, "log.txt"), out_dir)  # results.json: relative
        result["error"] = f"oases train {why}{': ' + cause if cause else ''}; see {log}"
        result["log_tail"] = watch.tail[-15:]
        return result
    golden_path = os.path.join(vdir, "golden.json")
    try:
        golden = read_golden(golden_path)
    except (OSError, ValueError) as exc:
        why = exc.strerror if isinstance(exc, OSError) else exc  # an OSError names the full path
        result["error"] = f"no metrics in {os.path.relpath(golden_path, out_dir)}: {why}"
        return result
    result.update(status="ok", **_timings(golden, warmup, tokens), **_traced(vdir, comm_model))
    if result["trace"] is None:
        result["warning"] = "no trace written: exposed communication and efficiency unavailable"
    return result


def read_run(vdir, warmup, tokens=None, comm_model=None):
    """A finished variant's timings and trace metrics read back from its directory, as
    :func:`run_variant` returned them (``--reanalyze`` of the planner's verify grid); a missing
    or unreadable ``golden.json`` raises :class:`OSError`, malformed JSON :class:`ValueError`."""
    golden = read_golden(os.path.join(vdir, "golden.json"))
    return dict(_timings(golden, warmup, tokens), **_traced(vdir, comm_model))


def _traced(vdir, comm_model):
    """``trace_files`` and ``trace`` (:func:`run_metrics` over the ranks; None without traces)."""
    files = trace_files(os.path.join(vdir, "trace.rank{rank}.json"))
    traces = load_traces(files)
    return {"trace_files": files, "trace": run_metrics(traces, comm_model) if traces else None}


def _fresh_variant_dir(vdir, out_dir):
    """``vdir`` made, without an earlier run's traces and metrics; one line if it cannot be."""
    try:
        os.makedirs(vdir, exist_ok=True)
        for f in trace_files(os.path.join(vdir, "trace.rank{rank}.json")) + [
            os.path.join(vdir, "golden.json")
        ]:
            if os.path.exists(f):
                os.remove(f)
    except OSError as exc:
        raise OasesConfigError(
            f"cannot write in {vdir} ({exc.strerror or exc}): free space in --out {out_dir} (or "
            "make it writable), or choose another --out"
        ) from None


class _OutputWatcher:
    """Reads a run's output line by line: keeps its last 200 lines, each rank's CPU share, and
    reports iterations and ``[oases]`` lines as progress."""

    def __init__(self, name, warmup, progress):
        self.name, self.warmup, self.progress = name, warmup, progress
        self.tail, self.cpu_shares = [], {}

    def __call__(self, line):
        self.tail.append(line)
        del self.tail[:-200]
        share = _SHARE.search(line)
        if share:
            self.cpu_shares[int(share.group(1))] = float(share.group(2))
        m = _ITER.search(line)
        if m:
            it, n, ms = int(m.group(1)), int(m.group(2)), float(m.group(3))
            phase = "warm-up" if it <= self.warmup else "timed"
            self.progress(f"  [{self.name}] iteration {it}/{n} ({phase}): {ms:.1f} ms")
        elif line.startswith("[oases]"):
            self.progress(f"  [{self.name}] {line[8:]}")


def _run_logged(cmd, env, vdir, out_dir, name, on_line, timeout):
    """Run ``cmd`` in its own process group, its output to ``vdir/log.txt`` and ``on_line``;
    ``(returncode or None on timeout, wall seconds)``. Killed whole on a timeout or Ctrl-C."""
    t0 = time.time()
    proc = subprocess.Popen(
        cmd,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
        start_new_session=True,
    )
    log_failed = []
    reader = threading.Thread(
        target=_stream,
        args=(proc, os.path.join(vdir, "log.txt"), on_line, log_failed),
        daemon=True,
    )
    reader.start()
    try:
        rc = proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        rc = None
    except BaseException:  # Ctrl-C, SIGTERM: do not leave the run's processes behind
        _end_run(proc)
        reader.join(timeout=1)
        raise
    reader.join(timeout=10)
    if log_failed:
        exc = log_failed[0]
        raise OasesConfigError(
            f"cannot write {os.path.join(vdir, 'log.txt')} ({exc.strerror or exc}); the run of "
            f"{name} was stopped: free space in --out {out_dir} (or make it writable), "
            "or choose another --out"
        )
    return rc, time.time() - t0


#: Seconds an interrupted run's launcher gets to stop its ranks before it is killed.
END_GRACE_S = 5.0


def _end_run(proc, grace=END_GRACE_S):
    """Stop an interrupted run: SIGTERM to its process group (torchrun stops its ranks, which
    torchrun puts in sessions of their own, and waits for them; a one-rank run ends on it), then
    SIGKILL after ``grace`` seconds, at once on a second interrupt (a rank whose launcher was
    killed dies with it: :func:`megatron_oases.launch.die_with_launcher`)."""
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=grace)
    except ProcessLookupError:
        pass
    except BaseException:  # noqa: BLE001 - the grace is over, or a second Ctrl-C: kill
        pass
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait()


def _timings(golden, warmup, tokens=None):
    """The result's timing fields from a run's metrics: the iterations after ``warmup`` timed
    (the last one where there are no more); ``tokens`` per iteration (default: global batch ×
    sequence length, from Megatron's own throughput)."""
    times = golden["iteration-time"]["values"]
    timed = times[warmup:] or times[-1:]
    if tokens is None:  # global batch × seq length
        tokens = golden["tokens-per-sec"]["values"][0] * times[0]
    mean_t = statistics.fmean(timed)
    return dict(
        iteration_time_s=times,
        timed_iterations=len(timed),
        mean_iteration_s=mean_t,
        median_iteration_s=statistics.median(timed),
        stdev_iteration_s=statistics.stdev(timed) if len(timed) > 1 else 0.0,
        tokens_per_iteration=round(tokens),
        tokens_per_sec=tokens / mean_t,
        losses=golden["lm loss"]["values"],
    )
