"""Calibration check: stock Megatron's exposed-communication share under ``rtx3090-pcie``, H=2048.

Prints, next to the paper's Figure 2 (TMP communication = 59.2 % and 64.7 % of the iteration for
Megatron-LM on four RTX 3090s):

1. the *model* prediction (ring α–β link model + FLOP count at the profile's sustained rate) for the
   paper's own set-up (TMP=4 over PCIe, H=2048, 24 layers, seq 1024, GPT-2 vocabulary);
2. the same prediction for our testbed shape (TMP=2 on 2 ranks, H=2048, 2 layers, seq 1024);
3. the share *measured* on the emulated testbed for that shape (stock Megatron, full recompute), from
   the run's trace — either by running ``oases compare --variants megatron`` or from an existing
   ``results.json`` (``--results``).

Usage::

    python benchmarks/compare/calibration_check.py [--results DIR/results.json] [--out DIR]
"""

import argparse
import json
import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, ROOT)

PAPER = (0.592, 0.647)  # Figure 2, Megatron-LM, two models on 4x RTX 3090
from run_benchmarks import COMMON, SHAPES  # noqa: E402  (same directory)

from benchmarks import provenance  # noqa: E402

SHAPE = ["--tensor-model-parallel-size", "2", *COMMON, *SHAPES["h2048"]]


def modelled_stock_share(profile, hidden, layers, seq, micro_batch, tp, vocab, heads):
    """Exposed TMP-communication share of stock Megatron with full recompute (all comm blocking).

    Compute per GPU: model FLOPs (fwd + dgrad + wgrad) plus one more forward of the layers
    (recompute), divided by TP, at the profile's sustained rate. Communication per layer and
    micro-batch: 2 all-reduces in forward, 2 in the recompute, 2 in backward (input gradients), each
    of ``micro_batch × seq × hidden`` elements at the training dtype; plus the embedding's forward
    all-reduce and the vocab-parallel cross entropy's three small fp32 all-reduces.
    """
    from megatron_oases.training.flops import num_floating_point_operations

    ffn = 4 * hidden
    total = num_floating_point_operations(
        micro_batch, seq, layers, hidden, ffn, heads, heads, vocab
    )
    logits = 3 * 2 * micro_batch * seq * hidden * vocab
    layer_fwd = (total - logits) / 3
    compute = (total + layer_fwd) / tp / (profile.sustained_tflops * 1e12)
    ranks = list(range(tp))
    act = micro_batch * seq * hidden * profile.dtype_bytes
    comm = (6 * layers + 1) * profile.all_reduce_time(act, ranks)
    comm += 3 * profile.all_reduce_time(micro_batch * seq * 4, ranks)
    return comm / (comm + compute), compute, comm


