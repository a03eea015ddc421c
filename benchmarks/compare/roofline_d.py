"""The roofline dilation D per packaged cluster profile at the faithful GPU rows' shapes.

D = host time ÷ target time of one layer (megatron_oases/device_model.py): the host an H100 at
740 TFLOP/s bf16 GEMM (measured in the committed traces) and 3,350 GB/s (datasheet); the target each
profile's sustained rates. H=2048, 32 heads, seq 1024, GeLU FFN 4H, no dropout, flash attention on
both (Megatron's default backend on CUDA), bf16 on both.

Usage: python benchmarks/compare/roofline_d.py [--host-tflops 740] [--host-gbs 3350]
"""

import argparse

from megatron_oases.device_model import DeviceRates, dilation, layer_work
from megatron_oases.testbed.clusters import available, load_cluster

SHAPE = {
    "hidden_size": 2048,
    "num_attention_heads": 32,
    "ffn_hidden_size": 8192,
    "seq_length": 1024,
    "core_attention": "fused",
}
ROWS = ((2, 32), (4, 64))  # (TP, micro-batch)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--host-tflops", type=float, default=740.0)
    p.add_argument("--host-gbs", type=float, default=3350.0)
    a = p.parse_args(argv)
    host = DeviceRates(a.host_tflops * 1e12, a.host_gbs * 1e9, "H100")
    print(f"host: {a.host_tflops:g} TFLOP/s, {a.host_gbs:g} GB/s; one layer, forward, per rank")
    print(
        "| profile | TFLOP/s | GB/s | TP | mb | target GEMM ms | target memory ms | "
        "host GEMM ms | host memory ms | D | GEMM-only D |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for name in available():
        prof = load_cluster(name)
        target = DeviceRates.from_profile(prof)
        for tp, mb in ROWS:
            dl = dilation(layer_work(SHAPE, tp, 2, samples=mb), host, target)
            print(
                f"| {name} | {prof.sustained_tflops:g} | {prof.memory_bandwidth_gbs:g} | {tp} | "
                f"{mb} | {dl.target.gemm_s * 1e3:.2f} | {dl.target.memory_s * 1e3:.2f} | "
                f"{dl.host.gemm_s * 1e3:.2f} | {dl.host.memory_s * 1e3:.2f} | {dl.d:.3f} | "
                f"{prof.sustained_tflops / a.host_tflops:.3f} |"
            )


if __name__ == "__main__":
    main()
