"""Config helpers for ``launch_scripts/`` (bash reads no YAML).

python -m megatron_oases.megatron_lm flags MODEL [--section model ...]   # shell-quoted flags
python -m megatron_oases.megatron_lm get FILE_OR_MODEL KEY.PATH [DEFAULT]
python -m megatron_oases.megatron_lm matrix FILE [NAME]                  # TSV, one run a line
python -m megatron_oases.megatron_lm summary RUNS_TSV [--baseline VARIANT]
python -m megatron_oases.megatron_lm defaults [--cpu]                     # shell-quoted flags
"""

import argparse
import shlex
import sys

from ..errors import OasesConfigError
from . import configs


def _build_parser():
    parser = argparse.ArgumentParser(prog="python -m megatron_oases.megatron_lm")
    sub = parser.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("flags", help="a model config's Megatron-LM flags, shell-quoted")
    p.add_argument("model", help="packaged model config name (tiny-cpu, ...) or a path")
    p.add_argument("--section", action="append", choices=configs.FLAG_SECTIONS)
    p = sub.add_parser("get", help="one value of a YAML file (model name or path)")
    p.add_argument("file")
    p.add_argument("key", help="dotted path, e.g. parallel.tensor-model-parallel-size")
    p.add_argument("default", nargs="?")
    p = sub.add_parser("matrix", help="expand a comparison matrix into TSV run lines")
    p.add_argument("file")
    p.add_argument("name", nargs="?", help="matrix name (default: the file's `default`)")
    p.add_argument("--field", help="print this field of the matrix instead (model, baseline, ...)")
    p.add_argument("--default", dest="field_default", help="value when --field is absent")
    p = sub.add_parser("summary", help="markdown summary table of a comparison's runs")
    p.add_argument("runs", help="TSV: name tp pp schedule status json")
    p.add_argument("--baseline", default=None, help="variant the speedup is relative to")
    p = sub.add_parser(
        "defaults",
        help="the flags oases-pretrain-gpt adds when absent, which a patched Megatron-LM "
        "pretrain_gpt.py needs spelled out (LOOP_DEFAULTS; --cpu: CPU_DEFAULTS too)",
    )
    p.add_argument("--cpu", action="store_true", help="also the flags a run without CUDA needs")
    return parser


def _defaults(cpu):
    from ..arguments import CPU_DEFAULTS, LOOP_DEFAULTS

    groups = (LOOP_DEFAULTS, CPU_DEFAULTS) if cpu else (LOOP_DEFAULTS,)
    return [
        tok
        for g in groups
        for flag, value in g
        for tok in ([flag] if value is None else [flag, value])
    ]


def main(argv=None):
    args = _build_parser().parse_args(argv)
    try:
        if args.cmd == "flags":
            cfg = configs.load_model_config(args.model)
            print(shlex.join(configs.model_flags(cfg, args.section or configs.FLAG_SECTIONS)))
        elif args.cmd == "get":
            try:
                path = configs.model_config_path(args.file)
            except OasesConfigError:
                path = args.file
            value = configs.get_path(configs._load_yaml(path), args.key, args.default)
            if value is None:
                raise OasesConfigError(f"{path}: no key {args.key!r} and no default given")
            print("off" if value is False else value)
        elif args.cmd == "matrix":
            matrix = configs.load_matrix(args.file, args.name or None)
            if args.field:
                value = matrix.get(args.field, args.field_default)
                if value is None:
                    raise OasesConfigError(
                        f"{args.file}: matrix {matrix['name']!r} has no {args.field!r}"
                    )
                print(value)
            else:
                print(configs.matrix_tsv(matrix))
        elif args.cmd == "defaults":
            print(shlex.join(_defaults(args.cpu)))
        elif args.cmd == "summary":
            rows = configs.read_runs_file(args.runs)
            print(configs.summary_table(rows, args.baseline))
    except OasesConfigError as exc:
        print(f"megatron_oases.megatron_lm {args.cmd}: error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
