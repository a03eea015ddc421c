"""Cost-model validation (issues 5, 6 and 12): the planner's predictions against measured runs.

On the CPU testbed (2 gloo ranks, TMP domain T=2, links emulated as rtx3090-pcie) this script

1. profiles the model of ``model.yaml`` with ``oases profile --emulate-link`` (measured, so the
   profile is in emulated host time, like the runs);
2. builds the plan set: *uniform* plans [1]*L and [2]*L under every schedule (with full recompute,
   plus ``off``/``overlap`` without recompute) — issue 5 — and *per-layer* plans under schedule
   ``oases`` with full recompute: both uniform plans, the planner's choices at three memory limits and
   random plans — issue 6; with ``--sequence-parallel`` also [T]*L under Megatron's
   ``--sequence-parallel`` for every schedule (as for issue 5) — issue 12 (the runtime runs SP with
   uniform TMP only: these runs take ``--sequence-parallel`` instead of ``--oases-plan``);
3. runs every plan with ``oases train --oases-plan … --emulate-link`` (torchrun, 2 ranks) and takes the
   median of the timed iterations' ``iteration-time``;
4. measures activation memory per plan in-process with ``LiveTensorMeter`` (the forward+backward of
   the second iteration of Megatron's ``pretrain()``, after a warm-up one:
   ``megatron_oases.training.measure.activation_peaks``) and compares it with the planner's activation
   parts;
5. writes ``results.json``, ``results.md`` and ``scatter.png`` to ``--out``.

Usage::

    python benchmarks/validation/run_validation.py --out benchmarks/results/validation
    python benchmarks/validation/run_validation.py --out DIR --analyze-only   # re-tabulate
    python benchmarks/validation/run_validation.py --out DIR --sequence-parallel  # + SP plans

Measurements are only as good as the host: run it when no other benchmark is running.
"""

import argparse
import json
import os
import random
import re
import shlex
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, REPO)

from benchmarks import provenance  # noqa: E402

#: the models its figures depend on: the planner's predictions against emulated runs
MODELS = ("cost_model", "device_model", "emulator")
MODEL = os.path.join(HERE, "model.yaml")
LINK = "rtx3090-pcie"
GLOBAL_BATCH, MICRO_BATCH, T, LAYERS = 4, 4, 2, 4
TRAIN = (
    "--num-layers 4 --hidden-size 512 --num-attention-heads 8 --seq-length 256 "
    "--max-position-embeddings 256 --vocab-size 512 --micro-batch-size 4 --global-batch-size 4 "
    "--tensor-model-parallel-size 2 --mock-data --seed 1234 --num-workers 0"
)
RECOMPUTE = ["--recompute-granularity", "full", "--recompute-method", "uniform"]
RECOMPUTE += ["--recompute-num-layers", "1"]
PLANNER_MEMORY_GB = (24, 0.26, 0.24)  # 24 GB: the 3090; the small limits make memory bind
SCHEDULES = ("off", "overlap", "cross-pass", "oases")
ISSUES = {
    "5": "issue 5: uniform plans × schedules",
    "6": "issue 6: per-layer plans, oases",
    "12": "issue 12: sequence parallelism, [T]*L × schedules",
}


def plan_set():
    """[(name, degrees, schedule, recompute, issue, sequence_parallel)]."""
    out = []
    for d in (1, 2):
        for sched in SCHEDULES:
            out.append((f"u{d}-{sched}", [d] * LAYERS, sched, True, "5", False))
        out.append((f"u{d}-off-norecompute", [d] * LAYERS, "off", False, "5", False))
    return out


def sp_set():
    """SP plans: every layer at T (what the runtime supports), each schedule, as :func:`plan_set`."""
    out = [(f"sp-u{T}-{sched}", [T] * LAYERS, sched, True, "12", True) for sched in SCHEDULES]
    out += [(f"sp-u{T}-{s}-norecompute", [T] * LAYERS, s, False, "12", True) for s in SCHEDULES[:2]]
    return out


