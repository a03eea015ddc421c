"""The GPU check: what a lent GPU machine must tell us, in one command of a few minutes.

Steps, one module each in ``benchmarks/gpu/steps/`` (each step runs in its own process, under its
own time limit, its result kept when a later one fails): ``env`` (versions, the device's GEMM
rate and memory bandwidth), ``parity`` (every schedule against stock on this device, 2 ranks),
``timing`` (one-rank emulated link rows), ``host`` (the host-issue floor), ``split`` (the compute
cost of splitting), ``graphs`` (``--oases-cuda-graphs``), ``python`` (host time per layer by
package) and ``faithful`` (device-bound one-rank rows; run on its own: ``--steps env,faithful``).
Each module's docstring says what its step measures. This file is the driver: the flags, one
process per step, and the report.

``--dry-run`` runs the same steps on the CPU with tiny shapes (CI runs it). Writes
``report.json`` and ``report.md`` (and ``check.log``) into ``--out``: by default
``benchmarks/results/gpu/<date>-<device>/``; on the device tool's machine pass ``--out $OUT/...``.
"""

import argparse
import datetime
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
# this checkout's package (check.sh puts it on PYTHONPATH too) and the steps beside this file
sys.path[:0] = [ROOT] + ([] if HERE in sys.path else [HERE])

from steps import env, faithful, graphs, host, parity, python, split, timing  # noqa: E402

#: the steps in the order they run (``--steps`` keeps this order's subset as given)
STEPS = {
    "env": env,
    "parity": parity,
    "timing": timing,
    "host": host,
    "split": split,
    "graphs": graphs,
    "python": python,
    "faithful": faithful,
}
#: the order of the report's sections
REPORT_ORDER = ("env", "parity", "timing", "host", "graphs", "python", "faithful", "split")


def _run_step(name, dry, limit, log, extra):
    """Run one step in its own process (a crash or hang loses that step only)."""
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
        result_path = f.name
    cmd = [sys.executable, __file__, "--step", name, "--result", result_path]
    cmd += (["--dry-run"] if dry else []) + extra
    t0 = time.time()
    log.write(f"\n===== step {name}: {' '.join(cmd)}\n")
    log.flush()
    try:
        proc = subprocess.run(
            cmd, stdout=log, stderr=subprocess.STDOUT, timeout=limit, cwd=ROOT, env=os.environ
        )
        rc = proc.returncode
    except subprocess.TimeoutExpired:
        rc = None
    seconds = round(time.time() - t0, 1)
    try:
        with open(result_path) as f:
            result = json.load(f)
    except (OSError, ValueError):
        result = None
    finally:
        if os.path.exists(result_path):
            os.remove(result_path)
    if rc == 0 and result is not None:
        return {"status": "ok", "seconds": seconds, "result": result}
    why = f"timed out after {limit:.0f} s" if rc is None else f"exit code {rc}"
    out = {"status": "failed", "seconds": seconds, "error": f"{why}; see check.log"}
    if result:  # what a step saved before it stopped (parity: its finished configs)
        out["result"] = result
    return out


def _step_flags(step, args, env_result, out, limit):
    """The flags that hand a step's process the ``OPTIONS`` it takes: the env step's rates (the
    emulator's host is this device), the report directory for traces, the driver's flags."""
    wants = step.OPTIONS
    extra = []
    rate = env.host_rate(env_result)
    if "gemm_rate" in wants and rate is not None:
        extra += ["--gemm-tflops", repr(rate)]
    if "mem_gbs" in wants and env_result.get("memory_gbs"):
        extra += ["--mem-gbs", repr(env_result["memory_gbs"])]
    if "trace_dir" in wants:  # the kernel timelines go next to the report
        extra += ["--trace-dir", out]
    if "deadline_s" in wants:
        extra += ["--deadline-s", repr(max(limit - 20, 5))]
    if "rows" in wants and args.rows:
        extra += ["--rows", args.rows]
    if "iters" in wants and args.iters:
        extra += ["--iters", str(args.iters)]
    if "only" in wants and args.parity_configs:
        extra += ["--parity-configs", args.parity_configs]
    return extra


def _in_step_process(args):
    """Inside a step's own process: run it with the options it takes, its result to --result
    (also as it goes, for the steps that take ``save``: a time-out keeps what they finished)."""
    os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "1")
    step = STEPS[args.step]

    def save(result):
        with open(args.result, "w") as f:
            json.dump(result, f, default=str)

    given = {
        "save": save,
        "gemm_rate": args.gemm_tflops,
        "mem_gbs": args.mem_gbs,
        "trace_dir": args.trace_dir,
        "rows": args.rows,
        "iters": args.iters,
        "deadline_s": args.deadline_s,
        "only": args.parity_configs.split(",") if args.parity_configs else None,
    }
    save(step.run(args.dry_run, **{k: given[k] for k in step.OPTIONS}))
    return 0


def _slug(text):
    return re.sub(r"[^A-Za-z0-9._-]+", "-", text).strip("-")[:60] or "device"


def write_report(report, out):
    with open(os.path.join(out, "report.json"), "w") as f:
        json.dump(report, f, indent=1, default=str)
    steps = report["steps"]
    lines = [
        f"# GPU check: {report['device']}",
        "",
        f"- date: {report['date']}; code: {report['commit']}; mode: "
        + ("**dry run on the CPU (tiny shapes): no GPU figure**" if report["dry_run"] else "GPU"),
        f"- command: `{report['command']}`",
        "- timing rows are **one-rank emulations**: rank 0 alone, the other TMP ranks virtual, each "
        "collective a modelled wait (on CUDA a spin kernel on its stream) of D x its time on the "
        "named link, D = target GPU rate / this device's GEMM rate; not a measured cluster.",
        "",
        "| step | status | seconds |",
        "|---|---|---|",
    ]
    lines += [f"| {n} | {s['status']} | {s['seconds']} |" for n, s in steps.items()]
    env_result = (steps.get("env") or {}).get("result")
    for name in REPORT_ORDER:
        result = (steps.get(name) or {}).get("result")
        if result:
            lines += STEPS[name].report(result, env_result)
    for n, s in steps.items():
        if s["status"] != "ok":
            lines += ["", f"**{n} failed**: {s['error']}"]
    with open(os.path.join(out, "report.md"), "w") as f:
        f.write("\n".join(lines) + "\n")


