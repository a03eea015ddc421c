"""Constants and a probe shared by the link emulator's tests in both tiers."""

import time

#: Dilation for the timing tests: a 1 MiB-element fp32 tensor (2 MiB at fp16) all-reduced over
#: PCIe takes ~0.19 ms on the model, ~190 ms emulated — long against sleep jitter, short for CI.
DILATION = 1000.0

#: Emulated duration of the waits whose CPU the contention tests measure.
WAIT_S = 0.4
#: A wait may burn at most this share of its duration as CPU.
CPU_LIMIT = 0.1


def cpu_during(fn):
    """(wall, thread CPU, process CPU) seconds of ``fn()``."""
    w, t, p = time.perf_counter(), time.thread_time(), time.process_time()
    fn()
    return time.perf_counter() - w, time.thread_time() - t, time.process_time() - p
