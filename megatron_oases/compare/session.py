"""One comparison, as a library call: :func:`run_comparison` (:class:`CompareSettings` in, exit
code out); ``oases compare`` (:mod:`.cli`) is its command line.

Every variant is a separate ``oases train`` run (torchrun subprocess, :mod:`.runner`) with the same
flags, the same seed and data, and the identical link emulator (same profile, same dilation ``D``,
fixed here once by :func:`megatron_oases.testbed.emulator.emulation_info` and handed to the ranks
by :func:`~megatron_oases.testbed.emulator.dilation_env`); a few warm-up then timed iterations
each. Then the host pass (:mod:`.host`), with a memory budget the memory pass (:mod:`.memory`),
and the report (:mod:`.results`).

``--out DIR`` belongs to one comparison: a live run holds its lock
(:func:`megatron_oases.outputs.lock_dir`, as training's ``--save``), and a directory that holds
another comparison's results is refused unless ``force`` (:func:`claim_out_dir`).
"""

import contextlib
import dataclasses
import os
import shutil
import time

from ..errors import OasesConfigError, last_line
from ..interrupts import describe
from ..outputs import LOCK_FILE, lock_dir
from .report import write_json
from .results import INTERRUPTED, finalize
from .settings import CompareSettings
from .variants import VARIANTS, estimate_memory_gb

__all__ = ["CompareSettings", "run_comparison", "claim_out_dir", "recount_host"]

#: ``--oases-plan``, kept beside results.json: the report is self-contained.
PLAN_COPY = "oases-plan.json"
#: results.json's date.
DATE_FORMAT = "%Y-%m-%d %H:%M:%S %Z"


def run_comparison(settings, progress=None):
    """Run the comparison ``settings`` describe and write its report into ``settings.out``.

    Returns the exit code: 0, or 1 when a variant failed or the variants' losses disagree. Bad
    input (flags Megatron refuses, an unknown profile, an ``out`` in use or holding results)
    raises :class:`OasesConfigError` before any run. Ctrl-C (SIGTERM under :mod:`..interrupts`)
    during the runs or passes stops the run in progress, writes the report of the variants that
    finished (the others ``interrupted``) and is raised again, with a note saying where the
    report is. ``progress``: called with each progress line (default: printed)."""
    progress = progress or _progress
    s = settings
    profile = _profile(s.emulate_link)
    train_argv = _with_compare_defaults(s.train_argv)
    variants = [VARIANTS[name] for name in s.variants]
    base, parsed = _validate_variants(variants, train_argv, s.nproc, s.one_rank, s.oases_plan)
    rtol = _loss_rtol(s.loss_rtol, parsed)

    from ..testbed.emulator import threads_per_rank

    threads = threads_per_rank(s.threads_per_rank, s.nproc)
    out = os.path.abspath(s.out)
    with claim_out_dir(s.out, s.force):
        plan = _keep_plan(s.oases_plan, out)
        variants = _resolve(variants, base, plan)
        processes = 1 if s.one_rank else s.nproc  # processes on this host
        env = {"OMP_NUM_THREADS": str(threads)}
        emulation, comm_model = _emulation(profile, threads, env, processes, base)
        tokens = base.global_batch_size * base.seq_length
        model = _model_line(base, s.nproc, s.one_rank)
        _announce(progress, model, variants, s, out, profile, emulation, threads)

        config = {
            "model": model,
            "train_argv": train_argv,
            "nproc": s.nproc,
            "one_rank": s.one_rank,
            "repeats": s.repeats,
            "threads_per_rank": threads,
            "warmup": s.warmup,
            "iters": s.iters,
            "tokens_per_iteration": tokens,
            "oases_plan": plan,
            "memory_budget_gb": list(s.memory_budget) if s.memory_budget else None,
        }
        report = _report(s.command_line(), config, emulation, rtol)  # before the runs: no wait
        skipped = _skip_unfit(variants, parsed, profile, progress)
        to_run = [v for v in variants if v.name not in skipped]
        runs = {v.name: [] for v in to_run}
        results, stage = None, "the timed runs"
        try:
            _run_all(to_run, train_argv, out, s, env, tokens, comm_model, progress, runs)
            results = _best_runs(variants, skipped, runs, s.repeats)
            if s.host_pass:
                stage = "the host pass"
                _host_pass(
                    variants, results, train_argv, parsed, s.nproc, s.timeout, out, base, progress
                )
            stage = "the memory pass"
            _memory_pass(variants, results, train_argv, parsed, s, out, progress)
        except KeyboardInterrupt as exc:  # Ctrl-C, SIGTERM: the report of what finished
            results = results or _best_runs(variants, skipped, runs, s.repeats)
            report.update(variants=results, date=time.strftime(DATE_FORMAT))
            report["interrupted"] = _interrupted(exc, stage, results, bool(s.memory_budget))
            _report_interrupted(report, out, progress, exc)
            raise
        report.update(variants=results, date=time.strftime(DATE_FORMAT))
        write_json(report, os.path.join(out, "results.json"))  # kept if the report is cut short
        return finalize(report, out)


