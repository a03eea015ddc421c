"""Registry of named, reversible patches on Megatron-Core (installed from parsed args, never at import)."""


def install_from_args(args):
    """Install what ``args`` asks for (nothing for --oases-schedule off)."""
    return []


def uninstall_all():
    return []
