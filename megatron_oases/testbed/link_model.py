"""Link timing of the emulator: the target link's α–β time, dilated, queued per channel.

:class:`LinkEmulator` decides *when* an emulated op may complete; it does not touch
``torch.distributed`` (:mod:`.collectives` wraps the functions and calls :meth:`LinkEmulator.issue`),
so it can be driven with a fake clock:

* ``t_model`` is an op's time on the target link from the ring α–β model of
  :class:`~.clusters.ClusterProfile` (all-reduce ``2(N−1)/N·K/bw + 2(N−1)·α``; all-gather and
  reduce-scatter ``(N−1)/N·K/bw + (N−1)·α``; broadcast ``K/bw + (N−1)·α``; p2p ``K/bw + α``). The link
  is picked by the group's *global* ranks (``ClusterProfile.link_for``: inter-node, NVLink pair, or
  intra-node PCIe). ``K`` counts floating-point elements at the profile's training dtype
  (``dtype_bytes``, 2 for fp16/bf16) although the CPU tensors are fp32; integer tensors count at their
  own element size. An op completes no earlier than ``dilation × t_model`` after it starts.
* Collectives on one set of ranks share one channel: an op starts when it is issued *and* the previous
  op on that channel has finished (a per-channel "busy until" time). Point-to-point transfers use one
  channel per peer and direction (full duplex).
* Async ops stay async: ``async_op=True`` (and ``isend``/``irecv``/``batch_isend_irecv``) return an
  :class:`EmulatedWork` whose ``wait()`` does the real wait and then sleeps until the modelled
  completion. Compute done between issue and ``wait()`` therefore hides the modelled transfer, exactly as
  a GPU communication stream would; a synchronous op blocks until its modelled completion.

* On CUDA tensors the host clock says nothing about when the GPU gets there (the host runs
  ahead of the device), so an op is instead a spin kernel of ``dilation × t_model`` on its
  channel's CUDA stream (:class:`CudaLink`), ordered after the work issued before it, with
  ``profile.comm_sms`` blocks as NCCL's channels would take SMs (:mod:`.spin`); waiting on it
  makes the caller's stream wait for its event (:class:`CudaEmulatedWork`). The host never
  blocks. Unverified until a GPU check report (``benchmarks/gpu/check.sh``) exists.

``EmulatedWork`` is a ``torch.distributed.Work`` (a subclass: callers that wait only on what
``isinstance(work, Work)`` accepts, such as FSDP2's all-gather copy-out, wait on it; a duck-typed
handle they would skip, reading the output before gloo wrote it) with ``wait``, ``is_completed``,
``is_success``, ``exception``, …; only ``get_future()`` is the real work's future, not delayed.
``EmulatedWork.done_at`` is the modelled completion on the ``time.perf_counter`` clock, for tracers
that want to record it. Every op is recorded (``LinkEmulator.records``), and the time this rank spent
blocked is kept for :meth:`LinkEmulator.usage`.
"""

import collections
import threading
import time

from ..errors import OasesConfigError
from .hostcpu import runqueue_us

try:
    from torch.distributed import Work as _Work
except ImportError:  # a torch built without distributed: nothing to emulate, nor to check against
    _Work = object


def _forwarded(name):
    """A method of the wrapped ``Work``'s that calls the real work's ``name``."""

    def method(self):
        return self._real(name)()

    method.__name__ = name
    return method


class WrappedWork(_Work):
    """A ``torch.distributed.Work`` wrapping the real one (``work``, or None for an op that ran
    synchronously): a subclass, not a duck type, so callers that wait only on what
    ``isinstance(work, Work)`` accepts (FSDP2's all-gather copy-out) wait on it. The base class's
    own methods, unimplemented on a Python subclass, and anything else are the real work's."""

    def __init__(self, work):
        super().__init__()
        self._work = work

    def _real(self, name):
        work = self.__dict__.get("_work")
        if work is None:
            raise AttributeError(name)
        return getattr(work, name)

    # the base class's own methods, unimplemented on a Python subclass: the real work's
    get_future = _forwarded("get_future")
    get_future_result = _forwarded("get_future_result")
    source_rank = _forwarded("source_rank")
    _source_rank = _forwarded("_source_rank")
    _get_duration = _forwarded("_get_duration")
    _get_op_type = _forwarded("_get_op_type")
    _get_sequence_number = _forwarded("_get_sequence_number")

    @property
    def timeout(self):
        return self._real("timeout")

    def __getattr__(self, name):  # anything else from the real Work
        return self._real(name)