def layer_degrees_set(profile_path, n_random=8, seed=0):
    from megatron_oases.planner.api import make_plan
    from megatron_oases.planner.settings import PlanSettings

    plans = {(1,) * LAYERS: "u1-oases", (2,) * LAYERS: "u2-oases"}
    chosen = {}
    for mem in PLANNER_MEMORY_GB:
        plan, _, _ = make_plan(
            profile_path,
            PlanSettings(
                global_batch_size=GLOBAL_BATCH,
                micro_batch_size=MICRO_BATCH,
                memory_gb=mem,
                schedule="oases",
            ),
        )
        key = tuple(plan["degrees"])
        chosen[str(mem)] = {
            "degrees": list(key),
            "predicted_s": plan["predicted"]["iteration_time_s"],
            "speedup_vs_best_fitting_uniform": plan["speedup"].get("best_fitting_uniform"),
            "uniform": plan["uniform"],
        }
        plans.setdefault(key, f"planner-{mem}GB")
    rng = random.Random(seed)
    while len(plans) < 4 + n_random and len(plans) < 2**LAYERS:
        key = tuple(rng.choice((1, 2)) for _ in range(LAYERS))
        plans.setdefault(key, "random-" + "".join(map(str, key)))
    return [(name, list(k), "oases", True, "6", False) for k, name in plans.items()], chosen


def flags(degrees, schedule, recompute, plan_path, sequence_parallel=False):
    """``oases train`` flags of a plan; SP runs are uniform at T and take no --oases-plan."""
    f = shlex.split(TRAIN) + ["--oases-schedule", schedule]
    f += ["--sequence-parallel"] if sequence_parallel else ["--oases-plan", plan_path]
    if recompute:
        f += RECOMPUTE
    return f


def write_plan(out, name, degrees, schedule):
    from megatron_oases.formats.plan import save_plan, uniform_plan

    plan = uniform_plan(
        LAYERS,
        T,
        1,
        schedule=schedule,
        global_batch_size=GLOBAL_BATCH,
        micro_batch_size=MICRO_BATCH,
    )
    plan["degrees"] = list(degrees)
    path = os.path.join(out, "plans", name + ".json")
    os.makedirs(os.path.dirname(path), exist_ok=True)
    save_plan(plan, path)
    return path


def predict_one(profile, degrees, schedule, recompute, sequence_parallel=False):
    from megatron_oases.planner.prediction import predict
    from megatron_oases.planner.settings import PlanSettings

    r = predict(
        profile,
        degrees,
        PlanSettings(
            schedule=schedule,
            global_batch_size=GLOBAL_BATCH,
            micro_batch_size=MICRO_BATCH,
            recompute=recompute,
            memory_gb=24,
            sequence_parallel=sequence_parallel,
        ),
    )
    mb = r["memory_breakdown_bytes"]
    act = mb.get("fixed_activations", 0.0) + mb.get("saved_activations", 0.0)
    act += mb.get("runtime_peak_layer", 0.0)
    return {
        "iteration_time_s": r["iteration_time_s"],
        "forward_s": r["forward_s"],
        "backward_s": r["backward_s"],
        "edges_s": r["edges_s"],
        "activation_bytes": act,
        "memory_breakdown_bytes": mb,
    }


def run_train(argv, out_dir, warmup, iters, timeout):
    os.makedirs(out_dir, exist_ok=True)
    golden = os.path.join(out_dir, "golden.json")
    if os.path.exists(golden):
        os.remove(golden)
    from megatron_oases.launch import torchrun_command

    cmd = torchrun_command(
        ["train", *argv, "--train-iters", str(warmup + iters), "--log-interval", "1",
         "--log-json", golden, "--emulate-link", LINK],
        nproc=2,
    )  # fmt: skip
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    t0 = time.time()
    with open(os.path.join(out_dir, "log.txt"), "w") as log:
        rc = subprocess.run(
            cmd, stdout=log, stderr=subprocess.STDOUT, env=env, timeout=timeout, cwd=REPO
        ).returncode
    res = {"command": shlex.join(cmd[2:]), "returncode": rc, "wall_s": time.time() - t0}
    if rc != 0:
        return res
    with open(golden) as f:
        g = json.load(f)
    times = g["iteration-time"]["values"]
    timed = times[warmup:]
    res.update(
        iteration_times_s=times, median_s=statistics.median(timed), losses=g["lm loss"]["values"]
    )
    return res


def measure_memory(rows, timeout):
    from megatron_oases.launch import run_distributed
    from megatron_oases.training.measure import activation_peaks

    configs = [(r["name"], r["argv"]) for r in rows]
    per_rank = run_distributed(activation_peaks, 2, configs, timeout=timeout)
    return {name: max(p[name] for p in per_rank) for name, _ in configs}


def spearman(a, b):
    from scipy.stats import spearmanr

    return float(spearmanr(a, b).statistic) if len(a) > 2 else float("nan")


def mape(pred, meas):
    return 100 * statistics.fmean(abs(p - m) / m for p, m in zip(pred, meas))


