"""Patches applied to Megatron-Core from parsed arguments — after parsing, before the model is built.

``install_from_args(args)`` installs, in this order (each a named, reversible :class:`Patch`):

1. ``emulate-link``: link emulation of every collective (``--emulate-link PROFILE``, testbed).
2. ``oases-trace``: schedule tracer (``--oases-trace PATH``).
3. ``oases-schedule``: the overlapped TMP schedule (``--oases-schedule`` ≠ off).

``uninstall_all()`` reverts everything (stock Megatron-Core behaviour).
"""

from .registry import Patch, PatchRegistry

REGISTRY = PatchRegistry()

# name -> "module:factory"; factory(args) returns a Patch or None (not requested).
PATCH_FACTORIES = {
    "emulate-link": "megatron_oases.testbed.emulator:make_patch",
    "oases-trace": "megatron_oases.schedule.trace:make_patch",
    "oases-schedule": "megatron_oases.schedule.patch:make_patch",
}


def _factory(target):
    import importlib

    module, func = target.split(":")
    try:
        mod = importlib.import_module(module)
    except ModuleNotFoundError as exc:
        if exc.name == module:
            return None
        raise
    return getattr(mod, func)


def install_from_args(args):
    """Install the patches ``args`` asks for; returns their names."""
    from ..compat import check_megatron_core

    check_megatron_core()
    names = []
    for name, target in PATCH_FACTORIES.items():
        factory = _factory(target)
        patch = factory(args) if factory is not None else None
        if patch is not None:
            REGISTRY.install(patch)
            names.append(name)
    return names


def uninstall_all():
    return REGISTRY.uninstall_all()


def installed():
    return REGISTRY.installed()


__all__ = ["Patch", "PatchRegistry", "REGISTRY", "install_from_args", "uninstall_all", "installed"]
