"""``python -m megatron_oases.viz TRACE [TRACE...] -o timeline.png``: metrics and a timeline PNG.

``--ops`` prints the compute per (pass, layer), wall and CPU time, net of blocked communication;
``--against NAME=TRACES`` (repeatable) adds other runs to that table, matched op for op (e.g. stock
Megatron against the ``oases`` schedule of one ``oases compare`` directory).
"""

import argparse
import json
import sys

from .analysis import load_traces, run_metrics, trace_files


def _inputs(args):
    """The emulated comm model and the traces of ``args``; an unusable ``--out``, ``--emulated``
    or trace file raises :class:`OasesConfigError` naming it, before anything is drawn."""
    from ..errors import OasesConfigError

    if args.out:  # before reading the traces: a chart must not be lost to a path it cannot use
        from ..outputs import check_output_file

        check_output_file(args.out, flag="-o/--out", example="timeline.png")
    comm_model = None
    if args.emulated:
        from .analysis import emulated_comm_model

        prof, _, d = args.emulated.partition(":")
        try:
            dilation = float(d)
        except ValueError:
            dilation = 0.0
        if not prof or not dilation > 0:
            raise OasesConfigError(
                f"--emulated {args.emulated}: expected PROFILE:D, a cluster profile and the "
                "run's dilation D > 0 (oases compare prints both), e.g. rtx3090-pcie:12.5"
            )
        comm_model = emulated_comm_model({"profile": prof, "dilation": dilation})
    files = [f for p in args.traces for f in trace_files(p)]
    for f in files:
        try:
            load_traces([f])
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
            why = exc.strerror if isinstance(exc, OSError) and exc.strerror else exc
            raise OasesConfigError(
                f"{f} is not a trace written by --oases-trace ({type(exc).__name__}: "
                f"{str(why).splitlines()[0] if str(why) else ''}); pass the run's trace files"
            ) from None
    return comm_model, load_traces(files)


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m megatron_oases.viz", description=__doc__)
    parser.add_argument(
        "traces", nargs="+", help="trace files, a directory, a glob or a {rank} pattern"
    )
    parser.add_argument("-o", "--out", default=None, help="timeline PNG to write")
    parser.add_argument("--title", default=None)
    parser.add_argument(
        "--emulated",
        default=None,
        metavar="PROFILE:D",
        help="the run's --emulate-link profile and dilation: comm intervals end at "
        "the emulator's modelled completion instead of when they were waited on",
    )
    parser.add_argument(
        "--ops",
        action="store_true",
        help="print compute wall and CPU time per (pass, layer), net of blocked communication",
    )
    parser.add_argument(
        "--name", default="run", help="with --ops: column group name of TRACES (default: run)"
    )
    parser.add_argument(
        "--against",
        action="append",
        default=[],
        metavar="NAME=TRACES",
        help="with --ops: another run's traces (file, directory, glob or {rank} pattern) as a "
        "column group NAME",
    )
    args = parser.parse_args(argv)
    from ..errors import OasesConfigError

    try:
        comm_model, traces = _inputs(args)
    except OasesConfigError as exc:  # bad input: one line, exit 2 (never a traceback)
        print(f"python -m megatron_oases.viz: error: {exc}", file=sys.stderr)
        return 2
    if not traces:
        print(f"no trace files found in {args.traces}", file=sys.stderr)
        return 2
    m = run_metrics(traces, comm_model)
    print(json.dumps({k: v for k, v in m.items() if k != "ranks"}, indent=1))
    if args.ops:
        from .analysis import format_ops

        runs = {args.name: traces}
        for spec in args.against:
            name, _, pattern = spec.rpartition("=")
            other = load_traces(trace_files(pattern))
            if not other:
                print(f"no trace files found in {pattern}", file=sys.stderr)
                return 2
            runs[name or pattern] = other
        print(format_ops(runs))
    if args.out:
        from .timeline import plot_timeline

        plot_timeline(traces, args.out, title=args.title, comm_model=comm_model)
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
