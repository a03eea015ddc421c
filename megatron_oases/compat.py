"""Megatron-Core version gate: the patches read 0.16 internals, so other versions fail clearly."""

from importlib import metadata

from .errors import OasesConfigError

TESTED_RANGE = (">=0.16", "<0.17")
_MIN, _MAX = (0, 16), (0, 17)


def megatron_core_version():
    try:
        return metadata.version("megatron-core")
    except metadata.PackageNotFoundError:
        return None


def check_megatron_core(version=None):
    """Raise :class:`OasesConfigError` unless megatron-core is installed and in the tested range."""
    version = version if version is not None else megatron_core_version()
    if version is None:
        raise OasesConfigError(
            "megatron-core is not installed; pip install 'megatron-core>=0.16,<0.17'"
        )
    try:
        major_minor = tuple(int(p) for p in version.split(".")[:2])
    except ValueError as exc:
        raise OasesConfigError(f"cannot parse megatron-core version {version!r}") from exc
    if not (_MIN <= major_minor < _MAX):
        raise OasesConfigError(
            f"megatron-core {version} is outside the tested range {','.join(TESTED_RANGE)}; "
            f"pip install 'megatron-core{','.join(TESTED_RANGE)}'"
        )
    return version