_EMU = re.compile(r"emulator rank (\d+):.*blocked ([\d.]+) s of ([\d.]+) s;.*not blocked ([\d.]+)")


def contention(log_path):
    """From the emulator's end-of-run lines: (blocked fraction, CPU share while not blocked),
    averaged over ranks; (None, None) when absent."""
    try:
        text = open(log_path).read()
    except OSError:
        return None, None
    m = _EMU.findall(text)
    if not m:
        return None, None
    b = statistics.fmean(float(x[1]) / float(x[2]) for x in m)
    return b, statistics.fmean(float(x[3]) for x in m)


def analyze(report, out):
    for r in report["rows"]:
        if r.get("median_s"):
            b, share = contention(os.path.join(out, "runs", r["name"], "log.txt"))
            r["blocked_fraction"], r["cpu_share"] = b, share
        r.pop("share_corrected_s", None)
        r["predicted"].pop("replica_grad_sync_s", None)
        r["predicted"].pop("iteration_time_with_sync_s", None)
    rows = [r for r in report["rows"] if r.get("median_s")]
    stats = {}
    for issue in [i for i in ISSUES if i != "12" or any("12" in r["issues"] for r in rows)]:
        sub = [r for r in rows if issue in r["issues"]]
        pred = [r["predicted"]["iteration_time_s"] for r in sub]
        meas = [r["median_s"] for r in sub]
        stats[issue] = {
            "n": len(sub),
            "spearman_time": spearman(pred, meas),
            "mape_time_pct": mape(pred, meas) if sub else None,
        }
        mem = [r for r in sub if r.get("measured_activation_bytes")]
        if mem:
            pm = [r["predicted"]["activation_bytes"] for r in mem]
            mm = [r["measured_activation_bytes"] for r in mem]
            stats[issue].update(
                n_memory=len(mem),
                spearman_memory=spearman(pm, mm),
                mape_memory_pct=mape(pm, mm),
                worst_memory_error_pct=min(100 * (p - m) / m for p, m in zip(pm, mm)),
            )
    by_deg = {tuple(r["degrees"]): r for r in rows if "6" in r["issues"]}
    uni = [by_deg[k] for k in ((1,) * LAYERS, (2,) * LAYERS) if k in by_deg]
    planner = []
    for mem, ch in report.get("planner", {}).items():
        r = by_deg.get(tuple(ch["degrees"]))
        if not r:
            continue
        fitting = [u for u in uni if ch["uniform"][str(u["degrees"][0])]["fits"]]
        best = min(fitting, key=lambda u: u["median_s"]) if fitting else None
        planner.append({
            "memory_gb": mem, "degrees": ch["degrees"], "measured_s": r["median_s"],
            "predicted_s": r["predicted"]["iteration_time_s"],
            "best_fitting_uniform": best["name"] if best else None,
            "best_fitting_uniform_measured_s": best["median_s"] if best else None,
            "measured_speedup": best["median_s"] / r["median_s"] if best else None,
            "predicted_speedup": ch["speedup_vs_best_fitting_uniform"],
        })  # fmt: skip
    report["stats"], report["planner_vs_uniform"] = stats, planner
    _plot(rows, os.path.join(out, "scatter.png"))
    with open(os.path.join(out, "results.json"), "w") as f:
        json.dump(report, f, indent=1)
    text = _markdown(report)
    if report.get("provenance"):  # the runs' (--analyze-only re-reads them, not re-runs)
        text = provenance.markdown(text, report["provenance"])
    with open(os.path.join(out, "results.md"), "w") as f:
        f.write(text)
    print(_markdown(report))


