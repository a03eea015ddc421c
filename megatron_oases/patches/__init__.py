"""The catalogue: every patch the package applies to Megatron, and where each is installed (the
mechanism, :class:`Patch` and the process registry, is :mod:`megatron_oases.patching`).

:func:`install` makes one run's :class:`~.runtime.OasesRuntime` from the checked
:class:`~megatron_oases.config.OasesConfig` (after parsing and distributed initialisation, before
any model is built) and installs its patches, in :data:`RUN_PATCHES`' order; each factory takes
the config and what the run's runtime made before it (the tracer, the recorder, the schedule
selection, the tuner), as arguments, and returns None when its flag is not given. The job's other
patches (:data:`JOB_PATCHES`, :data:`MEASUREMENT_PATCHES`, the CPU shims) are made by their own
modules and installed here too (:func:`install_patch`), so that every patch the process can
carry is named in this one file. Each factory checks that the Megatron symbols it replaces exist
and are the ones Megatron calls (:func:`megatron_oases.compat.require_symbol`).
``uninstall_all()`` reverts everything.
"""

from ..patching import REGISTRY, Patch, PatchRegistry
from .runtime import OasesRuntime

#: The run's patches, made from its config by :func:`install`, in install order.
RUN_PATCHES = {
    "torch-norm-sp": "Megatron's torch norms under --sequence-parallel (local spec, no Apex)",
    "norm-recompute-without-te": "--recompute-modules layernorm without Transformer Engine",
    "distopt-resume": "--use-distributed-optimizer resumes without Apex or TE",
    "fsdp2-checkpoint": "--use-torch-fsdp2 saves and resumes (torch_dist, torch_dcp)",
    "emulate-link": "link emulation of every collective (--emulate-link PROFILE, testbed)",
    "oases-trace": "the schedule tracer (--oases-trace PATH)",
    "golden-values": "per-iteration golden values from Megatron's loop (--log-json PATH)",
    "oases-schedule": "the schedule's process-wide replacements (a split schedule or a plan)",
    "oases-autotune": "--oases-schedule auto's trial on train_step (it selects on the schedule)",
}
#: The job's patches, made from Megatron's args by the entry points (training/, megatron_lm/).
JOB_PATCHES = {
    "cpu-shims": "platform/cpu.py: Megatron without CUDA (gloo, no fused kernels); first of all",
    "megatron-lm-model-setup": "megatron_lm/hooks.py: the build hook of a Megatron-LM checkout",
    "console-log-interval": "training/console_log.py: one progress line per --log-interval",
    "dataset-helpers": "training/dataset_helpers.py: Megatron's dataset helpers on any device",
    "safe-checkpoint-save": "training/safe_save.py: --save written whole or not at all",
    "save-dir-lock": "training/save_owner.py: one live run per --save directory",
    "checkpoint-load-errors": "training/checkpoint_check.py: a damaged --load in one line",
    "hybrid-local-norm": "training/hybrid.py: HybridModel's norms without TE, while it is built",
    "megatron-fsdp-cpu": "platform/megatron_fsdp.py: --use-megatron-fsdp on CPU gloo ranks",
    "megatron-fsdp-pipeline": "platform/megatron_fsdp_pipeline.py: it with pipeline stages",
    "megatron-fsdp-checkpoint": "platform/megatron_fsdp_checkpoint.py: its --save/--load",
}
#: Patches of one measured in-process run (``training.pretrain.run_in_process``'s extra ones).
MEASUREMENT_PATCHES = {
    "activation-meter": "training/measure.py: peak live activation bytes per step",
    "inprocess-capture": "training/inprocess.py: each step's outputs for parity checks",
    "step-profiler": "instrument/host_calls.py: a step's aten calls under torch.profiler",
    "step-cprofile": "instrument/host_calls.py: a step's Python calls under cProfile",
}
CATALOGUE = {**RUN_PATCHES, **JOB_PATCHES, **MEASUREMENT_PATCHES}


