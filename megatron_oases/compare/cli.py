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
or the variants' losses disagree.
"""

import argparse
import dataclasses
import os
import shlex
import shutil
import time

from ..arguments import EMULATE_LINK_HELP
from ..errors import OasesConfigError
from ..outputs import check_output_dir
from .results import finalize, reanalyze
from .variants import (
    DEFAULT_VARIANTS,
    MEMORY_VARIANTS,
    RESERVED,
    VARIANTS,
    estimate_memory_gb,
    parse_variants,
)

PLAN_COPY = (
    "oases-plan.json"  # --oases-plan, kept beside results.json: the report is self-contained
)


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
    p.add_argument("--out", default="oases-compare", help="output directory")
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
        help="recompute metrics, tables and charts of a finished run in DIR; runs nothing (with "
        "--memory-budget: compare at these budgets instead, from the peaks measured in DIR)",
    )
    return p


def _has_flag(argv, flag):
    return any(a == flag or a.startswith(flag + "=") for a in argv)


def _nproc(nproc, train_argv):
    """``--nproc``, or when not given the model-parallel size of the flags (TP x PP x CP, at
    least 2): a world size the user never gave must not be the one Megatron's error names."""
    from ..arguments import flag_value

    sizes = {}
    for flag in (
        "--tensor-model-parallel-size",
        "--pipeline-model-parallel-size",
        "--context-parallel-size",
    ):
        value = flag_value(train_argv, flag) or "1"
        try:
            sizes[flag] = int(value)
        except ValueError:
            raise OasesConfigError(f"{flag} {value}: not an integer") from None
    model_parallel = 1
    for size in sizes.values():
        model_parallel *= max(1, size)
    if nproc is None:
        return max(2, model_parallel)
    if nproc >= 1 and nproc % model_parallel:
        raise OasesConfigError(
            f"--nproc {nproc} is not a multiple of the model-parallel size {model_parallel} "
            "(tensor x pipeline x context parallel); use --nproc "
            f"{model_parallel * max(1, nproc // model_parallel)} or leave --nproc out"
        )
    return nproc


def _validate(variant, train_argv, nproc):
    """Megatron's parse + validate (+ the Oases rules) of one variant's ``oases train`` flags for
    ``nproc`` ranks, before anything is launched."""
    from ..profiler.model_config import parse_offline

    try:
        return parse_offline(list(train_argv) + list(variant.flags), world_size=nproc, demo=True)
    except OasesConfigError as exc:
        raise OasesConfigError(f"variant {variant.name}: {exc}") from exc


def main(argv):
    argv = list(argv)
    own, train_argv = build_parser().parse_known_args(argv)
    if own.reanalyze:
        return _reanalyze(own)
    # Every check before any expensive work: a bad flag costs one line, not a run.
    if own.host_pass:
        raise OasesConfigError("--host-pass goes with --reanalyze DIR (a new run counts anyway)")
    check_output_dir(own.out)  # before any run: a finished comparison must have somewhere to go
    train_argv = _shared_train_flags(train_argv)
    own.nproc = _nproc(own.nproc, train_argv)
    _check_run_flags(own)
    budgets = _budgets(own.memory_budget)
    variants, plan = _chosen_variants(own.variants, own.oases_plan, budgets)
    profile = _profile(own.emulate_link)
    train_argv = _with_compare_defaults(train_argv)
    base, parsed = _validate_variants(variants, train_argv, own.nproc, own.one_rank, plan)
    rtol = _loss_rtol(own.loss_rtol, parsed)

    from ..testbed.calibrate import host_cpus

    threads = threads_per_rank(own.threads_per_rank, own.nproc, host_cpus())
    env = {"OMP_NUM_THREADS": str(threads)}
    out = os.path.abspath(own.out)
    os.makedirs(out, exist_ok=True)
    plan = _keep_plan(plan, out)
    variants = _resolve(variants, base, plan)
    processes = 1 if own.one_rank else own.nproc  # processes on this host
    emulation, comm_model = _emulation(profile, threads, env, processes, base)
    tokens = base.global_batch_size * base.seq_length
    model = _model_line(base, own.nproc, own.one_rank)
    _announce(_progress, model, variants, own, out, profile, emulation, threads)

    skipped = _skip_unfit(variants, parsed, profile, _progress)
    to_run = [v for v in variants if v.name not in skipped]
    runs = _run_all(to_run, train_argv, out, own, env, tokens, comm_model, _progress)
    results = _best_runs(variants, skipped, runs, own.repeats)
    _host_pass(variants, results, train_argv, parsed, own, out, base, _progress)
    _memory_pass(budgets, variants, results, train_argv, parsed, own, out, _progress)
    config = {
        "model": model,
        "train_argv": train_argv,
        "nproc": own.nproc,
        "one_rank": own.one_rank,
        "repeats": own.repeats,
        "threads_per_rank": threads,
        "warmup": own.warmup,
        "iters": own.iters,
        "tokens_per_iteration": tokens,
        "oases_plan": plan,
        "memory_budget_gb": budgets,
    }
    return finalize(_report(argv, config, emulation, rtol, results), out)


