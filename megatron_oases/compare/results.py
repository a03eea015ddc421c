"""A finished ``oases compare`` run: trace metrics, speedups, the loss check, the memory budgets,
timelines and charts, then results.json/.md. ``--reanalyze DIR`` redoes this from results.json
alone, so every path it records is relative to DIR.
"""

import os
import shlex
import sys

from ..errors import OasesConfigError

#: The status of a variant an interrupted comparison did not finish (results.json's
#: ``interrupted`` says by what and during which stage).
INTERRUPTED = "interrupted"


def finalize(report, out, announce=True):
    """Trace metrics, speedups, loss check, memory budgets, timelines and charts; writes
    results.{json,md}.

    Also used by ``--reanalyze DIR`` on a finished run, or on an interrupted one (the variants that
    finished; the rest stay ``interrupted``). Paths in results.json are relative to DIR. Returns
    the exit code (1 when a variant failed, the losses disagree or the comparison was
    interrupted); the stderr lines that say why only where ``announce`` (an interrupted
    command prints one line of its own).
    """
    from ..viz.analysis import emulated_comm_model, load_traces, run_metrics
    from ..viz.timeline import plot_timeline
    from .contention import contention_free_us
    from .report import (
        add_derived,
        check_losses,
        format_table,
        interrupted_line,
        plot_summary,
        write_json,
        write_markdown,
    )
    from .summary import add_less_contention, best_against_best, contention

    def here(p):
        return p if os.path.isabs(p) else os.path.join(out, p)

    rel = _relative_to(out)
    emulation = report.get("emulation")
    comm_model = emulated_comm_model(emulation) if emulation else None
    suffix = f", emulated {emulation['profile']}" if emulation else ""
    model = report["config"]["model"]
    _relative_report(report, rel)
    results = report["variants"]
    for r in results:
        if r["status"] == "ok" and r.get("trace_files"):
            traces = load_traces([here(f) for f in r["trace_files"]])
            r["trace"] = run_metrics(traces, comm_model) if traces else None
            if r["trace"]:
                r["trace"]["contention_free_us"] = contention_free_us(traces, comm_model)
            path = os.path.join(out, f"timeline-{r['name']}.png")
            plot_timeline(
                traces,
                path,
                title=f"{r['name']} ({r['label']}), {model}{suffix}",
                comm_model=comm_model,
            )
            r["timeline"] = rel(path)
    rtol = report["loss_check"]["rtol"]
    ref = add_derived(results)
    add_less_contention(results, ref)
    _project_host(results, emulation)
    one_rank = report["config"].get("one_rank")
    bad = [] if one_rank else check_losses(results, ref, rtol)
    chart = None
    if any(r["status"] == "ok" for r in results):
        chart = rel(
            plot_summary(results, os.path.join(out, "throughput.png"), title=model + suffix)
        )
    report["chart"] = chart
    budgets = report["config"].get("memory_budget_gb")
    if budgets:
        from . import memory

        report["memory_budget"] = memory.select(results, budgets)
        report["memory_chart"] = None
        if any(memory.is_measured(r) for r in results):
            path = os.path.join(out, "memory.png")
            report["memory_chart"] = rel(memory.plot_memory(report, path, title=model + suffix))
    contended = report["contention"] = contention(results)
    best = report["best_against_best"] = best_against_best(
        results, corrected=bool(contended and contended["contended"])
    )
    failed = [r["name"] for r in results if r["status"] == "failed"]
    n_ok = sum(r["status"] == "ok" for r in results)
    summary = (
        f"all {n_ok} variants agree with {ref['name']} within rtol {rtol:g}"
        if ref and not bad
        else "; ".join(bad) or "no variant ran"
    )
    if one_rank:
        summary = (
            "not checked: one-rank runs are timing-only (the virtual ranks' collectives reduce "
            "nothing)"
        )
    report["loss_check"] = {
        "rtol": rtol,
        "reference": ref["name"] if ref else None,
        "ok": None if one_rank else not bad,
        "failures": bad,
        "summary": summary,
    }
    write_json(report, os.path.join(out, "results.json"))
    write_markdown(report, os.path.join(out, "results.md"))
    print("\n" + format_table(results), flush=True)
    print(f"\nlosses: {summary}", flush=True)
    if budgets:
        print("\n" + memory.format_tables(report), flush=True)
    if best:
        print(f"\nbest against best: {best['line']}", flush=True)
    if contended and contended["contended"]:
        print(f"\n{contended['line']}", flush=True)
    wrote = ["results.json"] + (["throughput.png"] if chart else [])
    wrote += ["memory.png"] if report.get("memory_chart") else []
    wrote += [os.path.basename(r["timeline"]) for r in results if r.get("timeline")]
    print(f"wrote {os.path.join(out, 'results.md')}, {', '.join(wrote)}", flush=True)
    cut = report.get("interrupted")
    if announce and failed:
        print(f"oases compare: variant(s) failed: {', '.join(failed)}", file=sys.stderr, flush=True)
    if announce and bad:
        print(
            "oases compare: the variants' losses disagree (see above)", file=sys.stderr, flush=True
        )
    if announce and cut:
        print(f"oases compare: {interrupted_line(cut)}", file=sys.stderr, flush=True)
    return 1 if failed or bad or cut else 0