def _markdown(report):
    lines = [
        "| plan | degrees | schedule | recompute | issues | predicted ms | measured ms (median) | "
        "error % | CPU share | pred. act. MiB | meas. act. MiB | memory error % |",
        "|" + "---|" * 12,
    ]
    for r in report["rows"]:
        p = r["predicted"]
        m = r.get("median_s")
        err = f"{100 * (p['iteration_time_s'] - m) / m:+.1f}" if m else "failed"
        ma = r.get("measured_activation_bytes")
        pa = p["activation_bytes"]
        lines.append(
            f"| {r['name']} | {''.join(map(str, r['degrees']))} | {r['schedule']} | "
            f"{'full' if r['recompute'] else 'no'} | {','.join(r['issues'])} | "
            f"{1e3 * p['iteration_time_s']:.0f} | {f'{1e3 * m:.0f}' if m else '-'} | {err} | "
            f"{_fmt(r.get('cpu_share'), 2)} | {pa / 2**20:.1f} | "
            f"{f'{ma / 2**20:.1f}' if ma else '-'} | "
            f"{f'{100 * (pa - ma) / ma:+.1f}' if ma else '-'} |"
        )
    lines += [
        "",
        "| plan set | n | Spearman (time) | MAPE time % | Spearman (act. memory) | "
        "MAPE act. memory % | worst memory error % |",
        "|---|---|---|---|---|---|---|",
    ]
    for issue, s in report["stats"].items():
        lines.append(
            f"| {ISSUES[issue]} | {s['n']} | {s['spearman_time']:.3f} | {s['mape_time_pct']:.1f} | "
            f"{s.get('spearman_memory', float('nan')):.3f} | "
            f"{s.get('mape_memory_pct', float('nan')):.1f} | "
            f"{s.get('worst_memory_error_pct', float('nan')):+.1f} |"
        )
    lines += [
        "",
        "| memory limit GB | planner's plan | predicted ms | measured ms | best fitting "
        "uniform (measured ms) | measured speed-up | predicted speed-up |",
        "|---|---|---|---|---|---|---|",
    ]
    for p in report.get("planner_vs_uniform", []):
        lines.append(
            f"| {p['memory_gb']} | {''.join(map(str, p['degrees']))} | "
            f"{1e3 * p['predicted_s']:.0f} | {1e3 * p['measured_s']:.0f} | "
            f"{p['best_fitting_uniform']} ({1e3 * (p['best_fitting_uniform_measured_s'] or 0):.0f}) | "
            f"{(p['measured_speedup'] or 0):.3f} | {(p['predicted_speedup'] or 0):.3f} |"
        )
    return "\n".join(lines) + "\n"


def _fmt(x, digits, scale=1.0):
    return "-" if x is None else f"{scale * x:.{digits}f}"


