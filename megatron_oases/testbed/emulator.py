"""Link emulation (``--emulate-link PROFILE``): a target cluster's communication/computation balance on CPU.

This is an **emulation**, not a simulation and not a measurement of real hardware:

* Compute runs for real on the host CPU, which is about ``D`` times slower than the target GPU, where
  the *dilation* ``D`` = host time ÷ target time of one layer of the run's shape (below; host rates
  measured once and cached, :mod:`.calibrate`; GPU rates from the profile).
* Every emulated collective still runs for real on gloo (so the numbers stay correct) but completes no
  earlier than ``D × t_model``, where ``t_model`` is its time on the target link; collectives on one set
  of ranks queue on one channel and async ops stay async (:mod:`.link_model`).
* Which ``torch.distributed`` functions (and Megatron aliases) are wrapped, and which raise
  :class:`~.collectives.EmulationError`: :mod:`.collectives`.

This module is the ``emulate-link`` :class:`~megatron_oases.patches.Patch`: it resolves ``D``, builds
the :class:`~.link_model.LinkEmulator` for the named cluster and installs the wrappers over
``torch.distributed``.

Each rank prints, when the patch is removed, the time it spent blocked in emulated ops and the share
of a core its compute thread got while not blocked: below 1.0 the host was contended, which slows the
compute but not the (modelled) communication, so the run under-states the target's communication
share. The line also gives the time the compute thread waited for a core, the CPU time of the
rank's other threads, and the CPU its blocked waits used (it warns when that is not near zero).

**What the testbed itself costs the compute (issue 13).** Emulated waits sleep (gloo's own
condition-variable wait, then ``time.sleep`` to the modelled completion): they use no CPU. The real
gloo collective does: its TCP loop and worker threads (``gloo_tcp_loop``, ``pt_gloo_runloop``) copy
and reduce the fp32 tensors, 0.1-0.25 s per rank and iteration at H=1024, seq 512, micro-batch 4,
TMP=2 (3-6 % of the compute thread's CPU). Stock Megatron's synchronous collectives run it while
the compute thread is blocked; a schedule that overlaps runs it while the other sub-batch computes,
where it may take the core. Other processes on the host take cores the same way, and not equally:
stock on a slow link sleeps in long blocking waits and, awake, waited less for a core than
``oases`` at the same load (0.21 against 0.32 s per second of compute CPU on rtx3090-pcie; 0.16
for both on h100-nvlink, whose waits are shorter). Both show as wall time of the compute ops beyond
their CPU time (run-queue time), never as CPU time: on that loaded host (other processes using
about a third of the CPUs) stock and ``oases`` traced 3.62 s and 3.63 s of compute CPU per
iteration but 4.35 s and 4.78 s of compute wall, the difference being run-queue time (0.75 s and
1.15 s). Compare compute by its
CPU time (the tracer's ``cpu_us``; ``compute_cpu_us`` of :mod:`megatron_oases.viz.analysis`) and
read wall − CPU as contention (``runq_us``; ``external_cpu_us`` for the other processes).

**The dilation D, per shape** (:func:`resolve_dilation`): the host time of one layer of the run's
shape ÷ its time on the target GPU, both from the roofline of :mod:`megatron_oases.device_model`
(GEMM FLOPs at the GEMM rate plus memory-bound bytes at the memory bandwidth). The target runs the
layer in the profile's dtype with the core attention Megatron's ``--attention-backend`` picks on
CUDA; the host in the run's dtype with the attention it picks on the host. ``oases compare``
computes D with the same function before it launches the variants (:func:`emulation_info`) and
hands it to every variant's ranks in their environment (:func:`dilation_env`), so that all run
with the identical D.

Environment overrides: ``OASES_EMULATE_DILATION`` (D itself; also how a launcher hands D to its
ranks), ``OASES_HOST_FLOPS`` (the host's FLOP/s) and ``OASES_HOST_MEM_GBS`` (the host's memory
bandwidth, GB/s; the one-rank GPU emulator sets both to the GPU's measured rates).
"""

import os

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d

from ..errors import OasesConfigError
from ..patching import Patch
from .clusters import load_cluster
from .collectives import replacements
from .link_model import LinkEmulator

#: The version of what the link emulation computes (the modelled collective times and their
#: queueing, the dilation D's rule, the waits): bump it (to the day's date) in the same commit that
#: changes any of them; benchmark reports record it, and tests/unit/test_report_versions.py names
#: the committed reports it makes stale.
EMULATOR_VERSION = "2026-12-07"


