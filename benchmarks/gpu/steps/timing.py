"""``timing``: ``--one-rank`` iteration times of stock, ``oases`` and ``overlap-norecompute`` at the
report's shape under the ``rtx3090-pcie`` and ``h100-nvlink`` link models, TMP 2/4/8 (rank 0
alone on the fake process group; each collective a spin kernel on its stream on CUDA), and at
a shape that keeps the GPU busy (``busy``: H=4096, seq 2048, micro-batch 8; TMP 2 and 8)."""

from .common import dilation_note, emulated_argv, fake_group, fmt, shapes, timed_row, use_host_rates

LIMIT_S = 240
OPTIONS = ("gemm_rate",)
VARIANTS = ("megatron", "oases", "overlap-norecompute")


def run(dry, gemm_rate=None):
    import torch

    s = shapes(dry)
    use_host_rates(gemm_rate)  # the emulator's "host" rate: this device's, in the run's dtype
    # (link profile, TMP, shape, micro-batch): the report's shape on both links, TMP 2/4/8; the
    # busy shape (H=4096, seq 2048, micro-batch 8) on h100-nvlink where it keeps the GPU busy
    # (TMP 2) and where it does not (TMP 8)
    grid = [(p, tp, "timing", 2) for p in ("rtx3090-pcie", "h100-nvlink") for tp in (2, 4, 8)]
    grid += [("h100-nvlink", 2, "busy", 8), ("h100-nvlink", 8, "busy", 8)]
    if dry:  # both links and both ends of the TMP range, in CI's time
        grid = [("rtx3090-pcie", 8, "timing", 2), ("h100-nvlink", 2, "busy", 2)]
    results = {}
    for profile, tp, shape, mb in grid:
        fake_group(tp)
        jobs = {name: emulated_argv(s, shape, tp, mb, profile, name) for name in VARIANTS}
        row = timed_row(jobs, 2 if dry else 5)
        results[f"{profile}-tp{tp}" + ("" if shape == "timing" else f"-{shape}-mb{mb}")] = row
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    from megatron_oases.testbed.link_model import CudaLink

    # which stand-in the collectives were on CUDA (None on the CPU: host-clock waits)
    results["collective_kernel"] = {
        "kernel": CudaLink.last_kernel,
        "fallback_reason": CudaLink.fallback_reason,
    }
    return results


def report(tim, env):
    lines = ["", "## One-rank timing (median iteration s; speed-up over stock)", ""]
    lines += ["| link, TMP | megatron | oases | overlap-norecompute |", "|---|---|---|---|"]
    kernel = tim.get("collective_kernel") or {}
    for n, r in tim.items():
        if n == "collective_kernel":
            continue
        sp = r.get("speedup", {})
        cells = [
            f"{fmt(r.get(v), '{:.4f}')}" + (f" ({sp[v]:.2f}x)" if v in sp else "") for v in VARIANTS
        ]
        lines.append(f"| {n}{dilation_note(n, env)} | " + " | ".join(cells) + " |")
    lines += ["", f"collectives stood in for by: {kernel.get('kernel') or 'host-clock waits'}"
              + (f" (Triton's kernel failed: {kernel['fallback_reason']})"
                 if kernel.get("fallback_reason") else "")]  # fmt: skip
    return lines