# ------------------------------------------------------------------ --out: one comparison's
def results_in(out):
    """What of a comparison's output ``out`` holds: ``results.json`` (a finished run), else the
    first variant directory or pass log of an unfinished one; None when it holds none."""
    if os.path.isfile(os.path.join(out, "results.json")):
        return "results.json"
    try:
        names = sorted(os.listdir(out))
    except OSError:  # not there yet
        return None
    for name in names:
        if name in VARIANTS or name in ("host-pass.log", "memory"):
            return f"{name}, an unfinished run's logs"
    return None


@contextlib.contextmanager
def claim_out_dir(out, force=False):
    """``out`` for this comparison while the block runs: created, locked against a second live
    run (:func:`megatron_oases.outputs.lock_dir`; a lock left by a process that is gone is taken
    over) and, unless ``force``, refused when it holds another comparison's results (one line
    naming the directory and the fix). The lock file is removed when the block ends."""
    os.makedirs(out, exist_ok=True)
    held = lock_dir(out, "--out")
    try:
        found = None if force else results_in(out)
        if found:
            raise OasesConfigError(
                f"--out {out} holds the results of another comparison ({found}); choose another "
                "--out directory, or add --force to write over them"
            )
        yield out
    finally:
        if held is not None:
            with contextlib.suppress(OSError):
                os.unlink(os.path.join(out, LOCK_FILE))  # before the lock is released
            held.close()


# ------------------------------------------------------------------ before the runs
def _validate(variant, train_argv, nproc):
    """Megatron's parse + validate (+ the Oases rules) of one variant's ``oases train`` flags for
    ``nproc`` ranks, before anything is launched."""
    from ..profiler.model_config import parse_offline

    try:
        return parse_offline(list(train_argv) + list(variant.flags), world_size=nproc, demo=True)
    except OasesConfigError as exc:
        raise OasesConfigError(f"variant {variant.name}: {exc}") from exc


def _profile(emulate_link):
    """The cluster profile of ``--emulate-link``, or None without it."""
    if not emulate_link:
        return None
    from ..testbed.clusters import load_cluster

    return load_cluster(emulate_link)  # unknown name -> lists the available ones