def shape_of_args(args):
    """The layer shape of Megatron's ``args`` as :mod:`megatron_oases.device_model` counts it,
    with the core attention the target GPU runs (Megatron's ``--attention-backend`` on CUDA)."""
    gqa = getattr(args, "group_query_attention", False)
    return {
        "hidden_size": args.hidden_size,
        "num_attention_heads": args.num_attention_heads,
        "num_query_groups": args.num_query_groups if gqa else None,
        "kv_channels": getattr(args, "kv_channels", None),
        "ffn_hidden_size": args.ffn_hidden_size,
        "seq_length": args.seq_length,
        "swiglu": bool(getattr(args, "swiglu", False)),
        "normalization": getattr(args, "normalization", "LayerNorm"),
        "disable_bias_linear": not getattr(args, "add_bias_linear", True),
        "hidden_dropout": getattr(args, "hidden_dropout", 0.0) or 0.0,
        "attention_dropout": getattr(args, "attention_dropout", 0.0) or 0.0,
        "core_attention": _core_attention(args, cuda=True),
    }


def _core_attention(args, cuda):
    """``fused`` where :func:`megatron_oases.attention.choose_core_attention` picks a fused kernel
    (SDPA or TE) on that device for Megatron's ``--attention-backend``, else ``unfused``."""
    return core_attention_kind(getattr(args, "attention_backend", None), cuda)


def core_attention_kind(backend, cuda):
    """``fused`` or ``unfused`` (Megatron's scores-materialising module) for ``backend`` (an
    ``AttnBackend`` or its name; None: the device's default) on that device."""
    if backend is None:
        return "fused" if cuda else "unfused"
    from ..attention import STOCK, choose_core_attention

    return "unfused" if choose_core_attention(backend, cuda=cuda, te=False) == STOCK else "fused"


#: The environment variable that hands D to the launched ranks (``oases compare``, the planner's
#: ``--verify-top``): :func:`dilation_env` sets it, :func:`resolve_dilation` reads it; a user may
#: set it to force D.
DILATION_ENV = "OASES_EMULATE_DILATION"


def _env_rate(name):
    value = os.environ.get(name)
    if not value:
        return None
    try:
        rate = float(value)
    except ValueError:
        raise OasesConfigError(f"{name}={value!r} is not a number")
    if rate <= 0:
        raise OasesConfigError(f"{name}={value!r} must be positive")
    return rate