def _plot(rows, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colors = {
        "off": "tab:gray",
        "overlap": "tab:blue",
        "cross-pass": "tab:orange",
        "oases": "tab:green",
    }
    fig, axes = plt.subplots(1, 2, figsize=(11, 5))
    panels = (
        (axes[0], "time", lambda r: 1e3 * r["predicted"]["iteration_time_s"],
         lambda r: 1e3 * r["median_s"], "iteration time (ms)"),
        (axes[1], "memory", lambda r: r["predicted"]["activation_bytes"] / 2**20,
         lambda r: (r.get("measured_activation_bytes") or float("nan")) / 2**20,
         "activation memory per rank (MiB)"),
    )  # fmt: skip
    for ax, kind, fx, fy, what in panels:
        pts = []
        for r in rows:
            x, y = fx(r), fy(r)
            if y != y:  # not measured
                continue
            pts += [x, y]
            marker = "o" if "5" in r["issues"] else "^"
            face = colors[r["schedule"]] if r["recompute"] else "none"
            ax.scatter(x, y, marker=marker, c=face, edgecolors=colors[r["schedule"]], s=45)
            label = "".join(map(str, r["degrees"])) + ("" if r["recompute"] else " norc")
            ax.annotate(label, (x, y), fontsize=6, xytext=(3, 3), textcoords="offset points")
        if pts:
            lo, hi = min(pts), max(pts)
            ax.plot([lo, hi], [lo, hi], "k--", lw=0.8, label="y = x")
            if kind == "memory":
                ax.plot(
                    [lo, hi], [lo / 0.95, hi / 0.95], "r:", lw=0.8, label="5 % under-prediction"
                )
        for s, c in colors.items():
            ax.scatter([], [], c=c, label=s)
        ax.scatter([], [], marker="^", c="k", label="per-layer plan (oases)")
        ax.scatter([], [], marker="o", facecolors="none", edgecolors="k", label="no recompute")
        ax.set_xlabel(f"predicted {what}")
        ax.set_ylabel(f"measured {what}")
        ax.set_title(f"H512 L4, T=2, 2 CPU ranks, emulated {LINK}: {kind}", fontsize=8)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=os.path.join(REPO, "benchmarks/results/validation"))
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--iters", type=int, default=3)
    p.add_argument("--timeout", type=float, default=600)
    p.add_argument("--n-random", type=int, default=6)
    p.add_argument("--no-memory", action="store_true")
    p.add_argument("--analyze-only", action="store_true")
    p.add_argument(
        "--rerun",
        default=None,
        metavar="NAMES",
        help="re-measure these plans (comma list, or 'loaded': those whose runs saw a CPU share "
        "< --min-share) of a finished DIR, then re-analyze",
    )
    p.add_argument("--min-share", type=float, default=0.85)
    p.add_argument(
        "--sequence-parallel",
        action="store_true",
        help="also run [T]*L under --sequence-parallel for every schedule (issue 12); profiles "
        "with --sequence-parallel (profile-sp.json)",
    )
    a = p.parse_args(argv)
    out = os.path.abspath(a.out)
    os.makedirs(out, exist_ok=True)
    if a.analyze_only or a.rerun:
        with open(os.path.join(out, "results.json")) as f:
            report = json.load(f)
        if a.rerun:
            names = a.rerun.split(",")
            if a.rerun == "loaded":
                names = [
                    r["name"] for r in report["rows"] if (r.get("cpu_share") or 0) < a.min_share
                ]
            for r in report["rows"]:
                if r["name"] not in names:
                    continue
                load = open("/proc/loadavg").read().split()[0]
                res = run_train(
                    shlex.split(r["argv"]), os.path.join(out, "runs", r["name"]), a.warmup,
                    a.iters, a.timeout,
                )  # fmt: skip
                r.update(res, rerun_load_avg=load)
                print(f"re-measured {r['name']}: {1e3 * r.get('median_s', float('nan')):.0f} ms "
                      f"(load {load})", flush=True)  # fmt: skip
            report.setdefault("reruns", []).append(
                {"date": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "names": names}
            )
            # rows re-measured now beside the others: as current as the older of the two
            report["provenance"] = provenance.record(
                MODELS,
                provenance.command_line(__file__, sys.argv[1:] if argv is None else argv),
                inputs=[report.get("provenance")],
            )
        analyze(report, out)
        return 0
    prov = provenance.record(
        MODELS, provenance.command_line(__file__, sys.argv[1:] if argv is None else argv)
    )
    # an SP profile also holds everything the non-SP plans need
    sp_flag = ["--sequence-parallel"] if a.sequence_parallel else []
    profile = os.path.join(out, "profile-sp.json" if sp_flag else "profile.json")
    if not os.path.exists(profile):
        subprocess.run([sys.executable, "-m", "megatron_oases", "profile", "--model", MODEL,
                        "--emulate-link", LINK, "--no-cache", "--out", profile, *sp_flag],
                       check=True, cwd=REPO, env=dict(os.environ, OMP_NUM_THREADS="1"))  # fmt: skip
    per_layer, chosen = layer_degrees_set(profile, a.n_random)
    rows = {}
    for name, degrees, sched, rc, issue, sp in (
        plan_set() + per_layer + (sp_set() if sp_flag else [])
    ):
        key = (tuple(degrees), sched, rc, sp)
        if key in rows:
            rows[key]["issues"].append(issue)
            continue
        path = write_plan(out, name, degrees, sched)
        rows[key] = {"name": name, "degrees": degrees, "schedule": sched, "recompute": rc,
                     "sequence_parallel": sp, "issues": [issue], "plan": os.path.relpath(path, out),
                     "argv": shlex.join(flags(degrees, sched, rc, path, sp)),
                     "predicted": predict_one(profile, degrees, sched, rc, sp)}  # fmt: skip
    rows = list(rows.values())
    uptime = []
    for i, r in enumerate(rows, 1):
        uptime.append(open("/proc/loadavg").read().split()[0])
        res = run_train(
            shlex.split(r["argv"]),
            os.path.join(out, "runs", r["name"]),
            a.warmup,
            a.iters,
            a.timeout,
        )
        r.update(res)
        print(
            f"[{i}/{len(rows)}] {r['name']}: predicted {1e3 * r['predicted']['iteration_time_s']:.0f}"
            f" ms, measured {1e3 * r.get('median_s', float('nan')):.0f} ms "
            f"(rc {res['returncode']}, load {uptime[-1]})",
            flush=True,
        )
    if not a.no_memory:
        peaks = measure_memory(rows, a.timeout * 2)
        for r in rows:
            r["measured_activation_bytes"] = peaks.get(r["name"])
    report = {
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "command": shlex.join([sys.argv[0], *(argv or sys.argv[1:])]),
        "host": {"cpus": os.cpu_count(), "load_avg_1min_before_each_run": uptime,
                 "load_avg_at_end": open("/proc/loadavg").read().split()[:3]},
        "model": TRAIN, "link": LINK, "profile": os.path.basename(profile),
        "warmup": a.warmup, "iters": a.iters, "planner": chosen, "rows": rows,
        "provenance": prov,
    }  # fmt: skip
    analyze(report, out)
    return 0


if __name__ == "__main__":
    sys.path.insert(0, REPO)
    sys.exit(main())
