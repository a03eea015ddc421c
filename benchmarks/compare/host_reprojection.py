"""The committed ``oases compare`` rows with the host floor at the cluster profiles' current
``host_us_per_call`` (12 µs, measured on an H100 machine's host) instead of the value each run
used (3 µs, a default), from the calls each run counted: which speed-ups survive the host.

    python benchmarks/compare/host_reprojection.py [--out benchmarks/results/compare/host-reprojection.md]

Per variant: the GPU time per iteration (the emulated time ÷ the dilation), the issue time (the
run's aten calls × ``host_us_per_call``), the projected iteration, the larger of the two (the host
runs ahead and waits at the iteration's end, as the planner models it), and the speed-up over stock
full recompute (``megatron``) before and after the host floor. An emulation plus a projection: no
figure here was measured on the target GPU.
"""

import argparse
import glob
import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

from benchmarks import provenance  # noqa: E402


def reproject(results, host_us_per_call, layers):
    """Per variant ``[name, device_ms, issue_ms, projected_ms, host_bound, emulated_x,
    projected_x, layer_device_ms, layer_issue_ms, layer_projected_x]``; the per-layer figures
    (GPU: the iteration's ÷ ``layers``, an upper bound; issue: the calls per layer) are what a deep
    model's iteration tends to."""
    rows = []
    for v in results["variants"]:
        host = v.get("host") or {}
        if "aten_calls_per_iteration" not in host or host.get("device_ms_per_iteration") is None:
            continue
        device = host["device_ms_per_iteration"]
        issue = host["aten_calls_per_iteration"] * host_us_per_call / 1e3
        layer_issue = host["aten_calls_per_layer"] * host_us_per_call / 1e3
        rows.append([v["name"], device, issue, max(device, issue), issue > device,
                     device / layers, layer_issue])  # fmt: skip
    stock = next((r for r in rows if r[0] == "megatron"), None)
    out = []
    for name, device, issue, projected, bound, l_dev, l_issue in rows:
        if stock:
            speedups = [stock[1] / device, stock[3] / projected]
            layer_x = max(stock[5], stock[6]) / max(l_dev, l_issue)
        else:
            speedups, layer_x = [None, None], None
        out.append([name, device, issue, projected, bound, *speedups, l_dev, l_issue, layer_x])
    return out


def _layers(results):
    argv = (results.get("config") or {}).get("train_argv") or []
    return int(argv[argv.index("--num-layers") + 1]) if "--num-layers" in argv else None


def main(argv=None):
    from megatron_oases.testbed.clusters import load_cluster

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--out", default=os.path.join(ROOT, "benchmarks/results/compare/host-reprojection.md")
    )
    p.add_argument("--host-us-per-call", type=float, default=None,
                   help="instead of each run's target profile's value")  # fmt: skip
    args = p.parse_args(argv)
    lines = [
        "# The committed compare rows under the measured host cost",
        "",
        "`python benchmarks/compare/host_reprojection.py` (do not edit by hand). GPU ms: the "
        "**emulated** iteration ÷ the dilation; issue ms: the run's counted aten calls × "
        "`host_us_per_call`; projected: the larger. Speed-ups over `megatron` (stock, full "
        "recompute) of the same run. A projection from an emulation, not a GPU measurement.",
    ]
    read = []
    for path in sorted(glob.glob(os.path.join(ROOT, "benchmarks/results/compare/*/results.json"))):
        with open(path) as f:
            results = json.load(f)
        profile = (results.get("emulation") or {}).get("profile")
        if not profile:
            continue
        us = args.host_us_per_call
        if us is None:
            us = load_cluster(profile).host_us_per_call
        layers = _layers(results)
        rows = reproject(results, us, layers or 1) if layers else []
        if not rows:
            continue
        read.append(results.get("provenance"))  # only the rows it reports
        name = os.path.basename(os.path.dirname(path))
        lines += [
            "",
            f"## {name} (target {profile}, {us:g} µs per call; run of {results.get('date')})",
            "",
        ]
        lines += [f"{layers} layers per run; per layer: GPU ≤ the iteration's ÷ {layers}, issue = "
                  "calls per layer × µs; *layer x*: the speed-up a deep model tends to.", ""]  # fmt: skip
        lines += ["| variant | GPU ms | issue ms | projected ms | host-bound | emulated x | "
                  "projected x | GPU ms/layer | issue ms/layer | layer x |",
                  "|---|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
        for n, device, issue, projected, bound, ex, px, l_dev, l_issue, lx in rows:
            fmt = lambda x: "" if x is None else f"{x:.2f}"  # noqa: E731
            lines.append(f"| {n} | {device:.1f} | {issue:.1f} | {projected:.1f} | "
                         f"{'**yes**' if bound else 'no'} | {fmt(ex)} | {fmt(px)} | "
                         f"{l_dev:.1f} | {l_issue:.1f} | {fmt(lx)} |")  # fmt: skip
    # as current as the rows it re-reads
    prov = provenance.record(
        provenance.EMULATED, provenance.command_line(__file__, argv), inputs=read
    )
    with open(args.out, "w") as f:
        f.write(provenance.markdown("\n".join(lines) + "\n", prov))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
