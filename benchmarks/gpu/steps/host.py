"""``host``: the host-issue floor: aten calls per layer per micro-batch (8 layers − 4 layers), the
host's time per call at a negligible shape, and the GPU's idle time inside a step at the report's
shape (``torch.profiler``), for stock and ``oases``."""

import statistics

from .common import fake_group, fmt, layers_argv, one_rank_job, shapes

LIMIT_S = 120
OPTIONS = ()


def run(dry):
    """Calls per layer (8 − 4 layers) ÷ 4 at the probe shape (negligible tensors: step time ≈ the
    host's issue time) and at the report's shape (GPU busy vs step wall)."""
    s = shapes(dry)
    fake_group(2)
    out = {}
    for shape_name in ("probe", "host"):
        rows = {}
        for name in ("megatron", "oases"):
            per = {}
            for layers in (4, 8):
                argv = layers_argv(s, shape_name, layers, name)
                per[layers] = one_rank_job(argv, 4, profile_at=4)
            a4, a8 = per[4]["aten_calls"], per[8]["aten_calls"]
            unprofiled = statistics.median(per[8]["iteration_s"][1:3])  # iterations 2 and 3
            row = {
                "aten_calls_per_layer": (a8 - a4) / 4,
                "aten_calls_per_step_8_layers": a8,
                "step_wall_s_8_layers": per[8]["wall_s"],
                "step_wall_s_8_layers_unprofiled": unprofiled,
                "host_us_per_call": 1e6 * per[8]["wall_s"] / a8,
                "host_us_per_call_unprofiled": 1e6 * unprofiled / a8,
            }
            if "gpu_busy_s" in per[8]:
                busy = per[8]["gpu_busy_s"]
                row.update(
                    gpu_busy_s_8_layers=busy,
                    gpu_idle_share=max(0.0, 1 - busy / per[8]["wall_s"]),
                    gpu_us_per_layer=1e6 * (busy - per[4]["gpu_busy_s"]) / 4,
                    kernels_per_layer=(per[8]["kernels"] - per[4]["kernels"]) / 4,
                )
            rows[name] = row
        out[shape_name] = rows
    # negligible tensors: the step is the host's issue time (the profiler's own cost excluded)
    probe = out["probe"]["megatron"]["host_us_per_call_unprofiled"]
    out["host_us_per_call"] = probe
    out["host_us_per_call_profiled"] = out["probe"]["megatron"]["host_us_per_call"]
    for name, row in out["host"].items():
        row["host_floor_us_per_layer"] = row["aten_calls_per_layer"] * probe
        if "gpu_us_per_layer" in row:
            row["host_bound"] = row["host_floor_us_per_layer"] > row["gpu_us_per_layer"]
    return out


def report(host, env=None):
    lines = ["", "## Host floor", ""]
    lines.append(
        "host time per aten call (negligible tensors; Megatron's iteration time without the "
        f"profiler ÷ the step's aten calls): {fmt(host['host_us_per_call'], '{:.1f}')} µs; "
        "the profiled train_step's wall ÷ its calls: "
        f"{fmt(host.get('host_us_per_call_profiled'), '{:.1f}')} µs"
    )
    lines += ["", "| shape | variant | calls/layer | host floor µs/layer | GPU µs/layer | "
              "GPU idle share | host-bound |", "|---|---|---|---|---|---|---|"]  # fmt: skip
    for shape in ("probe", "host"):
        for v, r in host[shape].items():
            lines.append(
                f"| {shape} | {v} | {fmt(r['aten_calls_per_layer'], '{:.0f}')} | "
                f"{fmt(r.get('host_floor_us_per_layer'), '{:.0f}')} | "
                f"{fmt(r.get('gpu_us_per_layer'), '{:.0f}')} | "
                f"{fmt(r.get('gpu_idle_share'), '{:.2f}')} | {r.get('host_bound', '')} |"
            )
    return lines
