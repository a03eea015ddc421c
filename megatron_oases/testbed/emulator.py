"""Link emulation (``--emulate-link PROFILE``): a target cluster's communication/computation balance on CPU.

This is an **emulation**, not a simulation and not a measurement of real hardware:

* Compute runs for real on the host CPU, which is about ``D`` times slower than the target GPU, where
  the *dilation* ``D = target sustained GPU FLOP/s ÷ host matmul FLOP/s`` (host rate measured once and
  cached, :mod:`.calibrate`; GPU rate from the profile, :mod:`megatron_oases.resources`).
* Every emulated collective still runs for real on gloo (so the numbers stay correct) but completes no
  earlier than ``D × t_model``, where ``t_model`` is its time on the target link from the ring α–β model
  of :class:`~.clusters.ClusterProfile` (all-reduce ``2(N−1)/N·K/bw + 2(N−1)·α``; all-gather and
  reduce-scatter ``(N−1)/N·K/bw + (N−1)·α``; broadcast ``K/bw + (N−1)·α``; p2p ``K/bw + α``). The link
  is picked by the group's *global* ranks (``ClusterProfile.link_for``: inter-node, NVLink pair, or
  intra-node PCIe). ``K`` counts floating-point elements at the profile's training dtype
  (``dtype_bytes``, 2 for fp16/bf16) although the CPU tensors are fp32; integer tensors count at their
  own element size.
* Collectives on one set of ranks share one channel: an op starts when it is issued *and* the previous
  op on that channel has finished (a per-channel "busy until" time). Point-to-point transfers use one
  channel per peer and direction (full duplex).
* Async ops stay async: ``async_op=True`` (and ``isend``/``irecv``/``batch_isend_irecv``) return an
  :class:`EmulatedWork` whose ``wait()`` does the real wait and then sleeps until the modelled
  completion. Compute done between issue and ``wait()`` therefore hides the modelled transfer, exactly as
  a GPU communication stream would; a synchronous op blocks until its modelled completion.

Patched (as ``torch.distributed.<name>`` attributes, which is how Megatron-Core calls them):
``all_reduce``, ``all_gather``, ``all_gather_into_tensor``, ``_all_gather_base``, ``all_gather_single``,
``reduce_scatter``, ``reduce_scatter_tensor``, ``_reduce_scatter_base``, ``reduce_scatter_single``,
``broadcast``, ``isend``, ``irecv``, ``send``, ``recv``, ``batch_isend_irecv`` and ``P2POp`` (a subclass
that accepts the wrapped ``isend``/``irecv``), plus the module-level aliases Megatron binds at import
time (``dist_all_gather_func``/``dist_reduce_scatter_func`` in ``tensor_parallel.mappings``,
``tensor_parallel.layers`` and ``distributed.param_and_grad_buffer``). Tensor collectives the model does
not cover (``all_to_all``, ``all_to_all_single``, ``scatter``, ``gather``, ``reduce``,
``all_reduce_coalesced``, ``all_gather_coalesced``) raise :class:`EmulationError`. ``barrier`` and the
``*_object*`` helpers are control traffic and pass through un-delayed. Groups of one rank cost nothing.

Wrappers carry ``__wrapped__`` and keep ``__name__``, so a tracer installed after the emulator can wrap
them again: it sees the emulated issue, wait and completion times, and ``EmulatedWork`` behaves like a
``torch.distributed.Work`` (``wait``, ``is_completed``, ``is_success``, ``exception``, …; only
``get_future()`` is the real work's future, not delayed). ``EmulatedWork.done_at`` is the modelled
completion on the ``time.perf_counter`` clock, for tracers that want to record it.

Each rank prints, when the patch is removed, the time it spent blocked in emulated ops and the share
of a core its compute thread got while not blocked: below 1.0 the host was contended, which slows the
compute but not the (modelled) communication, so the run under-states the target's communication
share.

Environment overrides (used by ``oases compare`` to give every variant the identical emulator):
``OASES_EMULATE_DILATION`` (D itself) or ``OASES_HOST_FLOPS`` (the host rate; D = profile ÷ it).
"""

import collections
import functools
import importlib
import inspect
import os
import threading
import time

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d

from ..errors import OasesConfigError
from ..patches import Patch
from .clusters import load_cluster