def threads_per_rank(given, nproc, cpus=None):
    """Torch threads per rank process: ``given`` (``--threads-per-rank``), else a rank's share of
    the ``cpus`` (default: those this process may use). Also under ``--one-rank``: rank 0 alone
    runs with the threads it has in the all-ranks job (not the whole host), so that its compute
    and D are the same in both (issue 42: with every CPU it was calibrated at a 2-thread rate its
    unfused ops did not reach, and ran ``oases`` 1.73x where all ranks ran 1.41x)."""
    if given:
        return given
    if cpus is None:
        from .calibrate import host_cpus

        cpus = host_cpus()
    return max(1, cpus // nproc)


def host_rates(threads=None, cuda=False):
    """The emulating host's (FLOP/s, bytes/s) of one process alone with ``threads`` torch threads
    (default: the current count), and where each came from: ``$OASES_HOST_FLOPS`` /
    ``$OASES_HOST_MEM_GBS`` (GB/s), else the cached CPU calibration (:mod:`.calibrate`); on CUDA
    without ``$OASES_HOST_MEM_GBS`` the device's bandwidth is measured now. In a process group,
    taken on global rank 0 and broadcast, so that every rank uses the same D."""
    from . import calibrate

    flops, mem = _env_rate("OASES_HOST_FLOPS"), _env_rate("OASES_HOST_MEM_GBS")
    sources = ["OASES_HOST_FLOPS" if flops else "", "OASES_HOST_MEM_GBS" if mem else ""]
    mem = mem * 1e9 if mem else None
    distributed = dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
    if flops and mem:
        return flops, mem, sources
    if not distributed or dist.get_rank() == 0:
        threads = int(threads or torch.get_num_threads())
        if not flops:
            flops, info = calibrate.host_flops(threads)
            sources[0] = calibrate.rate_source(info, cached="cached calibration")
        if not mem and cuda:
            mem = calibrate.measure_memory_bandwidth(device="cuda")
            sources[1] = "measured on cuda"
        elif not mem:
            mem, info = calibrate.host_memory_bandwidth(threads)
            sources[1] = calibrate.rate_source(info, cached="cached calibration")
    if distributed:
        t = torch.tensor([flops or 0.0, mem or 0.0], dtype=torch.float64)
        c10d.broadcast(t, src=0)  # torch's own function: the emulator is not installed yet
        flops, mem = float(t[0]), float(t[1])
        sources = [x or "rank 0" for x in sources]
    return flops, mem, sources


def resolve_dilation(profile, link=None, ranks=None, threads=None, cuda=None, explain=False):
    """D for ``profile`` at the layer shape of ``link`` (the run's
    :class:`~megatron_oases.config.EmulatedLink`): the one place D is computed, in the launched
    ranks and in ``oases compare`` before it launches them.

    ``$OASES_EMULATE_DILATION`` (:data:`DILATION_ENV`) if set, else the roofline
    :func:`~megatron_oases.device_model.roofline_dilation` with the host's rates
    (:func:`host_rates`) of one process alone, scaled by
    :func:`.calibrate.oversubscription_share` when this host runs more ``ranks`` × ``threads``
    than it has CPUs (defaults: ``$LOCAL_WORLD_SIZE`` and the current torch threads). Without a
    shape (``link`` or its ``shape`` None) the layer is GEMMs only, i.e. D = profile ÷ host
    FLOP/s. ``cuda`` (default: whether CUDA is available): the host is a GPU (its attention and
    memory bandwidth). With ``explain`` the roofline and its rates are computed even where the
    variable forces D (for a report); a rank handed D skips them.

    Returns ``(dilation, info)``: ``info["source"]`` (of D where forced, else of the FLOP rate),
    the rates (per rank, and ``*_alone``), the share, and ``info["roofline"]``, the
    :class:`~megatron_oases.device_model.Dilation` (its parts) when computed.
    """
    forced = _env_rate(DILATION_ENV)
    if forced and not explain:
        return forced, {"source": DILATION_ENV, "host_flops": None}
    from ..device_model import DeviceRates, Work, dilation, roofline_dilation
    from .calibrate import oversubscription_share

    cuda = torch.cuda.is_available() if cuda is None else cuda
    threads = int(threads or torch.get_num_threads())
    ranks = int(os.environ.get("LOCAL_WORLD_SIZE", "1")) if ranks is None else ranks
    flops, mem, sources = host_rates(threads, cuda)
    share = oversubscription_share(ranks, threads)
    host = DeviceRates(flops * share, mem * share, "host")
    if link is None or link.shape is None:
        dl = dilation(Work(1.0, 0.0), host, DeviceRates.from_profile(profile))
    else:
        dl = roofline_dilation(
            profile,
            link.shape,
            link.tensor_model_parallel_size,
            host,
            2 if link.half_precision else 4,
            samples=link.micro_batch_size,
            sp=link.sequence_parallel,
            host_attention=core_attention_kind(link.attention_backend, cuda),
        )
    info = {
        "source": DILATION_ENV if forced else sources[0],
        "memory_source": sources[1],
        "host_flops": flops * share,
        "host_memory_bytes_per_s": mem * share,
        "host_flops_alone": flops,
        "host_memory_bytes_per_s_alone": mem,
        "oversubscription_share": share,
        "threads": threads,
        "roofline": dl,
    }
    return forced or dl.d, info


def emulation_info(profile, link, processes, threads):
    """The emulation every variant of ``oases compare`` shares (its results.json ``emulation``):
    D of ``link``'s layer shape (:func:`resolve_dilation`, ``processes`` on this host × ``threads``
    each, CPU host), the rates it came from and the roofline's parts. The ranks get D through
    :func:`dilation_env`, so that every variant runs with the identical D."""
    d, info = resolve_dilation(
        profile, link, ranks=processes, threads=threads, cuda=False, explain=True
    )
    dl, share = info["roofline"], info["oversubscription_share"]
    return {
        "profile": profile.name,
        "gpu": profile.gpu,
        "dtype": profile.dtype,
        "dtype_bytes": profile.dtype_bytes,
        "target_tflops": profile.sustained_tflops,
        "target_memory_gbs": profile.memory_bandwidth_gbs,
        "host_gflops": info["host_flops"] / 1e9,
        "host_gflops_alone": info["host_flops_alone"] / 1e9,
        "host_memory_gbs": info["host_memory_bytes_per_s"] / 1e9,
        "host_memory_source": info["memory_source"],
        "oversubscription_share": share,
        "host_source": info["source"],
        "threads_per_rank": threads,
        "target_gemm_ms": dl.target.gemm_s * 1e3,
        "target_memory_ms": dl.target.memory_s * 1e3,
        "host_gemm_ms": dl.host.gemm_s * 1e3,
        "host_memory_ms": dl.host.memory_s * 1e3,
        "roofline_dilation": dl.d,
        "dilation": d,
    }


def dilation_env(d):
    """The environment that hands D to the launched ranks (their :func:`resolve_dilation` reads
    it back): the only way D crosses the process boundary."""
    return {DILATION_ENV: repr(d)}


class EmulatorPatch(Patch):
    """The ``emulate-link`` patch: installs a :class:`LinkEmulator` over ``torch.distributed``."""

    def __init__(self, emulator):
        self.emulator = emulator
        super().__init__(
            "emulate-link",
            replacements=replacements(emulator),
            on_install=self._activate,
            on_uninstall=self._deactivate,
        )

    def _activate(self):
        self.emulator.start_usage()

    def _deactivate(self):
        u = self.emulator.usage()
        if u is not None and u["ops"]:
            rank = dist.get_rank() if dist.is_initialized() else 0
            print(f"[oases] emulator rank {rank}: {usage_line(u)}", flush=True)


def usage_line(u):
    """The per-rank line printed at the end of a run (``oases compare`` parses the CPU share)."""
    line = (
        f"{u['ops']} ops emulated, blocked {u['blocked_s']:.1f} s of {u['wall_s']:.1f} s; compute "
        f"thread CPU share while not blocked {u['cpu_share']:.2f} (1.00 = a free core, lower = "
        f"contended host)"
    )
    if u.get("runq_s") is not None:
        line += f"; it waited {u['runq_s']:.1f} s for a CPU"
    line += (
        f"; the rank's other threads (gloo transfers) used {u['other_threads_cpu_s']:.1f} s CPU, "
        f"its blocked waits {u['blocked_cpu_s']:.2f} s"
    )
    if u["blocked_cpu_s"] > SPIN_SHARE * u["blocked_s"] + 0.05:
        line += (
            f" -- WARNING: its waits used {u['blocked_cpu_s']:.2f} s CPU in {u['blocked_s']:.2f} s "
            "blocked; an emulated wait should sleep"
        )
    return line


#: Share of the blocked time a rank's waits may spend on the CPU before its line warns.
SPIN_SHARE = 0.1


def make_emulator(profile_name, dilation=None, link=None):
    """A :class:`LinkEmulator` for a profile name/path; D from :func:`resolve_dilation` (at the
    shape of ``link``, an :class:`~megatron_oases.config.EmulatedLink`) if not given."""
    profile = load_cluster(profile_name)
    info = {"source": "argument", "host_flops": None}
    if dilation is None:
        dilation, info = resolve_dilation(profile, link)
    emu = LinkEmulator(profile, dilation)
    emu.info = info
    return emu


def _cpus():
    from .calibrate import host_cpus

    return host_cpus()


def make_patch(config):
    """Factory for the run's runtime (:func:`megatron_oases.patches.make_runtime`): a patch iff ``--emulate-link``
    (``config.emulate_link``)."""
    link = config.emulate_link
    if link is None:
        return None
    emu = make_emulator(link.profile, link=link)
    if not dist.is_initialized() or dist.get_rank() == 0:
        info = emu.info
        host, mem = info.get("host_flops"), info.get("host_memory_bytes_per_s")
        host_s = ""
        if host:
            share = info.get("oversubscription_share", 1.0)
            host_s = (
                f"host {host / share / 1e9:.1f} GFLOP/s ({info['source']}), "
                f"{mem / share / 1e9:.2f} GB/s ({info['memory_source']})"
            )
            if share < 1.0:
                host_s += f" x {share:.2f} per rank (more ranks x threads than the {_cpus()} CPUs)"
            host_s += f"; {info['roofline'].describe()}; "
        print(f"[oases] {host_s}{emu.describe()}", flush=True)
    return EmulatorPatch(emu)