def _project_host(results, emulation):
    """Issue and device time per iteration and ``host_bound`` from each variant's counted calls
    and the emulated profile (:func:`.host.project`)."""
    from .host import project

    profile = None
    if emulation:
        from ..testbed.clusters import load_cluster

        profile = load_cluster(emulation["profile"])
    for r in results:
        if r.get("host"):
            project(r["host"], r, emulation, profile)


def _relative_to(out):
    """Absolute path -> relative to ``out`` (anything else as is): what results.json records."""

    def rel(p):
        return os.path.relpath(p, out) if isinstance(p, str) and os.path.isabs(p) else p

    return rel


def _relative_argv(argv, rel):
    """Absolute paths in an argument list (also ``--flag=PATH``) made relative by ``rel``."""
    out = []
    for a in argv:
        flag, eq, value = a.partition("=")
        out.append(f"{flag}={rel(value)}" if eq and flag.startswith("-") else rel(a))
    return out


def _relative_report(report, rel):
    """Every path results.json records, relative to its directory (older reports included, on
    --reanalyze): the variants' directories, traces and timelines, the chart, the plan and the
    command lines (run from DIR; the interpreter by name, not by its path on this machine)."""
    if isinstance(report.get("command"), str):
        report["command"] = shlex.join(_relative_argv(shlex.split(report["command"]), rel))
    config = report.get("config") or {}
    if config.get("train_argv"):
        config["train_argv"] = _relative_argv(config["train_argv"], rel)
    if config.get("oases_plan"):
        config["oases_plan"] = rel(config["oases_plan"])
    report["chart"] = rel(report.get("chart"))
    for r in report.get("variants", []):
        for key in ("dir", "timeline"):
            if r.get(key):
                r[key] = rel(r[key])
        for run in r.get("runs", []):
            run["dir"] = rel(run.get("dir"))
        if r.get("trace_files"):
            r["trace_files"] = [rel(f) for f in r["trace_files"]]
        if r.get("flags"):
            r["flags"] = _relative_argv(r["flags"], rel)
        if r.get("command"):
            interpreter = r["command"][0]
            r["command"] = [os.path.basename(interpreter)] + _relative_argv(r["command"][1:], rel)


def _require_traces(out, report):
    """Before any work: the per-rank traces a re-analysis reads. A committed results directory
    keeps its report but not the raw traces (``.gitignore``), so say that instead of failing in
    the middle of the charts."""
    for r in report.get("variants", []):
        if r.get("status") != "ok":
            continue
        missing = [
            f for f in r.get("trace_files") or () if not os.path.exists(os.path.join(out, f))
        ]
        if missing:
            raise OasesConfigError(
                f"--reanalyze {out}: {r['name']}'s trace {missing[0]} is not there (raw traces "
                "are not kept with committed results); re-run the command in its results.md to "
                "regenerate them, or re-analyse a directory that still has its trace.rank*.json"
            )


def reanalyze(out, budgets=None, recount=None):
    """``--reanalyze DIR``: recompute metrics, timelines and charts of a finished run; with
    ``budgets`` (GB per rank) the memory comparison is made at those budgets instead; with
    ``recount(report, dir)`` the host pass is run again first."""
    import json

    path = os.path.join(out, "results.json")
    try:
        with open(path) as f:
            report = json.load(f)
    except (OSError, ValueError) as exc:
        raise OasesConfigError(f"--reanalyze {out}: cannot read {path}: {exc}") from exc
    _require_traces(out, report)
    if budgets:
        if not report["config"].get("memory_budget_gb"):
            raise OasesConfigError(
                f"--reanalyze {out} --memory-budget: that run measured no memory; run oases "
                "compare with --memory-budget"
            )
        report["config"]["memory_budget_gb"] = budgets
        report["rebudgeted"] = "budgets chosen after the run: --reanalyze . --memory-budget " + (
            ",".join(f"{b:g}" for b in budgets)
        )
    if recount is not None:
        recount(report, os.path.abspath(out))
        report["host_recounted"] = "aten calls counted after the run: --reanalyze . --host-pass"
    return finalize(report, os.path.abspath(out))
