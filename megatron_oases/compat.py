"""Megatron-Core versions: the supported range and every version-dependent check in one place.

Supported: megatron-core 0.17–0.19.x on Python ≥ 3.12 (0.17 raised ``requires-python`` to 3.12 and
is the first wheel that ships ``megatron.training``, i.e. Megatron-LM's own ``pretrain()`` loop,
which is our only training driver; 0.16 and older have no such loop and are not supported).

The patches replace Megatron symbols by name. :func:`require_symbol` is how each of them checks, at
install time, that the symbol still exists and is the one Megatron calls, so that a Megatron
release which moves or renames it fails with one line instead of silently doing nothing.
"""

import inspect
from importlib import metadata

from .errors import OasesConfigError

#: (lowest, first unsupported) major.minor.
SUPPORTED = ((0, 17), (0, 20))
SUPPORTED_SPEC = ">=0.17,<0.20"


def megatron_core_version():
    try:
        return metadata.version("megatron-core")
    except metadata.PackageNotFoundError:
        return None


def version_tuple(version=None):
    version = version if version is not None else megatron_core_version()
    try:
        return tuple(int(p) for p in version.split(".")[:2])
    except (AttributeError, ValueError) as exc:
        raise OasesConfigError(f"cannot parse megatron-core version {version!r}") from exc


def check_megatron_core(version=None):
    """Raise :class:`OasesConfigError` unless megatron-core is installed and supported."""
    version = version if version is not None else megatron_core_version()
    if version is None:
        raise OasesConfigError(
            f"megatron-core is not installed; pip install 'megatron-core{SUPPORTED_SPEC}' "
            "(Python >= 3.12)"
        )
    low, high = SUPPORTED
    if not (low <= version_tuple(version) < high):
        raise OasesConfigError(
            f"megatron-core {version} is not supported (supported: {SUPPORTED_SPEC}, the releases "
            f"that ship Megatron-LM's training loop); pip install 'megatron-core{SUPPORTED_SPEC}' "
            "on Python >= 3.12"
        )
    return version


def require_symbol(owner, name, called_by=(), parameters=()):
    """Return ``owner.name`` after checking it is what Megatron calls.

    ``called_by``: functions whose source must mention ``name`` (the replaced symbol is still what
    they call). ``parameters``: names the symbol's signature must have (our replacement forwards
    them). Raises :class:`OasesConfigError` naming the symbol and the supported range.
    """
    where = f"{getattr(owner, '__module__', '')}.{getattr(owner, '__name__', owner)}.{name}"
    where = where.lstrip(".")

    def fail(why):
        raise OasesConfigError(
            f"this megatron-core ({megatron_core_version()}) {why}: {where}; megatron-oases "
            f"supports megatron-core {SUPPORTED_SPEC}"
        )

    value = getattr(owner, name, None)
    if value is None:
        fail("has no")
    for caller in called_by:
        try:
            source = inspect.getsource(getattr(caller, "__wrapped__", caller))
        except (OSError, TypeError):
            continue
        if name not in source:
            fail(f"no longer calls it from {caller.__qualname__}")
    if parameters:
        target = getattr(value, "__wrapped__", value)
        present = set(inspect.signature(target).parameters)
        missing = [p for p in parameters if p not in present]
        if missing:
            fail(f"changed the signature (missing {', '.join(missing)})")
    return value