class EmulatedWork(WrappedWork):
    """A ``Work`` whose ``wait()`` returns no earlier than the modelled completion time."""

    def __init__(self, work, done_at, emulator, record):
        super().__init__(work)
        self.done_at = done_at
        self._emu = emulator
        # one op's record, or a coalesced batch's (one handle for all)
        self._records = [] if record is None else record if isinstance(record, list) else [record]
        self._waited = False

    def wait(self, timeout=None):
        t_wait, c_wait = self._emu.clock(), time.thread_time()
        for rec in self._records:
            if rec["wait"] is None:
                rec["wait"] = t_wait
        if self._work is not None:
            if timeout is None:
                self._work.wait()
            else:
                self._work.wait(timeout)
        self._emu.sleep_until(self.done_at)
        t_done = self._emu.clock()
        for rec in self._records:
            if rec["returned"] is None:
                rec["returned"] = t_done
        self._emu.blocked_s += t_done - t_wait
        self._emu.blocked_cpu_s += time.thread_time() - c_wait
        self._waited = True
        return True

    def synchronize(self):
        self.wait()

    def block_current_stream(self):
        self.wait()

    def is_completed(self):
        real = True if self._work is None else self._work.is_completed()
        return bool(real) and self._emu.clock() >= self.done_at

    def is_success(self):
        return True if self._work is None else self._work.is_success()

    def exception(self):
        return None if self._work is None else self._work.exception()

    def result(self):
        self.wait()
        return [] if self._work is None else self._work.result()

    def __repr__(self):
        return f"EmulatedWork({self._work!r}, done_at={self.done_at:.6f})"


class CudaLink:
    """Emulated collectives on a CUDA device: a spin kernel on a stream per channel (a channel's
    ops queue in issue order), one launch per op: a Triton kernel of ``sms`` programs spinning on
    the GPU's global timer, or where Triton cannot build it ``torch.cuda._sleep`` (one block, a
    spin of SM clock cycles). ``kernel`` says which ran."""

    #: the kernel the last emulator in this process used, and why Triton's was not (reports)
    last_kernel = None
    fallback_reason = None
    #: while True (a traced step), launches and the waits on them are labelled ``oases.spin#N`` /
    #: ``oases.wait#N`` for the profiler (:mod:`megatron_oases.instrument.kernel_trace`)
    annotate = False
    launches = 0

    def __init__(self, sms=1):
        self.sms = max(1, int(sms))
        self._streams = {}
        self._cycles_per_s = None
        self.kernel = None  # "triton-globaltimer" or "torch.cuda._sleep", after the first op

    def _cycles(self, seconds, device):
        """SM clock cycles of ``seconds``, timed once on a spin of known cycles (after a warm-up:
        the clock rises under load)."""
        import torch

        if self._cycles_per_s is None:
            cycles = 2_000_000
            with torch.cuda.device(device):
                for _ in range(2):
                    start = torch.cuda.Event(enable_timing=True)
                    end = torch.cuda.Event(enable_timing=True)
                    start.record()
                    torch.cuda._sleep(cycles)
                    end.record()
                    end.synchronize()
            self._cycles_per_s = cycles / (start.elapsed_time(end) * 1e-3)
        return max(1, int(seconds * self._cycles_per_s))

    def launch(self, channel, seconds, device):
        """Enqueue ``seconds`` of link time on ``channel`` after the caller's stream's work;
        returns the CUDA event of its completion (``oases_id``: its number in this process)."""
        CudaLink.launches += 1
        if not CudaLink.annotate:
            return self._launch(channel, seconds, device, CudaLink.launches)
        import torch

        with torch.profiler.record_function(f"oases.spin#{CudaLink.launches}"):
            return self._launch(channel, seconds, device, CudaLink.launches)

    def _launch(self, channel, seconds, device, n):
        import torch

        key = (channel, str(device))
        stream = self._streams.get(key)
        if stream is None:
            stream = self._streams[key] = torch.cuda.Stream(device=device)
        stream.wait_stream(torch.cuda.current_stream(device))  # starts once its input is ready
        if self.kernel != "torch.cuda._sleep":
            try:
                from .spin import spin

                with torch.cuda.stream(stream):
                    spin(int(seconds * 1e9), self.sms, device)
                self.kernel = CudaLink.last_kernel = "triton-globaltimer"
            except Exception as exc:  # noqa: BLE001 - no Triton, or it cannot build the kernel
                if self.kernel is not None:
                    raise
                self.kernel = CudaLink.last_kernel = "torch.cuda._sleep"
                CudaLink.fallback_reason = f"{type(exc).__name__}: {str(exc)[:300]}"
        if self.kernel == "torch.cuda._sleep":
            cycles = self._cycles(seconds, device)  # calibrated once, off the channel's stream
            with torch.cuda.stream(stream):
                torch.cuda._sleep(cycles)
        done = torch.cuda.Event()
        done.record(stream)
        done.oases_id = n
        return done