def measure(out_dir):
    cmd = [
        sys.executable,
        "-m",
        "megatron_oases",
        "compare",
        "--variants",
        "megatron",
        "--emulate-link",
        "rtx3090-pcie",
        "--warmup",
        "1",
        "--iters",
        "2",
        "--out",
        out_dir,
        "--force",  # a new measurement replaces the committed one
        "--",
        *SHAPE,
    ]
    print("running:", " ".join(cmd[1:]), flush=True)
    subprocess.run(cmd, check=True, cwd=ROOT)
    return os.path.join(out_dir, "results.json")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--results",
        default=None,
        help="results.json of an `oases compare` run of this shape (rtx3090-pcie, "
        "with the megatron variant); default: run one",
    )
    parser.add_argument(
        "--tp4-results",
        default=os.path.join(
            ROOT, "benchmarks", "results", "compare", "rtx3090-pcie-h2048tp4", "results.json"
        ),
        help="results.json of the same shape at TMP=4 on 4 ranks (printed when present)",
    )
    parser.add_argument(
        "--out", default=os.path.join(ROOT, "benchmarks", "results", "compare", "calibration")
    )
    args = parser.parse_args(argv)

    from megatron_oases.testbed.clusters import load_cluster

    prof = load_cluster("rtx3090-pcie")
    paper_cfg = dict(hidden=2048, layers=24, seq=1024, micro_batch=4, tp=4, vocab=50304, heads=32)
    ours_cfg = dict(hidden=2048, layers=2, seq=1024, micro_batch=2, tp=2, vocab=512, heads=32)
    p_share, p_comp, p_comm = modelled_stock_share(prof, **paper_cfg)
    o_share, o_comp, o_comm = modelled_stock_share(prof, **ours_cfg)

    results = args.results or measure(args.out)
    with open(results) as f:
        report = json.load(f)
    stock = next(v for v in report["variants"] if v["name"] == "megatron")
    if report.get("emulation", {}).get("profile") != "rtx3090-pcie":
        raise SystemExit(f"{results} is not an rtx3090-pcie run")
    measured = stock["trace"]["exposed_share"]
    emu = report["emulation"]
    # The same model with the compute time the testbed really spent (busy time from the trace):
    # what is left of the gap is the communication side (imbalance, gloo, sleep precision).
    d = emu["dilation"]
    busy_s = stock["trace"]["compute_us"] / 1e6
    eff_rate = o_comp * prof.sustained_tflops * 1e12 / busy_s  # host FLOP/s achieved
    o_share_busy = d * o_comm / (d * o_comm + busy_s)

    lines = [
        "Calibration check: stock Megatron (full recompute), exposed TMP communication share",
        f"profile rtx3090-pcie: {prof.sustained_tflops:g} TFLOP/s fp16 sustained, PCIe ring "
        f"{prof.intra_node.bandwidth_gbs:g} GB/s, {prof.intra_node.latency_us:g} us/step; host "
        f"{emu['host_gflops']:.1f} GFLOP/s => D = {emu['dilation']:.1f}",
        "",
        f"{'set-up':62s} {'exposed comm':>12s}",
        f"{'paper, Figure 2 (Megatron-LM, 4x RTX 3090 PCIe, TMP=4, L=24)':62s} "
        f"{100 * PAPER[0]:.1f}-{100 * PAPER[1]:.1f} %",
        f"{'model, paper set-up (TMP=4, H=2048, L=24, seq 1024)':62s} {100 * p_share:11.1f} %",
        f"{'model, testbed shape (TMP=2, H=2048, L=2, seq 1024, vocab 512)':62s} "
        f"{100 * o_share:11.1f} %",
        f"{'measured, emulated testbed, same shape (trace, mean of ranks)':62s} "
        f"{100 * measured:11.1f} %",
        f"{'model, testbed shape, with the compute time measured there':62s} "
        f"{100 * o_share_busy:11.1f} %",
    ]
    tp4, how4, read = None, None, [report.get("provenance")]
    if args.tp4_results and os.path.exists(args.tp4_results):
        with open(args.tp4_results) as f:
            rep4 = json.load(f)
        read.append(rep4.get("provenance"))
        st4 = next((v for v in rep4["variants"] if v["name"] == "megatron"), None)
        if st4 and st4.get("trace"):
            tp4 = st4["trace"]["exposed_share"]
            t4_share, _, _ = modelled_stock_share(prof, **dict(ours_cfg, tp=4))
            how4 = "rank 0 alone (one-rank)" if rep4["config"].get("one_rank") else "4 ranks"
            label = "measured, TMP=4, %s, %d CPUs, %d thread(s) (CPU share %.2f)" % (
                how4,
                rep4["host"]["logical_cpus"],
                rep4["config"].get("threads_per_rank", 1),
                st4.get("host_cpu_share", float("nan")),
            )
            lines += [
                f"{'model, testbed shape at TMP=4':62s} {100 * t4_share:11.1f} %",
                f"{label:62s} {100 * tp4:11.1f} %",
            ]
    lines += [
        "",
        f"The testbed's compute ran at {eff_rate / 1e9:.1f} GFLOP/s of model FLOPs (recompute "
        f"included), {100 * eff_rate / emu['host_gflops'] / 1e9:.0f} % of the",
        "calibrated matmul rate: softmax, layer norm, GELU, dropout, the optimizer and framework",
        "overhead are not GEMMs. That makes the emulated GPU slower than the profile's GEMM rate and",
        "lowers the communication share; with the compute time measured there the model gives "
        f"{100 * o_share_busy:.1f} %,",
        f"close to the {100 * measured:.1f} % measured.",
        "",
        "Why the testbed number is lower than the paper's: the paper's Figure 2 runs TMP=4, where a",
        "ring all-reduce moves 2(N-1)/N = 1.5x the message over PCIe while each GPU computes 1/4 of",
        "the layer; our 2-rank testbed runs TMP=2 (1.0x the message, 1/2 of the layer): about 3x less",
        "communication per unit of compute. The model reproduces the paper's share for the paper's",
        f"set-up ({100 * p_share:.0f} % vs {100 * PAPER[0]:.0f}-{100 * PAPER[1]:.0f} %): the "
        "profile's link and GPU numbers are consistent with the paper."
        + (
            f" Run at TMP=4 the testbed measures {100 * tp4:.0f} % against the model's "
            f"{100 * t4_share:.0f} % for that shape ({how4}): lower for the reason given above, "
            "the non-GEMM compute the model does not count; not separated further here."
            if tp4 is not None
            else ""
        ),
    ]
    text = "\n".join(lines)
    print(text)
    # as current as the runs it reads (and today's link model)
    prov = provenance.record(
        provenance.EMULATED, provenance.command_line(__file__, argv), inputs=read
    )
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "calibration.txt"), "w") as f:
        f.write(f"provenance: {json.dumps(prov, sort_keys=True)}\n{text}\n")
    with open(os.path.join(args.out, "calibration.json"), "w") as f:
        json.dump(
            {
                "provenance": prov,
                "paper_range": PAPER,
                "model_paper_setup": p_share,
                "model_paper_setup_compute_s": p_comp,
                "model_paper_setup_comm_s": p_comm,
                "model_testbed_shape": o_share,
                "model_testbed_compute_s": o_comp,
                "model_testbed_comm_s": o_comm,
                "measured_testbed": measured,
                "measured_testbed_tmp4": tp4,
                "results": os.path.relpath(results, ROOT),
                "emulation": emu,
            },
            f,
            indent=1,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
