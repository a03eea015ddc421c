"""The ``oases`` command: one subcommand per concern, each implemented in its own module.

Subcommands are registered in :data:`COMMANDS` as ``name: ("module:function", help)``; the module is
imported only when its subcommand runs. Each function takes the remaining argv.
"""

import argparse
import importlib
import sys

from .errors import exit_status

COMMANDS = {
    "train": (
        "megatron_oases.training.pretrain:train_main",
        "Megatron-LM's pretrain_gpt.py loop with the --oases-* flags; a tiny demo model and mock "
        "data where flags are absent",
    ),
    "run": (
        "megatron_oases.training.pretrain:main",
        "the same as oases-pretrain-gpt: Megatron-LM's pretrain_gpt.py with the --oases-* flags",
    ),
    "compare": (
        "megatron_oases.compare.cli:main",
        "stock Megatron vs Oases variants side by side (Table 3)",
    ),
    "calibrate": (
        "megatron_oases.testbed.calibrate:main",
        "host matmul rate and --emulate-link dilation",
    ),
    "profile": (
        "megatron_oases.profiler.cli:main",
        "profile one layer per TMP degree (measured or --analytic) for the planner",
    ),
    "plan": (
        "megatron_oases.planner.cli:main",
        "choose a TMP degree per layer (Oases planner: ILP/DP, memory-aware)",
    ),
}

#: Commands that import Megatron-Core (and would print its fallback warnings).
QUIET_COMMANDS = ("train", "run", "profile")


def _resolve(target):
    module, func = target.split(":")
    return getattr(importlib.import_module(module), func)


def main(argv=None):
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(
        prog="oases",
        description="megatron-oases: overlapped tensor-model-parallel training for Megatron-Core",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (_, help_) in COMMANDS.items():
        sub.add_parser(name, help=help_, add_help=False)
    if not argv or argv[0] in ("-h", "--help"):
        parser.print_help()
        return 0
    if argv[0] not in COMMANDS:
        parser.parse_args(argv[:1])  # prints argparse's "invalid choice" and exits 2
    if argv[0] in QUIET_COMMANDS:
        from .training import quiet

        quiet.install()  # before Megatron is imported: its CPU fallback warnings, by their text
    from .errors import TrainingStopped

    try:
        rc = _resolve(COMMANDS[argv[0]][0])(argv[1:])
    except Exception as exc:  # ours: one line once per job; anything else: raised again
        return exit_status(exc, f"oases {argv[0]}", stopped=(TrainingStopped,))
    return rc or 0


if __name__ == "__main__":
    sys.exit(main())