def wait_on(event):
    """The current stream waits for an emulated op's ``event`` (the host goes on)."""
    import torch

    if not CudaLink.annotate:
        torch.cuda.current_stream().wait_event(event)
        return
    with torch.profiler.record_function(f"oases.wait#{getattr(event, 'oases_id', 0)}"):
        torch.cuda.current_stream().wait_event(event)


class CudaEmulatedWork(EmulatedWork):
    """A ``Work`` of an emulated op on CUDA: ``wait()`` makes the current stream wait for the spin
    kernel's event, without blocking the host (as ``Work.wait`` on NCCL does)."""

    def __init__(self, work, event):
        super().__init__(work, None, None, None)  # no host-clock completion on CUDA
        self.event = event

    def wait(self, timeout=None):
        wait_on(self.event)
        return True

    def is_completed(self):
        return self.event.query()

    def __repr__(self):
        return f"CudaEmulatedWork({self._work!r}, event={self.event!r})"


class LinkEmulator:
    """Models op times on ``profile``'s links and delays completion to ``dilation ×`` that time."""

    def __init__(
        self, profile, dilation, clock=time.perf_counter, sleep=time.sleep, max_records=4096
    ):
        if not dilation or dilation <= 0:
            raise OasesConfigError(f"link emulation needs a positive dilation, got {dilation!r}")
        self.profile = profile
        self.dilation = float(dilation)
        self.clock = clock
        self._sleep = sleep
        self._busy = {}
        self._lock = threading.Lock()
        self.records = collections.deque(maxlen=max_records)
        self.originals = {}
        self.coalescing = {}  # group -> [(done, info)] of an open ``_coalescing_manager``
        self.blocked_s = 0.0  # time this rank spent blocked in emulated ops
        self.blocked_cpu_s = 0.0  # CPU time the blocked threads used meanwhile (~0: they sleep)
        self.ops = 0
        self._t0 = None
        self.cuda = CudaLink(getattr(profile, "comm_sms", 1))

    # -- host usage --------------------------------------------------------------------------
    def start_usage(self):
        self.blocked_s, self.blocked_cpu_s, self.ops = 0.0, 0.0, 0
        self._t0 = (time.perf_counter(), time.thread_time(), time.process_time(), runqueue_us())

    def usage(self):
        """Wall and CPU time of this thread since install, time blocked, and the CPU share.

        ``cpu_share`` = thread CPU time ÷ wall time spent *not* blocked in an emulated op: 1.0 when
        the compute ran on a free core, lower when other processes competed for it (the emulation
        then under-states the target's communication share, since only compute slows down).
        ``runq_s``: time this thread waited for a core (Linux; None elsewhere), the contention
        itself. ``blocked_cpu_s``: CPU the blocked threads used while waiting (near 0: waits
        sleep). ``other_threads_cpu_s``: CPU of this process's other threads, mostly gloo doing the
        real transfers and reductions — with a schedule that overlaps, at the same time as compute.
        """
        if self._t0 is None:
            return None
        wall = time.perf_counter() - self._t0[0]
        cpu = time.thread_time() - self._t0[1]
        proc = time.process_time() - self._t0[2]
        runq = runqueue_us()
        busy = max(wall - self.blocked_s, 1e-9)
        return {
            "wall_s": wall,
            "cpu_s": cpu,
            "blocked_s": self.blocked_s,
            "blocked_cpu_s": self.blocked_cpu_s,
            "other_threads_cpu_s": max(0.0, proc - cpu),
            "runq_s": None if runq is None or self._t0[3] is None else (runq - self._t0[3]) / 1e6,
            "ops": self.ops,
            "cpu_share": min(cpu / busy, 1.0),
        }

    # -- model -------------------------------------------------------------------------------
    def element_bytes(self, tensor):
        if tensor.is_floating_point():
            return self.profile.dtype_bytes
        if tensor.is_complex():
            return 2 * self.profile.dtype_bytes
        return tensor.element_size()

    def tensor_bytes(self, tensor):
        return tensor.numel() * self.element_bytes(tensor)

    def model_seconds(self, kind, nbytes, ranks):
        """Undilated time of one op on the target link (seconds)."""
        p, n = self.profile, len(ranks)
        if kind == "all_reduce":
            return p.all_reduce_time(nbytes, ranks)
        if kind == "all_gather":
            return p.all_gather_time(nbytes, ranks)
        if kind == "reduce_scatter":
            return p.reduce_scatter_time(nbytes, ranks)
        if kind == "broadcast":
            if n <= 1:
                return 0.0
            link = p.link_for(ranks)
            return nbytes / (link.bandwidth_gbs * 1e9) + (n - 1) * link.latency_us * 1e-6
        if kind == "p2p":
            if n <= 1:
                return 0.0
            return p.link_for(ranks).ring_time(1, nbytes)
        raise ValueError(kind)

    def reserve(self, channel, seconds, now=None):
        """Book ``seconds`` of host time on ``channel``; returns (start, done) on the host clock."""
        now = self.clock() if now is None else now
        with self._lock:
            start = max(now, self._busy.get(channel, 0.0))
            done = start + seconds
            self._busy[channel] = done
        return start, done

    def sleep_until(self, t):
        while True:
            remaining = t - self.clock()
            if remaining <= 0:
                return
            self._sleep(remaining)

    def _record(self, op, nbytes, ranks, model_s, issue, start, done, is_async):
        rec = {
            "op": op,
            "bytes": int(nbytes),
            "ranks": list(ranks),
            "model_s": model_s,
            "emulated_s": model_s * self.dilation,
            "issue": issue,
            "start": start,
            "done_at": done,
            "async": is_async,
            "wait": None if is_async else issue,
            "returned": None,
        }
        self.ops += 1
        self.records.append(rec)
        return rec

    # -- issue and completion (called by the wrappers of :mod:`.collectives`) --------------
    def issue(self, op, kind, nbytes, ranks, channel, device=None):
        """Model and book one op; returns (done_at, record fields) or (None, None) when it is free.
        On a CUDA ``device`` ``done_at`` is the CUDA event of the op's spin kernel."""
        model_s = self.model_seconds(kind, nbytes, ranks)
        if model_s <= 0.0:
            return None, None
        issue = self.clock()
        if device is not None and device.type == "cuda":
            done = self.cuda.launch(channel, model_s * self.dilation, device)
            return done, (op, nbytes, ranks, model_s, issue, None, None)
        start, done = self.reserve(channel, model_s * self.dilation, issue)
        return done, (op, nbytes, ranks, model_s, issue, start, done)

    def finish_sync(self, result, done, info):
        """A synchronous op: record it and block until its modelled completion ``done`` (on CUDA:
        the current stream waits for it; the host goes on; on CPU ranks with a side stream
        current, that stream: :func:`_defer`)."""
        if not isinstance(done, float):
            self._record(*info, is_async=False)
            wait_on(done)
            return result
        if self._defer(done, [info]):
            return result
        rec = self._record(*info, is_async=False)
        c0 = time.thread_time()
        self.sleep_until(done)
        rec["returned"] = self.clock()
        self.blocked_s += rec["returned"] - rec["issue"]
        self.blocked_cpu_s += time.thread_time() - c0
        return result

    def _defer(self, done, infos):
        """On CPU ranks, a synchronous op issued while a side stream is current completes on that
        stream (:mod:`megatron_oases.platform.cpu_streams`), as on a GPU, where the host only
        enqueues it: recorded as async, waited where that stream is. False: the host stream."""
        from ..platform.cpu_streams import current_stream, default_stream, defer

        if current_stream() is default_stream():
            return False
        records = [self._record(*info, is_async=True) for info in infos]
        return defer(EmulatedWork(None, done, self, records))

    def finish_coalesced(self, manager, batch, async_ops):
        """The ops a ``torch.distributed._coalescing_manager`` issued on one group, ``batch`` of
        ``(done, info)``, as the one collective it runs: with ``async_ops`` its handles (the
        manager's ``works``) complete with the batch's last op; without, the host (or the current
        side stream) waits for that op here, at the manager's exit."""
        dones = [d for d, _ in batch]
        infos = [i for _, i in batch]
        if not isinstance(dones[0], float):  # CUDA events: the link stream runs them in order
            for i in infos:
                self._record(*i, is_async=async_ops)
            if async_ops:
                manager.works = [CudaEmulatedWork(w, dones[-1]) for w in manager.works]
            else:
                wait_on(dones[-1])
            return
        done = max(dones)
        if async_ops:
            records = [self._record(*i, is_async=True) for i in infos]
            works = manager.works or [None]
            manager.works = [EmulatedWork(w, done, self, records) for w in works]
            return
        if self._defer(done, infos):
            return
        records = [self._record(*i, is_async=False) for i in infos]
        EmulatedWork(None, done, self, records).wait()

    def wrap_async(self, work, done, info):
        """An async op: record it; its handle's ``wait()`` returns no earlier than ``done``."""
        rec = self._record(*info, is_async=True)
        if not isinstance(done, float):
            return CudaEmulatedWork(work, done)
        return EmulatedWork(work, done, self, rec)

    # -- reporting ---------------------------------------------------------------------------
    def describe(self):
        p = self.profile
        return (
            f"emulating {p.name} ({p.gpu}): target {p.sustained_tflops:g} TFLOP/s {p.dtype} "
            f"sustained, dilation D = {self.dilation:.1f}; every collective completes no earlier than "
            f"D x its ring alpha-beta time on the target link"
        )