class EmulationError(OasesConfigError):
    """A collective the link emulator cannot model was called under ``--emulate-link``."""


# name -> cost kind; ``None`` = not a torch attribute in this torch version (skipped).
COLLECTIVES = {
    "all_reduce": "all_reduce",
    "all_gather": "all_gather_list",
    "all_gather_into_tensor": "all_gather_tensor",
    "_all_gather_base": "all_gather_tensor",
    "all_gather_single": "all_gather_tensor",
    "reduce_scatter": "reduce_scatter_list",
    "reduce_scatter_tensor": "reduce_scatter_tensor",
    "_reduce_scatter_base": "reduce_scatter_tensor",
    "reduce_scatter_single": "reduce_scatter_tensor",
    "broadcast": "broadcast",
}
P2P = ("isend", "irecv", "send", "recv")
UNSUPPORTED = (
    "all_to_all",
    "all_to_all_single",
    "scatter",
    "gather",
    "reduce",
    "all_reduce_coalesced",
    "all_gather_coalesced",
)
# Megatron-Core modules that bind torch collectives to module globals at import time.
MEGATRON_ALIASES = (
    (
        "megatron.core.tensor_parallel.mappings",
        ("dist_all_gather_func", "dist_reduce_scatter_func"),
    ),
    ("megatron.core.tensor_parallel.layers", ("dist_all_gather_func", "dist_reduce_scatter_func")),
    (
        "megatron.core.distributed.param_and_grad_buffer",
        ("dist_all_gather_func", "dist_reduce_scatter_func"),
    ),
)

_ACTIVE = None


def active_emulator():
    """The installed :class:`LinkEmulator`, or None."""
    return _ACTIVE


def _sig(fn):
    try:
        return inspect.signature(fn)
    except (TypeError, ValueError):
        return None


