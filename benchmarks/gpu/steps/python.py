"""``python``: where the host's time per layer goes: Python self time per layer by package under
cProfile, for stock, ``oases`` and ``overlap-norecompute`` (with and without graphs)."""

from .common import KERNEL_FLAGS, fake_group, fmt, graphs_flag, layers_argv, shapes

LIMIT_S = 180
OPTIONS = ("save",)
PACKAGES = ("megatron_oases", "megatron", "torch", "builtin", "other")


def run(dry, save=None):
    """Where the host's time per layer goes: one rank at the host shape, L and 2L layers, the
    fastest of 4 steps under cProfile (thread CPU time; unprofiled: the fastest of 12), Python
    self time per layer by package (megatron_oases, megatron, torch, C functions) and the
    schedule's costliest own functions.
    The issue-30 target: megatron_oases frames at most 10 % of the layer's host time."""
    s = shapes(dry)
    save = save or (lambda result: None)
    graphs = graphs_flag().split()
    variants = [
        ("megatron", []),
        ("oases", []),
        ("oases", graphs),
        ("megatron-norecompute", []),
        ("overlap-norecompute", []),
        ("overlap-norecompute", graphs),
    ]
    if dry:
        variants = variants[:3]
    fake_group(2)
    from megatron_oases.errors import last_line
    from megatron_oases.instrument.host_calls import python_time_patch
    from megatron_oases.training.inprocess import prepared
    from megatron_oases.training.pretrain import run_in_process

    out = {}
    for name, extra in variants:
        label = name + ("+graphs" if extra else "")
        per = {}
        try:
            for layers in (4, 8):
                argv = layers_argv(s, "host", layers, name, extra) + KERNEL_FLAGS
                # 12 unprofiled steps: the fastest of 4 was noise-bound on a loaded 2-core CI host
                # (the 4-layer run's minimum above the 8-layer run's at the dry shape)
                first, profiled, unprofiled = 2, 4, 12
                iters = str(first - 1 + profiled + unprofiled)
                argv += ["--train-iters", iters, "--log-interval", "1", "--fake-process-group"]
                record = {}
                patch = python_time_patch(record, first, profiled, unprofiled_calls=unprofiled)
                run_in_process(prepared(argv), demo=True, extra_patches=[patch])
                per[layers] = record
        except Exception as exc:  # noqa: BLE001
            out[label] = {"error": last_line(exc)[:400]}
            continue
        a, b = per[4], per[8]
        layer_s = (b["thread_s"] - a["thread_s"]) / 4
        by_package = {
            k: (b["by_package"].get(k, 0.0) - a["by_package"].get(k, 0.0)) / 4
            for k in set(a["by_package"]) | set(b["by_package"])
        }
        ours = by_package.get("megatron_oases", 0.0)
        out[label] = {
            "host_ms_per_layer": 1e3 * layer_s,
            "host_ms_per_layer_unprofiled": 1e3
            * (b["thread_s_unprofiled"] - a["thread_s_unprofiled"])
            / 4,
            "ms_per_layer_by_package": {k: 1e3 * v for k, v in sorted(by_package.items())},
            "oases_share": ours / layer_s if layer_s > 0 else None,
            "step_thread_s_8_layers": b["thread_s"],
            "top_oases_8_layers": b["top_oases"],
        }
        save(out)
    return out


def report(py, env=None):
    lines = [
        "",
        "## Host time per layer by package (cProfile, thread CPU time, fastest of 4 steps; "
        "unprofiled: fastest of 12)",
        "",
        "| variant | host ms/layer (unprofiled) | "
        + " | ".join(PACKAGES)
        + " | megatron_oases share |",
        "|---|---|" + "---|" * len(PACKAGES) + "---|",
    ]
    for v, r in py.items():
        if "error" in r:
            lines.append(f"| {v} | failed: {r['error']} |")
            continue
        ms = r["ms_per_layer_by_package"]
        cells = " | ".join(fmt(ms.get(k, 0.0), "{:.2f}") for k in PACKAGES)
        lines.append(
            f"| {v} | {fmt(r['host_ms_per_layer'], '{:.2f}')} "
            f"({fmt(r.get('host_ms_per_layer_unprofiled'), '{:.2f}')}) | {cells} | "
            f"{fmt(r['oases_share'], '{:.1%}')} |"
        )
    for v, r in py.items():
        if r.get("top_oases_8_layers"):
            lines += [
                "",
                f"{v}: costliest megatron_oases functions (8 layers, self ms, calls):",
                "",
            ]
            lines += [f"- `{f}` {1e3 * t:.2f} ms, {n}" for f, t, n in r["top_oases_8_layers"][:8]]
    return lines
