"""The faithful step's variants, their fair baselines and the roofline prediction each row is
reported beside (:data:`PREDICTION_MODEL`)."""

from .common import flags, on_cuda

#: (label, variant, graphs?) and each one's fair baseline (the same recompute setting)
FAITHFUL_VARIANTS = (
    ("megatron", "megatron", False),
    ("megatron-norecompute", "megatron-norecompute", False),
    ("oases", "oases", False),
    ("overlap-norecompute", "overlap-norecompute", False),
    ("oases+graphs", "oases", True),
)
FAIR_BASELINE = {
    "megatron": "megatron",
    "megatron-norecompute": "megatron-norecompute",
    "oases": "megatron",
    "oases+graphs": "megatron",
    "overlap-norecompute": "megatron-norecompute",
}
STOCK = ("megatron", "megatron-norecompute")
PREDICTION_MODEL = (
    "roofline of the target GPU (megatron_oases.device_model: GEMM FLOPs at the profile's "
    "sustained rate + memory-bound bytes at its memory bandwidth) per layer forward T_f; "
    "backward 2 T_f, full recompute + T_f; 2 layers, embedding/loss/optimizer left out. "
    "All-reduce t_AR of b*s*h elements on the profile's link for the group (ring alpha-beta). "
    "Stock: every all-reduce exposed (6 per layer with full recompute, 4 without) except the "
    "2 backward ones, each hidden behind its block's weight-gradient GEMMs (~T_f of the block). "
    "Schedules, ideal overlap: max(compute, all-reduces) + one all-reduce per layer exposed "
    "(at most the serial time); "
    "serial (no overlap at all): compute + every all-reduce (oases issues none in recompute: 4 "
    "per layer). Split and graph-copy costs are left out."
)


def layer_shape(s):
    """The layer_math shape dict of the faithful model flags."""
    model = flags(s["timing"])
    given = dict(zip(model[::2], model[1::2]))
    h = int(given["--hidden-size"])
    return {
        "hidden_size": h,
        "num_attention_heads": int(given["--num-attention-heads"]),
        "num_query_groups": None,
        "kv_channels": None,
        "ffn_hidden_size": 4 * h,
        "swiglu": False,
        "seq_length": int(given["--seq-length"]),
        "normalization": "LayerNorm",
        "hidden_dropout": 0.0,
        "attention_dropout": 0.0,
        # as the emulator counts the target (megatron_oases.testbed.emulator.shape_of_args):
        # Megatron's default attention backend picks a fused kernel on a GPU
        "core_attention": "fused",
    }


def predict_row(s, profile_name, tp, mb, with_d=False, layers=2):
    """Modelled iteration time of each variant on the target and the speed-ups (see
    :data:`PREDICTION_MODEL`); ``with_d``: also the roofline D the emulator gives this row on
    this device (its own function, with the device's rates the step handed it:
    :func:`.common.use_host_rates`)."""
    from megatron_oases import device_model as dm
    from megatron_oases.testbed.clusters import load_cluster

    profile = load_cluster(profile_name)
    target = dm.DeviceRates.from_profile(profile)
    shape = layer_shape(s)
    p = profile.dtype_bytes
    blocks = [dm.roofline_time(dm.block_work(shape, b, tp, p, mb), target).total_s
              for b in ("attention", "mlp")]  # fmt: skip
    t_f = sum(blocks)
    ar = profile.all_reduce_time(
        mb * shape["seq_length"] * shape["hidden_size"] * p, list(range(tp))
    )
    hidden_bwd = sum(min(ar, b) for b in blocks)  # stock: dgrad all-reduce behind the wgrad GEMMs
    c_full, c_nr = 4 * t_f * layers, 3 * t_f * layers
    t = {
        "megatron": c_full + layers * (6 * ar - hidden_bwd),
        "megatron-norecompute": c_nr + layers * (4 * ar - hidden_bwd),
    }
    serial = {"oases": c_full + 4 * ar * layers, "overlap-norecompute": c_nr + 4 * ar * layers}
    ideal = {  # never worse than no overlap at all
        "oases": min(serial["oases"], max(c_full, 4 * ar * layers) + ar * layers),
        "overlap-norecompute": min(
            serial["overlap-norecompute"], max(c_nr, 4 * ar * layers) + ar * layers
        ),
    }
    ideal["oases+graphs"], serial["oases+graphs"] = ideal["oases"], serial["oases"]
    best = min(t.values())
    out = {
        "target_layer_forward_ms": 1e3 * t_f,
        "all_reduce_ms": 1e3 * ar,
        "comm_over_compute_stock": 6 * ar / (4 * t_f),
        "iteration_ms": {k: 1e3 * v for k, v in t.items()},
        "speedup": {},
    }
    for label, base in FAIR_BASELINE.items():
        if label in STOCK:
            out["speedup"][label] = {"fair": 1.0, "best_stock": best / t[label]}
            continue
        out["speedup"][label] = {
            "fair_ideal": t[base] / ideal[label],
            "fair_serial": t[base] / serial[label],
            "best_stock_ideal": best / ideal[label],
            "best_stock_serial": best / serial[label],
        }
    if with_d:  # one rank alone, the jobs' dtype (bf16 on CUDA) and attention backend
        from megatron_oases.config import EmulatedLink
        from megatron_oases.testbed.emulator import resolve_dilation

        cuda = on_cuda()
        link = EmulatedLink(profile_name, shape, tp, mb, half_precision=cuda)
        _, info = resolve_dilation(profile, link, ranks=1, cuda=cuda, explain=True)
        out["roofline_d"] = info["roofline"].d
        out["roofline_d_parts"] = info["roofline"].describe()
    return out
