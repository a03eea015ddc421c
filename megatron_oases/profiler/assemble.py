"""The ranks' raw measurements as a profile file (:mod:`megatron_oases.formats.profile`).

Compute times become per-degree ``[samples, seconds]`` points; communication points are fitted
``t = α + β·bytes``; memory is parameters per rank (× optimizer-state bytes per parameter) and the
measured saved activations and runtime peaks (and the core-attention part of them that selective
recomputation does not keep), on top of :mod:`.analytic`'s memory section (backward
working set, embedding/logits memory from :mod:`.layer_math` where not measured; under sequence
parallelism the SP savings, counted, applied to the measured non-SP values by the planner); the
output layer's time is its FLOPs at the measured MLP rate.

Pure data: no torch, no ranks; kept apart from the worker so that the file layout is read in one
place.
"""

import time

from ..formats.profile import PROFILE_VERSION, fit_alpha_beta
from . import layer_math
from .analytic import memory_section

FP32_STATE_BYTES_PER_PARAM = 16  # fp32 param + fp32 grad + Adam exp_avg + exp_avg_sq


def assemble(margs, shape, T, degrees, result, fingerprint, cache_key, emulate_link):
    p = 4  # fp32 on CPU
    compute = {}
    for block in layer_math.BLOCKS:
        compute[block] = {}
        for d in degrees:
            per = result["compute"][d]
            compute[block][str(d)] = {
                ph: [[n, per[n][block][ph]] for n in sorted(per)]
                for ph in sorted(per[min(per)][block])  # + core_attention_forward_s (attention)
            }
    comm = {kind: {} for kind in result["comm"]}
    for kind in comm:
        for key, pts in result["comm"][kind].items():
            alpha, beta = fit_alpha_beta(pts)
            comm[kind][key] = {"alpha_s": alpha, "beta_s_per_byte": beta, "points": pts}
    sp = bool(getattr(margs, "sequence_parallel", False))
    mem = memory_section(shape, T, degrees, p, overhead_bytes=0, sequence_parallel=sp)
    mem["state_bytes_per_layer"] = {
        str(d): result["params"][d] * FP32_STATE_BYTES_PER_PARAM for d in degrees
    }
    mem["params_per_layer"] = {str(d): result["params"][d] for d in degrees}
    measured_act, peaks, act_points, peak_points, block_peaks = {}, {}, {}, {}, {}
    for d in degrees:
        per = result["saved"][d]
        measured_act[str(d)] = max((b["attention"] + b["mlp"]) / n for n, b in per.items())
        act_points[str(d)] = [[n, b["attention"] + b["mlp"]] for n, b in sorted(per.items())]
        if all(b.get("runtime_peak") for b in per.values()):
            peaks[str(d)] = max(b["runtime_peak"] / n for n, b in per.items())
            peak_points[str(d)] = [[n, b["runtime_peak"]] for n, b in sorted(per.items())]
            for block in layer_math.BLOCKS:
                block_peaks.setdefault(block, {})[str(d)] = [
                    [n, b[f"runtime_peak_{block}"]] for n, b in sorted(per.items())
                ]
    mem["layer_activation_bytes_per_sample"] = measured_act
    # the same as measured at each sample count in play: a per-sample maximum times n would count
    # n-independent parts (weight-gradient temporaries, masks) n times
    mem["layer_activation_bytes"] = act_points
    # what selective recomputation of core attention does not keep: the attention half's saved
    # bytes without it minus with it (measured at each sample count in play)
    mem["core_attention_activation_bytes"] = {
        str(d): [
            [n, max(0.0, b["attention"] - b["attention_selective"])]
            for n, b in sorted(result["saved"][d].items())
        ]
        for d in degrees
    }
    source = "layer activations: saved_tensors_hooks; logits: layer_math"
    if len(peaks) == len(degrees):
        # backward working set beyond the saved activations, as measured (never below zero)
        mem["backward_transient_bytes_per_sample"] = {
            d: max(0.0, peaks[d] - measured_act[d]) for d in peaks
        }
        mem["layer_runtime_peak_bytes_per_sample"] = peaks
        mem["layer_runtime_peak_bytes"] = peak_points
        mem["block_runtime_peak_bytes"] = block_peaks
        source += "; backward working set: LiveTensorMeter peak of forward+backward"
    else:
        source += "; backward working set: layer_math"
    mem["activation_source"] = source
    # output layer time from the measured MLP rate at the largest degree and sub-batch
    d = max(degrees)
    n = max(result["compute"][d])
    mlp_t = result["compute"][d][n]["mlp"]["forward_s"]
    rate = layer_math.block_flops_forward(shape, "mlp", d) * n / max(mlp_t, 1e-12)
    head = layer_math.head_flops_forward(shape, T) / rate
    return {
        "version": PROFILE_VERSION,
        "kind": "measured",
        "model": shape,
        "tensor_model_parallel_size": T,
        "data_parallel_size": margs.data_parallel_size,
        "pipeline_model_parallel_size": margs.pipeline_model_parallel_size,
        "degrees": degrees,
        "sequence_parallel": sp,
        "dtype_bytes": p,
        "state_bytes_per_param": FP32_STATE_BYTES_PER_PARAM,
        "cluster": None,
        "emulate_link": emulate_link,
        "emulate_dilation": result.get("dilation"),
        "hardware": fingerprint,
        "cache_key": cache_key,
        "compute": compute,
        "fixed_compute": {
            "forward_s_per_sample": head,
            "backward_s_per_sample": 2 * head,
            "source": "output-layer FLOPs at the measured MLP rate",
        },
        "comm": comm,
        "memory": mem,
        "measured_flops_per_s": rate,
        "phase_seconds": result.get("phase_seconds"),
        "created": time.strftime("%Y-%m-%dT%H:%M:%S"),
    }
