"""The ``oases`` command: one subcommand per concern, each implemented in its own module.

:data:`COMMANDS` names the subcommands and their help, :data:`ENTRIES` their entry functions
(each takes the remaining argv); :func:`command` imports the one that runs, by its name, only
then: ``oases --help`` imports none of them and, for :data:`QUIET_COMMANDS`, Megatron-Core comes
after :mod:`.training.quiet`. A moved module or function is Python's error naming it
(``tests/unit/test_cli_dispatch.py`` imports every entry). Every subcommand ends on Ctrl-C or
SIGTERM with one line and exit status 130 or 143 (:mod:`.interrupts`), never a traceback.

Layering: this module is the top of the package; nothing in ``megatron_oases`` imports it except
``__main__``. ``oases compare`` starts ``python -m megatron_oases train`` as a subprocess, not
through an import.
"""

import argparse
import importlib
import sys

from .errors import exit_status

COMMANDS = {
    "train": "Megatron-LM's pretrain_gpt.py loop with the --oases-* flags; a tiny demo model and "
    "mock data where flags are absent",
    "run": "the same as oases-pretrain-gpt: Megatron-LM's pretrain_gpt.py with the --oases-* flags",
    "compare": "stock Megatron vs Oases variants side by side (Table 3)",
    "calibrate": "host matmul rate and --emulate-link dilation",
    "profile": "profile one layer per TMP degree (measured or --analytic) for the planner",
    "plan": "choose a TMP degree per layer (Oases planner: ILP/DP, memory-aware)",
}

#: Each subcommand's entry function, ``module:function`` in this package.
ENTRIES = {
    "train": "training.pretrain:train_main",
    "run": "training.pretrain:main",
    "compare": "compare.cli:main",
    "calibrate": "testbed.calibrate:main",
    "profile": "profiler.cli:main",
    "plan": "search.plan_cli:main",
}

#: Commands that import Megatron-Core (and would print its fallback warnings).
QUIET_COMMANDS = ("train", "run", "profile", "plan", "compare")
#: Of those, the ones that run no Megatron kernel in this process (``compare`` starts its runs as
#: subprocesses, which filter for themselves): the TE/Apex fallbacks change nothing for them, so
#: their warnings are filtered on a GPU too.
NO_KERNEL_COMMANDS = ("plan", "compare")


def command(name):
    """The entry function of subcommand ``name`` (a key of :data:`COMMANDS`), imported now."""
    module, function = ENTRIES[name].split(":")
    return getattr(importlib.import_module(f"{__package__}.{module}"), function)


#: ``oases calibrate``'s counts: 0 or less was accepted (``--threads 0``) or ended in a traceback.
CALIBRATE_COUNTS = (
    "--threads",
    "--hidden-size",
    "--num-attention-heads",
    "--ffn-hidden-size",
    "--seq-length",
    "--tensor-model-parallel-size",
    "--micro-batch-size",
)


def _check_calibrate(argv):
    """``oases calibrate``'s counts must be >= 1 (a non-integer is argparse's one line)."""
    from .arguments import flag_value
    from .errors import OasesConfigError

    for flag in CALIBRATE_COUNTS:
        value = flag_value(argv, flag)
        if value is not None and value.lstrip("-").isdigit() and int(value) < 1:
            raise OasesConfigError(f"{flag} {value}: must be >= 1")


def main(argv=None):
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(
        prog="oases",
        description="megatron-oases: overlapped tensor-model-parallel training for Megatron-Core",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, help_ in COMMANDS.items():
        sub.add_parser(name, help=help_, add_help=False)
    if not argv or argv[0] in ("-h", "--help"):
        parser.print_help()
        return 0
    if argv[0] not in COMMANDS:
        parser.parse_args(argv[:1])  # prints argparse's "invalid choice" and exits 2
    from . import interrupts
    from .errors import TrainingStopped

    prog = f"oases {argv[0]}"
    with interrupts.handled():  # SIGTERM raises, as Ctrl-C does (not in a torchrun rank)
        try:
            if argv[0] in QUIET_COMMANDS:
                from .training import quiet

                # before Megatron is imported: its fallback warnings, by their text
                quiet.install(cuda=False if argv[0] in NO_KERNEL_COMMANDS else None)
            if argv[0] == "calibrate":
                _check_calibrate(argv[1:])
            rc = command(argv[0])(argv[1:])
        except KeyboardInterrupt as exc:  # Ctrl-C or SIGTERM: one line, exit 130 or 143
            return interrupts.exit_status(exc, prog)
        except Exception as exc:  # ours: one line once per job; anything else: raised again
            return exit_status(exc, prog, stopped=(TrainingStopped,))
    return rc or 0


if __name__ == "__main__":
    sys.exit(main())