def _commit():
    try:
        return (
            subprocess.run(
                ["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True
            ).stdout.strip()
            or "unknown"
        )
    except OSError:
        return "unknown"


def _parser():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dry-run", action="store_true", help="the same steps on the CPU, tiny shapes")
    p.add_argument("--out", default=None, help="report directory")
    p.add_argument(
        "--steps",
        default=",".join(n for n in STEPS if n != "faithful"),
        help="comma-separated subset of the steps (default: all but faithful, which has a "
        "session of its own: --steps env,faithful)",
    )
    p.add_argument("--budget-s", type=float, default=480, help="stop starting steps after this")
    p.add_argument(
        "--parity-configs",
        default=None,
        help="parity: only the configs whose name starts with one of these (comma-separated, "
        "e.g. llama; default all)",
    )
    p.add_argument(
        "--rows",
        default=None,
        help="faithful: profile:TP:micro-batch[:D] rows in priority order (default: the issue's "
        "seven; D forces the dilation, 1 = the GPU is the target)",
    )
    p.add_argument("--iters", type=int, default=None, help="faithful: timed iterations per pass")
    p.add_argument("--step", default=None, help=argparse.SUPPRESS)
    p.add_argument("--result", default=None, help=argparse.SUPPRESS)
    p.add_argument("--gemm-tflops", type=float, default=None, help=argparse.SUPPRESS)
    p.add_argument("--trace-dir", default=None, help=argparse.SUPPRESS)
    p.add_argument("--mem-gbs", type=float, default=None, help=argparse.SUPPRESS)
    p.add_argument("--deadline-s", type=float, default=None, help=argparse.SUPPRESS)
    return p


def main(argv=None):
    p = _parser()
    args = p.parse_args(argv)
    if args.rows:
        try:
            faithful.parse_rows(args.rows)
        except ValueError as exc:
            p.error(str(exc))
    if args.iters is not None and args.iters < 1:
        p.error("--iters must be at least 1")
    if args.step:  # inside a step's own process
        return _in_step_process(args)
    names = [n.strip() for n in args.steps.split(",") if n.strip()]
    unknown = [n for n in names if n not in STEPS]
    if unknown:
        p.error(f"unknown step(s) {', '.join(unknown)}; choose from {', '.join(STEPS)}")
    t_start = time.time()
    # Every in-process job of every step (megatron_oases.training.inprocess.prepared): Megatron's
    # mock-data indices built once per shape, not per job and split, and its parser's docstrings
    # read once per step process: host seconds a GPU waits through between jobs.
    from megatron_oases.training.inprocess import DATA_CACHE_ENV

    data_cache = None
    if DATA_CACHE_ENV not in os.environ:
        data_cache = os.environ[DATA_CACHE_ENV] = tempfile.mkdtemp(prefix="gpu-check-")
    try:
        return _run_steps(args, argv, names, t_start)
    finally:
        if data_cache:
            shutil.rmtree(data_cache, ignore_errors=True)


def _run_steps(args, argv, names, t_start):
    date = datetime.date.today().isoformat()
    import torch

    device = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"
    out = args.out or os.path.join(ROOT, "benchmarks", "results", "gpu", f"{date}-{_slug(device)}")
    os.makedirs(out, exist_ok=True)
    report = {
        "date": date,
        "commit": _commit(),
        "dry_run": args.dry_run,
        "command": "benchmarks/gpu/check.sh "
        + " ".join(argv if argv is not None else sys.argv[1:]),
        "device": device,
        "steps": {},
    }
    with open(os.path.join(out, "check.log"), "w") as log:
        for name in names:
            step = STEPS[name]
            # a step's limit guards the GPU's device time; the dry run checks the path, not
            # its speed, on a CPU that may be shared: twice the time there
            step_limit = step.LIMIT_S * (2 if args.dry_run else 1)
            limit = min(step_limit, args.budget_s - (time.time() - t_start))
            if limit < 10:
                report["steps"][name] = {"status": "failed", "seconds": 0,
                                         "error": f"not run: budget of {args.budget_s:g} s spent"}  # fmt: skip
                continue
            env_result = report["steps"].get("env", {}).get("result") or {}
            extra = _step_flags(step, args, env_result, out, limit)
            print(f"[gpu-check] {name} (limit {limit:.0f} s) ...", flush=True)
            report["steps"][name] = r = _run_step(name, args.dry_run, limit, log, extra)
            bad = step.not_ok(r["result"]) if hasattr(step, "not_ok") and r.get("result") else []
            if bad:  # parity: a config that failed fails the step
                r.update(status="failed", error=f"not ok: {', '.join(bad)}")
            print(f"[gpu-check] {name}: {r['status']} in {r['seconds']} s", flush=True)
            write_report(report, out)  # after every step: a later crash keeps what was found
    failed = [n for n, s in report["steps"].items() if s["status"] != "ok"]
    print(f"[gpu-check] wrote {out}/report.md; {len(names) - len(failed)}/{len(names)} steps ok"
          + (f"; failed: {', '.join(failed)}" if failed else ""), flush=True)  # fmt: skip
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
