"""The catalogue of patches applied to Megatron from parsed arguments — after parsing, before the
model is built (the mechanism, :class:`Patch` and the process registry, is :mod:`megatron_oases.patching`).

``install_patches(config)`` installs, in this order (each a named, reversible :class:`Patch`;
every factory takes the checked :class:`~megatron_oases.config.OasesConfig`, ``config``, and
nothing of Megatron's ``args``, and returns None when its flag is not given):

0. ``torch-norm-sp``: Megatron's torch norms under ``--sequence-parallel`` (local spec, no apex);
   ``norm-recompute-without-te``: ``--recompute-modules layernorm`` without Transformer Engine;
   ``distopt-resume``: ``--use-distributed-optimizer`` resumes without Apex or TE, in fp32.
1. ``emulate-link``: link emulation of every collective (``--emulate-link PROFILE``, testbed).
2. ``oases-trace``: schedule tracer (``--oases-trace PATH``).
3. ``golden-values``: per-iteration golden values from Megatron's loop (``--log-json PATH``).
4. ``oases-schedule``: the overlapped TMP schedule (``--oases-schedule`` ≠ off, or a plan).
5. ``oases-autotune``: ``--oases-schedule auto``'s trial on ``train_step`` (it selects on 4).

Each factory checks that the Megatron symbols it replaces exist and are the ones Megatron calls
(:func:`megatron_oases.compat.require_symbol`). ``uninstall_all()`` reverts everything.
"""

from ..patching import REGISTRY, Patch, PatchRegistry


def factories():
    """(name, factory(config, built)) in install order; imported here, not named by strings, so a
    moved module fails at import instead of turning its flag into a silent no-op."""
    from ..instrument.golden import make_patch as golden_values
    from ..instrument.trace_patch import make_patch as oases_trace
    from ..platform.distopt_resume import make_patch as distopt_resume
    from ..platform.norm_recompute import make_patch as norm_recompute_without_te
    from ..platform.torch_norm import make_patch as torch_norm_sp
    from ..schedule.megatron.patch import make_patch as oases_schedule
    from ..testbed.emulator import make_patch as emulate_link
    from ..tuning.runtime import make_patch as oases_autotune

    return (
        ("torch-norm-sp", torch_norm_sp),
        ("norm-recompute-without-te", norm_recompute_without_te),
        ("distopt-resume", distopt_resume),
        ("emulate-link", emulate_link),
        ("oases-trace", oases_trace),
        ("golden-values", golden_values),
        ("oases-schedule", oases_schedule),
        ("oases-autotune", oases_autotune),
    )


def install_patches(config):
    """Install the patches ``config`` (the checked Oases settings) asks for; idempotent. Returns
    the names installed now."""
    from ..compat import check_megatron_core

    check_megatron_core()
    names, built = [], {}
    for name, factory in factories():
        if REGISTRY.get(name) is not None:
            built[name] = REGISTRY.get(name)
            continue
        patch = factory(config, built)  # a factory may use what the ones before it built
        if patch is not None:
            REGISTRY.install(patch)
            built[name] = patch
            names.append(name)
    return names


def uninstall_all():
    return REGISTRY.uninstall_all()


def installed():
    return REGISTRY.installed()


__all__ = [
    "Patch",
    "PatchRegistry",
    "REGISTRY",
    "factories",
    "install_patches",
    "uninstall_all",
    "installed",
]