def _reanalyze(own):
    """``--reanalyze DIR``: the report of a finished run anew; budgets may be chosen anew, as the
    measured peaks do not depend on them."""
    recount = _recount_host if own.host_pass else None
    return reanalyze(own.reanalyze, _budgets(own.memory_budget), recount=recount)


def _budgets(spec):
    """``--memory-budget`` in GB (sorted), or None without it."""
    if spec is None:
        return None
    from .memory import parse_budgets

    return parse_budgets(spec)


def _shared_train_flags(train_argv):
    """The flags after ``--``, refused where they hold one compare sets itself."""
    if train_argv and train_argv[0] == "--":
        train_argv = train_argv[1:]
    for flag in RESERVED:
        if _has_flag(train_argv, flag):
            if flag == "--oases-plan":
                raise OasesConfigError(
                    "pass --oases-plan as a flag of oases compare (before --): it is given to the "
                    "oases+planner variant only"
                )
            raise OasesConfigError(f"oases compare sets {flag} itself; drop it from the flags")
    return train_argv


def _check_run_flags(own):
    """Counts in range, and ``--one-rank`` only with a link to emulate."""
    if own.nproc < 1 or own.iters < 1 or own.warmup < 0 or own.repeats < 1:
        raise OasesConfigError("--nproc, --iters and --repeats must be >= 1 and --warmup >= 0")
    if own.one_rank and not own.emulate_link:
        raise OasesConfigError(
            "--one-rank needs --emulate-link PROFILE: without it the virtual ranks' collectives "
            "take no time and the comparison means nothing"
        )


def _chosen_variants(spec, oases_plan, budgets):
    """``--variants`` (default set depends on ``--memory-budget``) and ``--oases-plan`` as an
    absolute path, refused without a variant that uses it."""
    variants = parse_variants(spec, MEMORY_VARIANTS if budgets else DEFAULT_VARIANTS)
    plan = os.path.abspath(oases_plan) if oases_plan else None
    if plan and not any(v.needs_plan for v in variants):
        raise OasesConfigError(
            "--oases-plan is used by the oases+planner variant only; add it to --variants"
        )
    return variants, plan


def _profile(emulate_link):
    """The cluster profile of ``--emulate-link``, or None without it."""
    if not emulate_link:
        return None
    from ..testbed.clusters import load_cluster

    return load_cluster(emulate_link)  # unknown name -> lists the available ones


def _with_compare_defaults(train_argv):
    """Dropout 0 (so the losses can be compared tightly), mock data and no data-loader processes
    competing for the CPUs, each unless given."""
    train_argv = list(train_argv)
    dropout_given = _has_flag(train_argv, "--hidden-dropout") or _has_flag(
        train_argv, "--attention-dropout"
    )
    if not dropout_given:
        train_argv += ["--hidden-dropout", "0", "--attention-dropout", "0"]
    if not _has_flag(train_argv, "--mock-data"):
        train_argv.append("--mock-data")
    if not _has_flag(train_argv, "--num-workers"):
        train_argv += ["--num-workers", "0"]
    return train_argv


def _validate_variants(variants, train_argv, nproc, one_rank, plan):
    """Every variant's flags parsed and validated as Megatron would, before anything is launched:
    the stock base arguments and ``{name: args}``."""
    base = _validate(VARIANTS["megatron"], train_argv, nproc)
    if one_rank and base.pipeline_model_parallel_size > 1:
        raise OasesConfigError(
            "--one-rank runs pipeline stage 0 alone, whose timeline misses the other stages' "
            "work (the 1F1B bubble); use --pipeline-model-parallel-size 1 or run all ranks "
            "without --one-rank"
        )
    parsed = {v.name: _validate(v, train_argv, nproc) for v in _resolve(variants, base, plan)}
    return base, parsed


def _resolve(variants, base, plan):
    """The variants with their own flags resolved against the base arguments and the plan."""
    return [dataclasses.replace(v, flags=v.resolved_flags(base, plan)) for v in variants]