class EmulatedWork:
    """A ``Work`` whose ``wait()`` returns no earlier than the modelled completion time."""

    def __init__(self, work, done_at, emulator, record):
        self._work = work
        self.done_at = done_at
        self._emu = emulator
        self._record = record
        self._waited = False

    def wait(self, timeout=None):
        t_wait = self._emu.clock()
        if self._record is not None and self._record["wait"] is None:
            self._record["wait"] = t_wait
        if self._work is not None:
            if timeout is None:
                self._work.wait()
            else:
                self._work.wait(timeout)
        self._emu.sleep_until(self.done_at)
        t_done = self._emu.clock()
        if self._record is not None and self._record["returned"] is None:
            self._record["returned"] = t_done
        self._emu.blocked_s += t_done - t_wait
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

    def __getattr__(self, name):  # anything else (source_rank, get_future, ...) from the real Work
        work = self.__dict__.get("_work")
        if work is None:
            raise AttributeError(name)
        return getattr(work, name)

    def __repr__(self):
        return f"EmulatedWork({self._work!r}, done_at={self.done_at:.6f})"


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
        self.blocked_s = 0.0  # time this rank spent blocked in emulated ops
        self.ops = 0
        self._t0 = None

    # -- host usage --------------------------------------------------------------------------
    def start_usage(self):
        self.blocked_s, self.ops = 0.0, 0
        self._t0 = (time.perf_counter(), time.thread_time())

    def usage(self):
        """Wall and CPU time of this thread since install, time blocked, and the CPU share.

        ``cpu_share`` = thread CPU time ÷ wall time spent *not* blocked in an emulated op: 1.0 when
        the compute ran on a free core, lower when other processes competed for it (the emulation
        then under-states the target's communication share, since only compute slows down).
        """
        if self._t0 is None:
            return None
        wall = time.perf_counter() - self._t0[0]
        cpu = time.thread_time() - self._t0[1]
        busy = max(wall - self.blocked_s, 1e-9)
        return {
            "wall_s": wall,
            "cpu_s": cpu,
            "blocked_s": self.blocked_s,
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

    # -- helpers -----------------------------------------------------------------------------
    @staticmethod
    def group_ranks(group):
        """Global ranks of ``group`` (default group when None); None when this rank is not in it."""
        if group is None:
            group = c10d._get_default_group()
        if c10d._rank_not_in_group(group):
            return None
        return list(dist.get_process_group_ranks(group))

    def _issue(self, op, kind, nbytes, ranks, channel):
        """Model and book one op; returns (done_at, record fields) or (None, None) when it is free."""
        model_s = self.model_seconds(kind, nbytes, ranks)
        if model_s <= 0.0:
            return None, None
        issue = self.clock()
        start, done = self.reserve(channel, model_s * self.dilation, issue)
        return done, (op, nbytes, ranks, model_s, issue, start, done)

    def _finish_sync(self, result, done, info):
        rec = self._record(*info, is_async=False)
        self.sleep_until(done)
        rec["returned"] = self.clock()
        self.blocked_s += rec["returned"] - rec["issue"]
        return result

    def _wrap_async(self, work, done, info):
        rec = self._record(*info, is_async=True)
        return EmulatedWork(work, done, self, rec)

    # -- wrappers ----------------------------------------------------------------------------
    def _cost(self, kind, ba):
        """(model kind, target bytes, ranks) of a collective call from its bound arguments."""
        a = ba.arguments
        ranks = self.group_ranks(a.get("group"))
        if ranks is None:
            return None
        n = len(ranks)
        if kind == "all_reduce":
            return "all_reduce", self.tensor_bytes(a["tensor"]), ranks
        if kind == "all_gather_list":
            return "all_gather", self.tensor_bytes(a["tensor"]) * n, ranks
        if kind == "all_gather_tensor":
            return "all_gather", self.tensor_bytes(a["output_tensor"]), ranks
        if kind == "reduce_scatter_list":
            return "reduce_scatter", sum(self.tensor_bytes(t) for t in a["input_list"]), ranks
        if kind == "reduce_scatter_tensor":
            return "reduce_scatter", self.tensor_bytes(a["input"]), ranks
        if kind == "broadcast":
            return "broadcast", self.tensor_bytes(a["tensor"]), ranks
        raise ValueError(kind)

    def wrap_collective(self, name, orig, kind):
        sig = _sig(orig)
        emu = self

        @functools.wraps(orig)
        def wrapper(*args, **kwargs):
            ba = sig.bind(*args, **kwargs)
            cost = emu._cost(kind, ba)
            if cost is None:
                return orig(*args, **kwargs)
            model_kind, nbytes, ranks = cost
            done, info = emu._issue(name, model_kind, nbytes, ranks, ("coll", tuple(ranks)))
            if done is None:
                return orig(*args, **kwargs)
            result = orig(*args, **kwargs)
            if ba.arguments.get("async_op", False):
                return emu._wrap_async(result, done, info)
            return emu._finish_sync(result, done, info)

        wrapper.__oases_emulated__ = True
        return wrapper

    def _p2p_cost(self, send, tensor, peer, group):
        """(ranks of the link, channel) of a p2p op with global ``peer`` (None: unknown)."""
        me = dist.get_rank()
        if peer is None:
            ranks = self.group_ranks(group) or [me]
        else:
            ranks = sorted({me, int(peer)})
        channel = ("send" if send else "recv", peer)
        return self.tensor_bytes(tensor), ranks, channel

    @staticmethod
    def _global_peer(group, peer, group_peer):
        if group_peer is not None:
            g = group if group is not None else c10d._get_default_group()
            return dist.get_global_rank(g, group_peer)
        return peer

    def wrap_p2p(self, name, orig):
        sig = _sig(orig)
        emu = self
        send = name in ("isend", "send")
        is_async = name in ("isend", "irecv")

        @functools.wraps(orig)
        def wrapper(*args, **kwargs):
            a = sig.bind(*args, **kwargs).arguments
            group = a.get("group")
            if group is not None and c10d._rank_not_in_group(group):
                return orig(*args, **kwargs)
            if send:
                peer = emu._global_peer(group, a.get("dst"), a.get("group_dst"))
            else:
                peer = emu._global_peer(group, a.get("src"), a.get("group_src"))
            nbytes, ranks, channel = emu._p2p_cost(send, a["tensor"], peer, group)
            done, info = emu._issue(name, "p2p", nbytes, ranks, channel)
            if done is None:
                return orig(*args, **kwargs)
            result = orig(*args, **kwargs)
            if is_async:
                return emu._wrap_async(result, done, info)
            return emu._finish_sync(result, done, info)

        wrapper.__oases_emulated__ = True
        return wrapper

    def wrap_batch_isend_irecv(self, orig):
        emu = self

        @functools.wraps(orig)
        def wrapper(p2p_op_list):
            issued = []
            for op in p2p_op_list:
                send = _unwrap(op.op) is c10d.isend
                nbytes, ranks, channel = emu._p2p_cost(send, op.tensor, op.peer, op.group)
                done, info = emu._issue("isend" if send else "irecv", "p2p", nbytes, ranks, channel)
                issued.append((done, info))
            works = orig(p2p_op_list)
            if works is None:
                return works
            works = list(works)
            if len(works) == len(issued):
                pairs = list(zip(works, issued))
            else:  # coalesced: every handle completes with the slowest op of the batch
                last = max(
                    ((d, i) for d, i in issued if d is not None),
                    default=(None, None),
                    key=lambda x: x[0],
                )
                pairs = [(w, last) for w in works]
            out = []
            for work, (done, info) in pairs:
                out.append(work if done is None else emu._wrap_async(work, done, info))
            return out

        wrapper.__oases_emulated__ = True
        return wrapper

    def unsupported(self, name, orig):
        profile = self.profile.name

        @functools.wraps(orig)
        def wrapper(*args, **kwargs):
            raise EmulationError(
                f"torch.distributed.{name} is not supported under --emulate-link {profile}: the "
                f"emulator models {', '.join(supported_names())}; run without --emulate-link"
            )

        wrapper.__oases_emulated__ = True
        return wrapper

    # -- patch -------------------------------------------------------------------------------
    def replacements(self):
        """(owner, attr, replacement) for every patched attribute."""
        out, by_orig = [], {}
        for name, kind in COLLECTIVES.items():
            orig = getattr(dist, name, None)
            if orig is None:
                continue
            new = self.wrap_collective(name, orig, kind)
            out.append((dist, name, new))
            by_orig[orig] = new
            self.originals[name] = orig
        for name in P2P:
            orig = getattr(dist, name)
            new = self.wrap_p2p(name, orig)
            out.append((dist, name, new))
            by_orig[orig] = new
            self.originals[name] = orig
        out.append((dist, "batch_isend_irecv", self.wrap_batch_isend_irecv(dist.batch_isend_irecv)))
        out.append((dist, "P2POp", _make_p2p_op_class(dist.P2POp)))
        for name in UNSUPPORTED:
            orig = getattr(dist, name, None)
            if orig is not None:
                out.append((dist, name, self.unsupported(name, orig)))
        for module, attrs in MEGATRON_ALIASES:
            try:
                mod = importlib.import_module(module)
            except ImportError:
                continue
            for attr in attrs:
                cur = getattr(mod, attr, None)
                if cur in by_orig:
                    out.append((mod, attr, by_orig[cur]))
        return out

    # -- reporting ---------------------------------------------------------------------------
    def describe(self):
        p = self.profile
        return (
            f"emulating {p.name} ({p.gpu}): target {p.sustained_tflops:g} TFLOP/s {p.dtype} "
            f"sustained, dilation D = {self.dilation:.1f}; every collective completes no earlier than "
            f"D x its ring alpha-beta time on the target link"
        )


def supported_names():
    return [n for n in COLLECTIVES if hasattr(dist, n)] + list(P2P) + ["batch_isend_irecv"]


def _unwrap(fn):
    """Follow ``__wrapped__`` (ours, or a tracer's wrapper of ours) down to torch's own function."""
    seen = 0
    while fn not in (c10d.isend, c10d.irecv) and hasattr(fn, "__wrapped__") and seen < 16:
        fn = fn.__wrapped__
        seen += 1
    return fn


def _make_p2p_op_class(base):
    class P2POp(base):
        """``torch.distributed.P2POp`` that accepts the emulated (or traced) ``isend``/``irecv``."""

        def __new__(cls, op, tensor, *args, **kwargs):
            return base.__new__(cls, _unwrap(op), tensor, *args, **kwargs)

        def __init__(self, op, tensor, *args, **kwargs):
            super().__init__(_unwrap(op), tensor, *args, **kwargs)

    P2POp.__qualname__ = base.__qualname__
    P2POp.__module__ = base.__module__
    return P2POp


def resolve_dilation(profile, log=None):
    """D for ``profile``: ``$OASES_EMULATE_DILATION``, else profile ÷ host rate.

    The host rate is ``$OASES_HOST_FLOPS`` or the cached measurement (:func:`.calibrate.host_flops`,
    taken on global rank 0 and broadcast so that every rank uses the same D), both the rate of one
    process alone, scaled by :func:`.calibrate.oversubscription_share` when this host runs more
    ranks × threads than it has CPUs.
    Returns ``(dilation, info)``.
    """
    env_d = os.environ.get("OASES_EMULATE_DILATION")
    if env_d:
        try:
            d = float(env_d)
        except ValueError:
            raise OasesConfigError(f"OASES_EMULATE_DILATION={env_d!r} is not a number")
        return d, {"source": "OASES_EMULATE_DILATION", "host_flops": None}
    env_f = os.environ.get("OASES_HOST_FLOPS")
    if env_f:
        try:
            flops = float(env_f)
        except ValueError:
            raise OasesConfigError(f"OASES_HOST_FLOPS={env_f!r} is not a number")
        source = "OASES_HOST_FLOPS"
    else:
        from .calibrate import host_flops

        flops, source = 0.0, "calibrate"
        distributed = dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
        if not distributed or dist.get_rank() == 0:
            flops, info = host_flops(torch.get_num_threads())
            source = "cache" if info["cached"] else "measured"
        if distributed:
            t = torch.tensor([flops], dtype=torch.float64)
            c10d.broadcast(t, src=0)  # torch's own function: the emulator is not installed yet
            flops = float(t.item())
    if flops <= 0:
        raise OasesConfigError(f"host FLOP/s must be positive, got {flops!r}")
    from .calibrate import oversubscription_share

    ranks = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    share = oversubscription_share(ranks, torch.get_num_threads())
    info = {"source": source, "host_flops": flops * share, "oversubscription_share": share}
    return profile.sustained_tflops * 1e12 / (flops * share), info


class EmulatorPatch(Patch):
    """The ``emulate-link`` patch: installs a :class:`LinkEmulator` over ``torch.distributed``."""

    def __init__(self, emulator):
        self.emulator = emulator
        super().__init__(
            "emulate-link",
            replacements=emulator.replacements(),
            on_install=self._activate,
            on_uninstall=self._deactivate,
        )

    def _activate(self):
        global _ACTIVE
        _ACTIVE = self.emulator
        self.emulator.start_usage()

    def _deactivate(self):
        global _ACTIVE
        if _ACTIVE is self.emulator:
            _ACTIVE = None
        u = self.emulator.usage()
        if u is not None and u["ops"]:
            rank = dist.get_rank() if dist.is_initialized() else 0
            print(
                f"[oases] emulator rank {rank}: {u['ops']} ops emulated, blocked {u['blocked_s']:.1f} s "
                f"of {u['wall_s']:.1f} s; compute thread CPU share while not blocked "
                f"{u['cpu_share']:.2f} (1.00 = a free core, lower = contended host)",
                flush=True,
            )


def make_emulator(profile_name, dilation=None):
    """A :class:`LinkEmulator` for a profile name/path; D from :func:`resolve_dilation` if not given."""
    profile = load_cluster(profile_name)
    info = {"source": "argument", "host_flops": None}
    if dilation is None:
        dilation, info = resolve_dilation(profile)
    emu = LinkEmulator(profile, dilation)
    emu.info = info
    return emu


def _cpus():
    from .calibrate import host_cpus

    return host_cpus()


def make_patch(args):
    """Factory for :func:`megatron_oases.patches.install_from_args`: a patch iff ``--emulate-link``."""
    name = getattr(args, "emulate_link", None)
    if not name:
        return None
    emu = make_emulator(name)
    if not dist.is_initialized() or dist.get_rank() == 0:
        host = emu.info.get("host_flops")
        host_s = f"host {host / 1e9:.1f} GFLOP/s ({emu.info['source']}), " if host else ""
        share = emu.info.get("oversubscription_share", 1.0)
        if share < 1.0:
            host_s = (
                f"host {host / share / 1e9:.1f} GFLOP/s ({emu.info['source']}) x {share:.2f} per "
                f"rank (more ranks x threads than the {_cpus()} CPUs), "
            )
        print(f"[oases] {host_s}{emu.describe()}", flush=True)
    return EmulatorPatch(emu)
