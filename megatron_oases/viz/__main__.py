"""``python -m megatron_oases.viz TRACE [TRACE...] -o timeline.png``: metrics and a timeline PNG.

``--ops`` prints the compute per (pass, layer), wall and CPU time, net of blocked communication;
``--against NAME=TRACES`` (repeatable) adds other runs to that table, matched op for op (e.g. stock
Megatron against the ``oases`` schedule of one ``oases compare`` directory).
"""

import argparse
import json
import sys

from .analysis import load_traces, run_metrics, trace_files


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
    if args.out:  # before reading the traces: a chart must not be lost to a path it cannot use
        from ..errors import OasesConfigError
        from ..outputs import check_output_file

        try:
            check_output_file(args.out, flag="-o/--out", example="timeline.png")
        except OasesConfigError as exc:
            print(f"python -m megatron_oases.viz: error: {exc}", file=sys.stderr)
            return 2
    comm_model = None
    if args.emulated:
        from .analysis import emulated_comm_model

        prof, _, d = args.emulated.partition(":")
        comm_model = emulated_comm_model({"profile": prof, "dilation": float(d)})
    files = [f for p in args.traces for f in trace_files(p)]
    traces = load_traces(files)
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