def _loss_rtol(given, parsed):
    """``--loss-rtol``, else 1e-3 (5e-2 where any variant runs with dropout)."""
    if given is not None:
        return given
    any_dropout = any(a.hidden_dropout or a.attention_dropout for a in parsed.values())
    return 5e-2 if any_dropout else 1e-3


def _keep_plan(plan, out):
    """``--oases-plan`` copied into DIR: the variants run the copy, so that the report names a file
    inside DIR."""
    if not plan:
        return plan
    kept = os.path.join(out, PLAN_COPY)
    if not (os.path.exists(kept) and os.path.samefile(plan, kept)):
        shutil.copyfile(plan, kept)
    return kept


def _emulation(profile, threads, env, processes, base):
    """D and the emulated comm model shared by all variants, or ``(None, None)`` without
    ``--emulate-link``; sets ``env``'s ``OASES_EMULATE_DILATION``."""
    if profile is None:
        return None, None
    from ..viz.analysis import emulated_comm_model

    emulation = emulation_info(profile, threads, env, processes, base)
    return emulation, emulated_comm_model(emulation)


def _model_line(args, nproc, one_rank):
    """The model and parallel setting in one line (progress and report titles)."""
    return (
        f"H={args.hidden_size}, L={args.num_layers}, heads={args.num_attention_heads}, "
        f"seq={args.seq_length}, micro-batch={args.micro_batch_size}, global batch="
        f"{args.global_batch_size}, TP={args.tensor_model_parallel_size}, "
        f"PP={args.pipeline_model_parallel_size}, {nproc} ranks"
        + (" (rank 0 run alone, the others virtual)" if one_rank else "")
    )


def _announce(progress, model, variants, own, out, profile, emulation, threads):
    """What is about to run, and the emulation's D with the rates it came from."""
    progress(
        f"oases compare: {model}; variants {', '.join(v.name for v in variants)}; "
        f"{own.warmup} warm-up + {own.iters} timed iterations each; output {out}"
    )
    if not emulation:
        progress(
            "  no --emulate-link: plain gloo on this host, not representative of a GPU cluster"
        )
        return
    from ..testbed.calibrate import host_cpus

    progress(
        f"  emulating {profile.name}: host {emulation['host_gflops']:.1f} GFLOP/s per rank "
        f"({emulation['host_source']}"
        + (
            f"; {own.nproc} ranks x {threads} thread(s) on {host_cpus()} CPUs: "
            f"{emulation['oversubscription_share']:.2f} of the rate alone"
            if emulation["oversubscription_share"] < 1
            else ""
        )
        + f", {emulation['host_memory_gbs']:.2f} GB/s) => dilation D = "
        f"{emulation['dilation']:.1f} (one layer: target GEMM "
        f"{emulation['target_gemm_ms']:.3g} ms + memory {emulation['target_memory_ms']:.3g} ms; "
        f"host GEMM {emulation['host_gemm_ms']:.4g} ms + memory "
        f"{emulation['host_memory_ms']:.4g} ms)"
    )


def _skip_unfit(variants, parsed, profile, progress):
    """``{name: result}`` of the variants whose estimated memory exceeds 90 % of the emulated
    GPU's: they are not run (full-recompute variants always are)."""
    skipped = {}
    for v in variants:
        if v.recompute != "full" and profile is not None:
            need = estimate_memory_gb(
                parsed[v.name], recompute=v.recompute, dtype_bytes=profile.dtype_bytes
            )
            if need > 0.9 * profile.memory_gb:
                progress(
                    f"{v.name}: skipped, needs ~{need:.1f} GB per GPU > 90 % of "
                    f"{profile.memory_gb:g} GB on {profile.gpu}"
                )
                skipped[v.name] = {
                    "name": v.name,
                    "label": v.label,
                    "paper": v.paper,
                    "status": "skipped",
                    "reason": f"does not fit (~{need:.0f} GB)",
                }
    return skipped


