"""The ``oases`` command. Subcommands: train (more land with later features)."""

import argparse
import sys

from .errors import OasesConfigError


def _train(argv):
    from .arguments import build_parser, validate_args
    from .compat import check_megatron_core

    args = build_parser("oases train").parse_args(argv)
    check_megatron_core()
    validate_args(args)
    from . import patches
    from .training.loop import train
    from .training.initialize import destroy

    try:
        train(args, install_patches=patches.install_from_args)
    finally:
        patches.uninstall_all()
        destroy()


COMMANDS = {"train": (_train, "train a GPT model on Megatron-Core (pretrain_gpt.py flags)")}


def main(argv=None):
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(
        prog="oases",
        description="megatron-oases: overlapped tensor-model-parallel training for Megatron-Core",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (_, help_) in COMMANDS.items():
        sub.add_parser(name, help=help_, add_help=False)
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in COMMANDS:
        parser.print_help() if not argv or argv[0] in ("-h", "--help") else parser.parse_args(argv)
        return 0 if not argv or argv[0] in ("-h", "--help") else 2
    try:
        COMMANDS[argv[0]][0](argv[1:])
    except OasesConfigError as exc:
        print(f"oases {argv[0]}: error: {exc}", file=sys.stderr, flush=True)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
