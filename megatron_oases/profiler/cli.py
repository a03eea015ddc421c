"""``oases profile``: per-block compute, communication and memory per TMP degree for the planner.

    oases profile --model X.yaml --out profile.json                             # measured (gloo)
    oases profile --model X.yaml --emulate-link rtx3090-pcie --out profile.json  # measured, emulated
    oases profile --model X.yaml --analytic --cluster rtx3090-nvlink --out profile.json
    oases profile ... --sequence-parallel   # also SP all-gather/reduce-scatter and SP memory
    oases profile --model X.yaml --emulate-link rtx3090-pcie --one-rank --out p.json  # rank 0 only

Measured profiles time one Megatron TransformerLayer per degree on real process groups (spawning
``--nproc`` gloo ranks unless already launched by torchrun) and are cached by hardware fingerprint
and shape hash; analytic ones come from FLOP counts and a cluster profile.
"""

import argparse

from ..errors import OasesConfigError
from ..outputs import check_output_dir, check_output_file, make_parent
from ..resources import available_clusters, available_models


def build_parser():
    p = argparse.ArgumentParser(
        prog="oases profile",
        description="Profile one transformer layer per candidate TMP degree for `oases plan`.",
    )
    p.add_argument(
        "--model",
        required=True,
        metavar="PATH[:NAME]",
        help="model YAML (Megatron-LM argument names); PATH:NAME picks from a 'models:' map; or a "
        f"packaged model config ({', '.join(available_models())})",
    )
    p.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a model setting, e.g. --set num_layers=48",
    )
    p.add_argument(
        "--tensor-model-parallel-size",
        type=int,
        default=None,
        help="TMP domain T (default: the model file's)",
    )
    p.add_argument("--data-parallel-size", type=int, default=None)
    p.add_argument(
        "--micro-batch-size",
        type=int,
        default=None,
        help="samples per TMP domain per micro-batch whose sub-batches are measured",
    )
    p.add_argument("--degrees", default=None, help="candidate degrees (default: powers of two ≤ T)")
    p.add_argument(
        "--sequence-parallel",
        action="store_true",
        help="Megatron's --sequence-parallel (also honoured from the model file): add the TMP "
        "groups' all-gather/reduce-scatter costs and SP activation memory, for `oases plan "
        "--sequence-parallel`",
    )
    p.add_argument("--analytic", action="store_true", help="from FLOP counts and --cluster")
    p.add_argument(
        "--cluster",
        default=None,
        metavar="PROFILE",
        help="cluster profile for --analytic: a packaged one "
        f"({', '.join(available_clusters())}) or a YAML path",
    )
    p.add_argument(
        "--emulate-link",
        default=None,
        metavar="PROFILE",
        help="measured: emulate a cluster's links on gloo (testbed)",
    )
    p.add_argument(
        "--nproc",
        type=int,
        default=None,
        help="measured: ranks to spawn (default T); ignored under torchrun",
    )
    p.add_argument(
        "--one-rank",
        action="store_true",
        help="measured: run only rank 0, the other --nproc ranks virtual (fake process group); "
        "collectives take their --emulate-link time (needed) but reduce nothing. For TMP degrees "
        "beyond this host's CPUs",
    )
    p.add_argument("--repeats", type=int, default=3, help="measured: timed repetitions (median)")
    p.add_argument(
        "--cache-dir",
        default=None,
        help="measured-profile cache (default $OASES_CACHE_DIR or ~/.cache/megatron-oases)",
    )
    p.add_argument(
        "--no-cache", action="store_true", help="measure even if a cached profile matches"
    )
    p.add_argument(
        "--timeout",
        type=float,
        default=3600,
        help="measured: seconds before the spawned ranks are killed",
    )
    p.add_argument("--out", required=True, help="profile JSON to write")
    return p


def main(argv):
    args = build_parser().parse_args(argv)
    # before any profiling: a measured profile must not be lost to a path it cannot be written to
    check_output_file(args.out, example="profile.json")
    if args.cache_dir and not args.analytic:
        check_output_dir(args.cache_dir, flag="--cache-dir")
    from ..formats.plan import parse_degrees
    from ..formats.profile import save_profile
    from .model_config import model_args, read_model_file, set_overrides

    flat = read_model_file(args.model)
    flat.update(set_overrides(args.set))
    if args.tensor_model_parallel_size:
        flat["tensor_model_parallel_size"] = args.tensor_model_parallel_size
    if args.data_parallel_size:
        flat["data_parallel_size"] = args.data_parallel_size
        flat.pop("world_size", None)
    if args.micro_batch_size:
        flat["micro_batch_size"] = args.micro_batch_size
    if args.sequence_parallel:
        flat["sequence_parallel"] = True
    margs = model_args(flat)
    degrees = parse_degrees(args.degrees, margs.tensor_model_parallel_size)

    if args.analytic:
        if not args.cluster:
            raise OasesConfigError(
                f"--analytic needs --cluster PROFILE ({', '.join(available_clusters())} or a "
                "YAML path)"
            )
        if args.emulate_link or args.one_rank:
            raise OasesConfigError(
                "--emulate-link and --one-rank apply to measured profiles; drop --analytic"
            )
        from .analytic import analytic_profile

        data = analytic_profile(margs, args.cluster, degrees=degrees)
    else:
        if args.cluster:
            raise OasesConfigError(
                "--cluster needs --analytic (measured profiles use this machine)"
            )
        from .measured import measured_profile

        data = measured_profile(
            margs,
            degrees=degrees,
            nproc=args.nproc,
            emulate_link=args.emulate_link,
            repeats=args.repeats,
            cache_dir=args.cache_dir,
            use_cache=not args.no_cache,
            timeout=args.timeout,
            one_rank=args.one_rank,
        )
    if data is None:  # a non-zero rank under torchrun: rank 0 writes the file
        return 0
    make_parent(args.out)
    save_profile(data, args.out)
    src = "cache" if data.get("from_cache") else data["kind"]
    print(
        f"wrote {args.out}: {data['model'].get('name')} ({src}), T={data['tensor_model_parallel_size']},"
        f" degrees {data['degrees']}"
    )
    return 0