def _with_compare_defaults(train_argv):
    """Dropout 0 (so the losses can be compared tightly), mock data and no data-loader processes
    competing for the CPUs, each unless given."""
    from .settings import has_flag

    train_argv = list(train_argv)
    dropout_given = has_flag(train_argv, "--hidden-dropout") or has_flag(
        train_argv, "--attention-dropout"
    )
    if not dropout_given:
        train_argv += ["--hidden-dropout", "0", "--attention-dropout", "0"]
    if not has_flag(train_argv, "--mock-data"):
        train_argv.append("--mock-data")
    if not has_flag(train_argv, "--num-workers"):
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
    ``--emulate-link``; adds to ``env`` what hands D to the variants' ranks."""
    if profile is None:
        return None, None
    from ..config import EmulatedLink
    from ..testbed.emulator import dilation_env, emulation_info
    from ..viz.analysis import emulated_comm_model

    link = EmulatedLink.from_args(profile.name, base)
    emulation = emulation_info(profile, link, processes, threads)
    env.update(dilation_env(emulation["dilation"]))
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


def _announce(progress, model, variants, s, out, profile, emulation, threads):
    """What is about to run, and the emulation's D with the rates it came from."""
    progress(
        f"oases compare: {model}; variants {', '.join(v.name for v in variants)}; "
        f"{s.warmup} warm-up + {s.iters} timed iterations each; output {out}"
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
            f"; {s.nproc} ranks x {threads} thread(s) on {host_cpus()} CPUs: "
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


# ------------------------------------------------------------------ the runs and passes
def _run_order(to_run, repeats):
    """``[(repeat, variant)]``. Repeats rotate the order by half the list each time, so that no
    variant's runs are adjacent and a slow drift or a burst of the host's load does not always hit
    the same variant."""
    order, n = [], len(to_run)
    for k in range(repeats):
        shift = (k * ((n + 1) // 2)) % max(n, 1)
        order += [(k, v) for v in to_run[shift:] + to_run[:shift]]
    return order


def _run_all(to_run, train_argv, out, s, env, tokens, comm_model, progress, runs):
    """The timed runs, in :func:`_run_order`, each result appended to ``runs[name]`` as it
    finishes (an interrupted comparison reports those)."""
    from .runner import run_variant

    order = _run_order(to_run, s.repeats)
    for i, (k, v) in enumerate(order, 1):
        tag = f"[{i}/{len(order)}] {v.name}" + (
            f" (run {k + 1}/{s.repeats})" if s.repeats > 1 else ""
        )
        progress(f"{tag}: {v.label}: {' '.join(v.flags)}")
        r = run_variant(
            v,
            train_argv,
            out,
            s.nproc,
            s.warmup,
            s.iters,
            emulate_link=s.emulate_link,
            env=env,
            timeout=s.timeout,
            progress=progress,
            tokens=tokens,
            subdir=f"run{k + 1}" if s.repeats > 1 else None,
            comm_model=comm_model,
            one_rank=s.one_rank,
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


def _best_runs(variants, skipped, runs, repeats):
    """One result per variant, in ``variants``' order: its fastest run, or its first failed run
    where any failed (with ``repeats`` > 1 also every run's time, status and directory); a
    variant without a finished run (the comparison was interrupted) is ``interrupted``."""
    results = []
    for v in variants:
        if v.name in skipped:
            results.append(skipped[v.name])
            continue
        if not runs[v.name]:
            results.append(
                {
                    "name": v.name,
                    "label": v.label,
                    "paper": v.paper,
                    "flags": list(v.flags),
                    "status": INTERRUPTED,
                    "reason": "did not finish",
                }
            )
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


def _host_pass(variants, results, train_argv, parsed, nproc, timeout, out, base, progress):
    """Each variant's aten calls (``host``), except under pipeline parallelism (rank 0 alone sees
    stage 0's calls only)."""
    if base.pipeline_model_parallel_size > 1:
        progress("host pass skipped: it counts one rank's calls, and PP > 1 splits the layers")
        return
    from .host import count_calls

    ok = [v for v, r in zip(variants, results) if r["status"] == "ok"]
    counts = count_calls(ok, train_argv, parsed, nproc, out, timeout, progress)
    for r in results:
        if r["name"] in counts:
            r["host"] = counts[r["name"]]


def _memory_pass(variants, results, train_argv, parsed, s, out, progress):
    """With a memory budget: each variant's peak memory per rank (``memory``), from an untimed
    pass over the variants that ran."""
    if not s.memory_budget:
        return
    from .memory import measure

    measured = [v for v, r in zip(variants, results) if r["status"] == "ok"]
    memory = measure(
        measured,
        train_argv,
        parsed,
        s.nproc,
        out,
        s.timeout,
        progress,
        one_rank=s.one_rank,
    )
    for r in results:
        if r["name"] in memory:
            r["memory"] = memory[r["name"]]


def _report(command, config, emulation, rtol):
    """results.json's content before :func:`.results.finalize` adds the metrics: the command,
    where and with which code it ran (asked before the runs, so that an interrupted comparison
    writes its report at once); the caller adds the date and the runs."""
    from ..testbed.calibrate import host_fingerprint

    return {
        "command": command,
        "date": None,
        "host": host_fingerprint(),
        "code": code_version(),
        "config": config,
        "emulation": emulation,
        "loss_check": {"rtol": rtol},
        "variants": [],
    }


def _interrupted(exc, stage, results, metered):
    """results.json's ``interrupted``: by which signal, during which stage, and the variants
    that did not finish (reported as :data:`INTERRUPTED`); a pass that was cut short is an error
    of each variant that ran (``host``, ``memory`` where ``metered``), not a missing count."""
    passes = {"the host pass": ["host", "memory"], "the memory pass": ["memory"]}.get(stage, [])
    for r in results:
        for key in passes:
            if r["status"] == "ok" and key not in r and (key == "host" or metered):
                r[key] = {"error": f"{stage} was interrupted"}
    return {
        "by": describe(exc),
        "during": stage,
        "not_finished": [r["name"] for r in results if r["status"] == INTERRUPTED],
    }


def _report_interrupted(report, out, progress, exc):
    """An interrupted comparison's report, of the variants that finished (results.json first,
    as it is, so that a second Ctrl-C in the charts still leaves one ``--reanalyze`` reads); what
    it left is added to ``exc``'s notes, for the command's one line."""
    progress(f"interrupted by {describe(exc)} during {report['interrupted']['during']}")
    write_json(report, os.path.join(out, "results.json"))
    try:
        finalize(report, out, announce=False)
    except Exception as error:  # noqa: BLE001 - the interrupt is what the command reports
        exc.add_note(
            f"the report's charts failed ({last_line(error)}); results.json is in {out}: "
            f"oases compare --reanalyze {out} completes it"
        )
        return
    names = {
        status: [r["name"] for r in report["variants"] if r["status"] == status]
        for status in ("ok", "failed")
    }
    missing = report["interrupted"]["not_finished"]
    exc.add_note(
        f"report of the variants that finished ({', '.join(names['ok']) or 'none'}) in "
        f"{os.path.join(out, 'results.md')}"
        + (f", failed: {', '.join(names['failed'])}" if names["failed"] else "")
        + (", their losses disagree" if report["loss_check"]["failures"] else "")
        + (f", not finished: {', '.join(missing)}" if missing else "")
    )


def recount_host(report, out):
    """``--reanalyze DIR --host-pass``: the host pass for a finished run, from its results.json
    (``report``) in ``out``."""
    cfg = report["config"]
    train_argv = list(cfg["train_argv"])
    cwd = os.getcwd()
    os.chdir(out)  # results.json's paths are relative to DIR
    try:
        ok = [r for r in report["variants"] if r["status"] == "ok"]
        variants = [dataclasses.replace(VARIANTS[r["name"]], flags=tuple(r["flags"])) for r in ok]
        parsed = {v.name: _validate(v, train_argv, cfg["nproc"]) for v in variants}
        base = next(iter(parsed.values()))
        _host_pass(variants, ok, train_argv, parsed, cfg["nproc"], 3600, out, base, _progress)
    finally:
        os.chdir(cwd)


def code_version(root=None):
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