def _run_order(to_run, repeats):
    """``[(repeat, variant)]``. Repeats rotate the order by half the list each time, so that no
    variant's runs are adjacent and a slow drift or a burst of the host's load does not always hit
    the same variant."""
    order, n = [], len(to_run)
    for k in range(repeats):
        shift = (k * ((n + 1) // 2)) % max(n, 1)
        order += [(k, v) for v in to_run[shift:] + to_run[:shift]]
    return order


def _run_all(to_run, train_argv, out, own, env, tokens, comm_model, progress):
    """The timed runs, in :func:`_run_order`: ``{name: [result per run]}``."""
    from .runner import run_variant

    order = _run_order(to_run, own.repeats)
    runs = {v.name: [] for v in to_run}
    for i, (k, v) in enumerate(order, 1):
        tag = f"[{i}/{len(order)}] {v.name}" + (
            f" (run {k + 1}/{own.repeats})" if own.repeats > 1 else ""
        )
        progress(f"{tag}: {v.label}: {' '.join(v.flags)}")
        r = run_variant(
            v,
            train_argv,
            out,
            own.nproc,
            own.warmup,
            own.iters,
            emulate_link=own.emulate_link,
            env=env,
            timeout=own.timeout,
            progress=progress,
            tokens=tokens,
            subdir=f"run{k + 1}" if own.repeats > 1 else None,
            comm_model=comm_model,
            one_rank=own.one_rank,
        )
        if r["status"] == "ok":
            progress(
                f"{tag}: {r['tokens_per_sec']:.1f} tokens/s "
                f"({1e3 * r['mean_iteration_s']:.1f} ms/iteration, {r['wall_s']:.0f} s wall)"
            )
            if r.get("warning"):
                progress(f"  warning: {r['warning']}")
        else:
            progress(f"{tag}: FAILED: {r.get('error')}")
        runs[v.name].append(r)
    return runs


def _best_runs(variants, skipped, runs, repeats):
    """One result per variant, in ``variants``' order: its fastest run, or its first failed run
    where any failed (with ``repeats`` > 1 also every run's time, status and directory)."""
    results = []
    for v in variants:
        if v.name in skipped:
            results.append(skipped[v.name])
            continue
        ok = [r for r in runs[v.name] if r["status"] == "ok"]
        if len(ok) < len(runs[v.name]) or not ok:
            best = next(r for r in runs[v.name] if r["status"] != "ok")
        else:
            best = min(ok, key=lambda r: r["mean_iteration_s"])
        if repeats > 1:
            best["runs"] = [
                {
                    "mean_iteration_s": r.get("mean_iteration_s"),
                    "status": r["status"],
                    "dir": r["dir"],
                }
                for r in runs[v.name]
            ]
        results.append(best)
    return results


def _host_pass(variants, results, train_argv, parsed, own, out, base, progress):
    """Each variant's aten calls (``host``), unless ``--no-host-pass`` or pipeline parallelism
    (rank 0 alone sees stage 0's calls only)."""
    if own.no_host_pass:
        return
    if base.pipeline_model_parallel_size > 1:
        progress("host pass skipped: it counts one rank's calls, and PP > 1 splits the layers")
        return
    from .host import count_calls

    ok = [v for v, r in zip(variants, results) if r["status"] == "ok"]
    counts = count_calls(ok, train_argv, parsed, own.nproc, out, own.timeout, progress)
    for r in results:
        if r["name"] in counts:
            r["host"] = counts[r["name"]]


def _memory_pass(budgets, variants, results, train_argv, parsed, own, out, progress):
    """With ``--memory-budget``: each variant's peak memory per rank (``memory``), from an untimed
    pass over the variants that ran."""
    if not budgets:
        return
    from .memory import measure

    measured = [v for v, r in zip(variants, results) if r["status"] == "ok"]
    memory = measure(
        measured,
        train_argv,
        parsed,
        own.nproc,
        out,
        own.timeout,
        progress,
        one_rank=own.one_rank,
    )
    for r in results:
        if r["name"] in memory:
            r["memory"] = memory[r["name"]]


def _report(argv, config, emulation, rtol, results):
    """results.json's content before :func:`.results.finalize` adds the metrics: the command, when,
    where and with which code it ran, and the runs."""
    from ..testbed.calibrate import host_fingerprint

    return {
        "command": "oases compare " + shlex.join(argv),
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "host": host_fingerprint(),
        "code": _code_version(),
        "config": config,
        "emulation": emulation,
        "loss_check": {"rtol": rtol},
        "variants": results,
    }


def _recount_host(report, out):
    """``--reanalyze DIR --host-pass``: the host pass for a finished run, from its results.json."""
    from .variants import VARIANTS

    cfg = report["config"]
    train_argv = list(cfg["train_argv"])
    cwd = os.getcwd()
    os.chdir(out)  # results.json's paths are relative to DIR
    try:
        ok = [r for r in report["variants"] if r["status"] == "ok"]
        variants = [dataclasses.replace(VARIANTS[r["name"]], flags=tuple(r["flags"])) for r in ok]
        parsed = {v.name: _validate(v, train_argv, cfg["nproc"]) for v in variants}
        own = argparse.Namespace(no_host_pass=False, nproc=cfg["nproc"], timeout=3600)
        base = next(iter(parsed.values()))
        _host_pass(variants, ok, train_argv, parsed, own, out, base, _progress)
    finally:
        os.chdir(cwd)


def _code_version(root=None):
    """megatron-oases version and, in a git checkout, the commit (``+dirty`` with local changes
    to the code: a run's own results, written under ``benchmarks/results`` before this is asked,
    do not count)."""
    import subprocess

    from .. import __version__ as version

    root = root or os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

    def git(*args):
        return subprocess.run(
            ["git", *args], cwd=root, text=True, capture_output=True, timeout=10
        ).stdout.strip()

    try:
        commit = git("rev-parse", "--short", "HEAD")
        dirty = git("status", "--porcelain", "--untracked-files=no", "--", ".", ":!*/results/*")
    except (OSError, subprocess.SubprocessError):
        commit, dirty = "", ""
    return {"version": version, "commit": (commit + ("+dirty" if dirty else "")) or None}


def _progress(msg):
    print(msg, flush=True)


def threads_per_rank(given, nproc, cpus):
    """Torch threads per process: ``--threads-per-rank``, else a rank's share of the CPUs. Also
    under ``--one-rank``: rank 0 alone runs with the threads it has in the all-ranks job (not the
    whole host), so that its compute and D are the same in both (issue 42: with every CPU it was
    calibrated at a 2-thread rate its unfused ops did not reach, and ran ``oases`` 1.73x where all
    ranks ran 1.41x)."""
    return given or max(1, cpus // nproc)


def emulation_info(profile, threads, env, nproc, args):
    """Fix D once for all variants (every variant gets the identical D): the roofline dilation of
    one layer of ``args``' shape (:func:`megatron_oases.testbed.emulator.roofline_dilation`) from
    the host's rates of one rank alone, scaled down when ``nproc`` processes × ``threads``
    oversubscribe the CPUs. The variants get it as ``OASES_EMULATE_DILATION``."""
    from ..device_model import DeviceRates, roofline_dilation
    from ..testbed.calibrate import (
        host_flops,
        host_memory_bandwidth,
        oversubscription_share,
        rate_source,
    )
    from ..testbed.emulator import _env_rate, shape_of_args

    share = oversubscription_share(nproc, threads)
    flops, source = _env_rate("OASES_HOST_FLOPS"), "OASES_HOST_FLOPS"
    if not flops:
        flops, info = host_flops(threads)
        source = rate_source(info, cached="cached calibration")
    mem, mem_source = _env_rate("OASES_HOST_MEM_GBS"), "OASES_HOST_MEM_GBS"
    if mem:
        mem *= 1e9
    else:
        mem, info = host_memory_bandwidth(threads)
        mem_source = rate_source(info, cached="cached calibration")
    host = DeviceRates(flops * share, mem * share, "host")
    host_bytes = 2 if (args.bf16 or args.fp16) else 4
    dl = roofline_dilation(
        profile,
        shape_of_args(args),
        args.tensor_model_parallel_size,
        host,
        host_bytes,
        samples=args.micro_batch_size,
        sp=bool(getattr(args, "sequence_parallel", False)),
        host_attention="unfused" if _cpu_attention_unfused(args) else "fused",
    )
    d = dl.d
    forced = _env_rate("OASES_EMULATE_DILATION")
    if forced:
        d, source = forced, "OASES_EMULATE_DILATION"
    env["OASES_EMULATE_DILATION"] = repr(d)
    return {
        "profile": profile.name,
        "gpu": profile.gpu,
        "dtype": profile.dtype,
        "dtype_bytes": profile.dtype_bytes,
        "target_tflops": profile.sustained_tflops,
        "target_memory_gbs": profile.memory_bandwidth_gbs,
        "host_gflops": flops * share / 1e9,
        "host_gflops_alone": flops / 1e9,
        "host_memory_gbs": mem * share / 1e9,
        "host_memory_source": mem_source,
        "oversubscription_share": share,
        "host_source": source,
        "threads_per_rank": threads,
        "target_gemm_ms": dl.target.gemm_s * 1e3,
        "target_memory_ms": dl.target.memory_s * 1e3,
        "host_gemm_ms": dl.host.gemm_s * 1e3,
        "host_memory_ms": dl.host.memory_s * 1e3,
        "roofline_dilation": dl.d,
        "dilation": d,
    }


def _cpu_attention_unfused(args):
    from ..testbed.emulator import _core_attention

    return _core_attention(args, cuda=False) == "unfused"