def make_runtime(config, install=False):
    """One run's :class:`~.runtime.OasesRuntime` for ``config``: what its patches and stages
    share, and its patches, each made (and with ``install``, installed) in the catalogue's order:
    a patch made after another is installed wraps what that one put in place (the tuner's
    ``train_step`` wraps ``--log-json``'s, which wraps ``--oases-trace``'s)."""
    from ..compat import check_megatron_core
    from ..instrument.golden import make_patch as golden_values
    from ..instrument.golden import make_recorder
    from ..instrument.trace_patch import make_patch as oases_trace
    from ..instrument.trace_patch import make_tracer
    from ..layer_degrees.runtime import AttachedPlans
    from ..platform.distopt_resume import make_patch as distopt_resume
    from ..platform.fsdp2_checkpoint import make_patch as fsdp2_checkpoint
    from ..platform.norm_recompute import make_patch as norm_recompute_without_te
    from ..platform.torch_norm import make_patch as torch_norm_sp
    from ..schedule.megatron.patch import joins_stage_ends, make_selection
    from ..schedule.megatron.patch import make_patch as oases_schedule
    from ..testbed.emulator import make_patch as emulate_link
    from ..tuning.runtime import make_patch as oases_autotune
    from ..tuning.runtime import make_tuner

    check_megatron_core()
    if install:
        clash = [name for name in RUN_PATCHES if REGISTRY.get(name) is not None]
        if clash:
            raise RuntimeError(
                f"megatron-oases: patches {clash} are installed by another runtime; "
                "uninstall_all() first (one runtime per job)"
            )
    tracer = make_tracer(config)
    recorder = make_recorder(config)
    selection = make_selection(config, tracer)
    plans = AttachedPlans() if config.plan is not None else None
    tuner = make_tuner(config, selection, recorder, tracer)
    factories = (  # the order of RUN_PATCHES
        lambda: torch_norm_sp(config),
        lambda: norm_recompute_without_te(config),
        lambda: distopt_resume(config),
        lambda: fsdp2_checkpoint(config),
        lambda: emulate_link(config),
        lambda: oases_trace(config, tracer),
        lambda: golden_values(config, recorder),
        lambda: oases_schedule(config, plans),
        lambda: oases_autotune(config, tuner),
    )
    patches = []
    for make in factories:
        patch = make()
        if patch is None:
            continue
        if install:
            REGISTRY.install(patch)
        patches.append(patch)
    assert [p.name for p in patches] == [n for n in RUN_PATCHES if n in {p.name for p in patches}]
    return OasesRuntime(
        config=config,
        selection=selection,
        stage_ends=config.patches_model and joins_stage_ends(config),
        plans=plans,
        tracer=tracer,
        recorder=recorder,
        tuner=tuner,
        patches=tuple(patches),
    )


def install(config):
    """Make the run's runtime with its patches installed (:func:`make_runtime`); returns the
    runtime, which ``prepare_model`` takes. One runtime per job: installing a second one while
    the first's patches are in place is refused (a programming error, not a user's)."""
    return make_runtime(config, install=True)


def install_patch(patch):
    """Install one patch of the catalogue made by its own module (the job's, or ``emulate-link``
    in the profiler's ranks); idempotent by name: the one already installed is returned."""
    if patch.name not in CATALOGUE:
        raise RuntimeError(f"megatron-oases: patch {patch.name!r} is not in the catalogue")
    installed_one = REGISTRY.get(patch.name)
    return installed_one if installed_one is not None else REGISTRY.install(patch)


def is_installed(name):
    return REGISTRY.get(name) is not None


def uninstall(name):
    return REGISTRY.uninstall(name)


def uninstall_all():
    return REGISTRY.uninstall_all()


def installed():
    return REGISTRY.installed()


__all__ = [
    "CATALOGUE",
    "JOB_PATCHES",
    "MEASUREMENT_PATCHES",
    "OasesRuntime",
    "Patch",
    "PatchRegistry",
    "REGISTRY",
    "RUN_PATCHES",
    "install",
    "install_patch",
    "installed",
    "is_installed",
    "make_runtime",
    "uninstall",
    "uninstall_all",
]
