"""Where a CPU rank's time goes: per-thread CPU, run-queue waits, the whole host's load.

On a CPU testbed the ranks, gloo's transfer threads and whatever else runs on the host share the
cores, so a compute op's wall time = its CPU time (work) + time it waited for a core (contention)
(+ time asleep, none for compute). These readers (Linux ``/proc``; ``None``/``{}`` elsewhere) let the
tracer (:mod:`megatron_oases.instrument.trace`) and the link emulator tell the two apart.
"""

import os


def thread_cpu_times():
    """{native thread id: (name, CPU seconds)} of this process's threads; {} without ``/proc``."""
    out = {}
    try:
        tids = os.listdir("/proc/self/task")
        tick = os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, AttributeError):
        return out
    for tid in tids:
        try:
            with open(f"/proc/self/task/{tid}/stat") as f:
                stat = f.read()
        except OSError:  # the thread ended meanwhile
            continue
        name = stat[stat.find("(") + 1 : stat.rfind(")")]
        fields = stat[stat.rfind(")") + 2 :].split()
        try:  # utime, stime: fields 14 and 15 of stat(5), in clock ticks
            out[int(tid)] = (name, (int(fields[11]) + int(fields[12])) / tick)
        except (IndexError, ValueError):
            continue
    return out


def runqueue_us():
    """Time (µs) the calling thread has spent runnable but waiting for a CPU since it started
    (``/proc/thread-self/schedstat``, Linux); None where not available."""
    try:
        with open("/proc/thread-self/schedstat") as f:
            return int(f.read().split()[1]) / 1e3
    except (OSError, ValueError, IndexError):
        return None


def host_cpu_times():
    """The host's busy and steal CPU time (µs, all CPUs, since boot; ``/proc/stat``) and its CPU
    count; None where not available. Busy = everything but idle and iowait; steal = time the
    hypervisor ran something else on this VM's CPUs."""
    try:
        with open("/proc/stat") as f:
            lines = f.read().splitlines()
        tick = os.sysconf("SC_CLK_TCK")
        v = [int(x) for x in lines[0].split()[1:]]
    except (OSError, ValueError, IndexError, AttributeError):
        return None
    cpus = sum(1 for line in lines if line.startswith("cpu") and line[3:4].isdigit())
    idle = v[3] + (v[4] if len(v) > 4 else 0)
    steal = v[7] if len(v) > 7 else 0
    guest = sum(v[8:10])  # already counted in user/nice
    busy = sum(v) - idle - steal - guest
    return {"busy_us": busy / tick * 1e6, "steal_us": steal / tick * 1e6, "cpus": cpus}
