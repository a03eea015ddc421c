"""Link emulation (``--emulate-link PROFILE``): a target cluster's communication/computation balance on CPU.

This is an **emulation**, not a simulation and not a measurement of real hardware:

* Compute runs for real on the host CPU, which is about ``D`` times slower than the target GPU, where
  the *dilation* ``D = target sustained GPU FLOP/s ÷ host matmul FLOP/s`` (host rate measured once and
  cached, :mod:`.calibrate`; GPU rate from the profile, :mod:`megatron_oases.resources`).
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

Environment overrides (used by ``oases compare`` to give every variant the identical emulator):
``OASES_EMULATE_DILATION`` (D itself) or ``OASES_HOST_FLOPS`` (the host rate; D = profile ÷ it).
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


def make_patch(args, built=None):
    """Factory for :func:`megatron_oases.patches.install_patches`: a patch iff ``--emulate-link``."""
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
