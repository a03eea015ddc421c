"""``oases train``: parse Megatron-LM flags, check the environment, install patches, train."""

from ..arguments import build_parser, validate_args
from ..compat import check_megatron_core


def main(argv):
    args = build_parser("oases train").parse_args(argv)
    check_megatron_core()
    validate_args(args)
    from .. import patches
    from .initialize import destroy
    from .loop import train

    try:
        train(args, install_patches=patches.install_from_args)
    finally:
        patches.uninstall_all()
        destroy()
    return 0
