"""``oases compare``: stock Megatron and the Oases variants on one model/batch/parallel config.

Every variant is a separate ``oases train`` run (torchrun subprocess) with the same flags, the same
seed and data, and the identical link emulator (same profile, same dilation ``D``); a few warm-up then
timed iterations each. Unless given, compare adds ``--mock-data``, dropout 0 and ``--num-workers 0``
(no data-loader processes competing for the CPUs). Prints a table like the paper's Table 3 and
writes ``--out DIR``: ``results.json``, ``results.md``, ``throughput.png`` and
``timeline-<variant>.png`` (plus each variant's log, golden values and traces in
``DIR/<variant>/``, and a copy of ``--oases-plan`` as ``DIR/oases-plan.json``). With
``--memory-budget GB[,GB...]`` an untimed pass then meters each variant's peak memory per rank
(:mod:`.memory`), and the report adds, per budget, the fastest stock setting that fits against the
fastest Oases setting that fits (a table and ``memory.png``). Every path in results.json is relative
to DIR, so the directory can move to another machine as a whole. Exit code 1 when a variant failed
or the variants' losses disagree. Ctrl-C (SIGTERM) stops the run in progress and writes the report
of the variants that finished, the others marked interrupted; exit code 130 (143).

``--out DIR`` is one comparison's: a DIR in use by a live run is refused, and so is one that holds
another comparison's results unless ``--force``. This module is the command line only (parser and
messages); the comparison itself is the library call :func:`.session.run_comparison`.
"""

import argparse

from ..arguments import EMULATE_LINK_HELP
from ..errors import OasesConfigError
from .results import reanalyze
from .settings import DEFAULT_OUT
from .variants import DEFAULT_VARIANTS, MEMORY_VARIANTS, VARIANTS


def build_parser():
    p = argparse.ArgumentParser(
        prog="oases compare",
        description=__doc__.split("\n\n")[0].replace("``", "")
        + " All other flags are passed to every "
        "`oases train` run (model, batch, parallelism).",
        epilog="example: oases compare --emulate-link rtx3090-pcie --nproc 2 -- "
        "--tensor-model-parallel-size 2 --num-layers 2 --hidden-size 1024 "
        "--num-attention-heads 16 --seq-length 512 --micro-batch-size 2 --mock-data",
    )
    p.add_argument(
        "--variants",
        default=None,
        help=f"comma-separated, from {', '.join(VARIANTS)} (default: {','.join(DEFAULT_VARIANTS)}; "
        f"with --memory-budget: {','.join(MEMORY_VARIANTS)})",
    )
    p.add_argument(
        "--memory-budget",
        default=None,
        metavar="GB[,GB...]",
        help="also meter each variant's peak memory per rank (an untimed pass after the timed "
        "runs) and report, per budget, the fastest stock setting that fits against the fastest "
        "Oases setting that fits (GB = 1e9 bytes, e.g. 0.05,0.1,0.2 for tiny CPU models)",
    )
    p.add_argument(
        "--nproc",
        type=int,
        default=None,
        help="ranks (torchrun --nproc_per_node; default: TP x PP x CP of the flags, at least 2)",
    )
    p.add_argument(
        "--one-rank",
        action="store_true",
        help="run only rank 0 of the --nproc ranks, in one process, the others virtual "
        "(Megatron's --fake-process-group): every collective takes its emulated time but reduces "
        "nothing, so the runs are timing-only (no loss check); needs --emulate-link and PP=1. "
        "Emulates TMP=4/8 on a host with fewer CPUs than ranks",
    )
    p.add_argument(
        "--emulate-link",
        default=None,
        metavar="PROFILE",
        help=EMULATE_LINK_HELP,
    )
    p.add_argument(
        "--oases-plan",
        default=None,
        metavar="PATH",
        help="per-layer TMP plan (from `oases plan`) for the oases+planner variant only",
    )
    p.add_argument("--warmup", type=int, default=2, help="untimed iterations per variant")
    p.add_argument("--iters", type=int, default=3, help="timed iterations per variant")
    p.add_argument("--out", default=DEFAULT_OUT, help="output directory")
    p.add_argument(
        "--force",
        action="store_true",
        help="write into an --out directory that already holds another comparison's results "
        "(or an unfinished run's logs), over them; a directory in use by a live run is refused "
        "even so",
    )
    p.add_argument(
        "--loss-rtol",
        type=float,
        default=None,
        help="max relative lm-loss difference to stock (default 1e-3 with dropout 0, "
        "5e-2 with dropout)",
    )
    p.add_argument(
        "--threads-per-rank",
        type=int,
        default=None,
        help="OMP/torch threads per rank (default: the CPUs this process may use ÷ nproc)",
    )
    p.add_argument(
        "--repeats",
        type=int,
        default=1,
        help="run the variant list N times, rotating the order; each variant reports "
        "its fastest run (noisy shared hosts)",
    )
    p.add_argument(
        "--no-host-pass",
        action="store_true",
        help="skip the untimed pass that counts each variant's aten calls per iteration and per "
        "layer (the host floor: results.json 'host')",
    )
    p.add_argument(
        "--host-pass",
        action="store_true",
        help="with --reanalyze DIR: run the host pass now for a run that has none (counts do not "
        "depend on timing)",
    )
    p.add_argument("--timeout", type=float, default=3600, help="seconds per variant run")
    p.add_argument(
        "--reanalyze",
        default=None,
        metavar="DIR",
        help="recompute metrics, tables and charts of a finished (or interrupted) run in DIR; "
        "runs nothing (with --memory-budget: compare at these budgets instead, from the peaks "
        "measured in DIR)",
    )
    return p


def main(argv):
    """``oases compare``: the flags as one :class:`.settings.CompareSettings`, run by
    :func:`.session.run_comparison` (or ``--reanalyze DIR``); returns the exit code."""
    argv = list(argv)
    own, train_argv = build_parser().parse_known_args(argv)
    if own.reanalyze:
        return _reanalyze(own)
    if own.host_pass:
        raise OasesConfigError("--host-pass goes with --reanalyze DIR (a new run counts anyway)")
    from .session import CompareSettings, run_comparison

    return run_comparison(CompareSettings.from_args(own, train_argv, argv))


def _reanalyze(own):
    """``--reanalyze DIR``: the report of a finished (or interrupted) run anew; budgets may be
    chosen anew, as the measured peaks do not depend on them."""
    budgets = None
    if own.memory_budget is not None:
        from .memory import parse_budgets

        budgets = parse_budgets(own.memory_budget)
    recount = None
    if own.host_pass:
        from .session import recount_host as recount
    return reanalyze(own.reanalyze, budgets, recount=recount)
