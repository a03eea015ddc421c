"""Activation memory of a real Megatron iteration, for the planner's memory model and its checks.

:func:`activation_peaks` runs Megatron's ``pretrain()`` in-process per configuration and meters
the forward+backward of the second iteration with
:class:`~megatron_oases.instrument.memory.LiveTensorMeter` (the first warms up lazy buffers and
creates the optimizer state). A :func:`megatron_oases.launch.run_distributed` worker; per rank.
"""

import shlex

from ..instrument.memory import LiveTensorMeter
from ..patching import Patch


def _meter_patch(record, at_call=2):
    """Wrap ``train_step`` so that its ``at_call``-th call runs its forward+backward (Megatron's
    ``forward_backward_func``: the schedule, the losses and ``finalize_model_grads``) inside a
    :class:`LiveTensorMeter`; the peak goes to ``record['peak']``. Gradient-buffer zeroing before it
    and the optimizer step after it are outside the metered region."""
    from megatron.training import training

    original = training.train_step
    calls = {"n": 0}

    def metered(forward_backward_func):
        def run(*a, **k):
            meter = LiveTensorMeter()
            with meter:
                out = forward_backward_func(*a, **k)
            record["peak"] = max(record.get("peak", 0), meter.peak_bytes)
            return out

        return run

    def train_step(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == at_call:
            if "forward_backward_func" in kwargs:
                kwargs["forward_backward_func"] = metered(kwargs["forward_backward_func"])
            else:  # (forward_step_func, data_iterator, model, optimizer, scheduler, config, f_b_f)
                args = args[:6] + (metered(args[6]),) + args[7:]
        return original(*args, **kwargs)

    return Patch("activation-meter", [(training, "train_step", train_step)])


def activation_peaks(configs):
    """``{name: bytes}``: the metered peak per ``(name, argv)`` — activations, temporaries and
    in-flight gradients; parameters, optimizer state and gradient buffers exist before the metered
    region and are not counted. Per rank, like the planner's memory model it is compared with."""
    from .pretrain import run_in_process

    peaks = {}
    for name, argv in configs:
        argv = shlex.split(argv) if isinstance(argv, str) else list(argv)
        if "--train-iters" not in argv:
            argv += ["--train-iters", "2"]
        record = {}
        run_in_process(argv, extra_patches=[_meter_patch(record)])
        if "peak" not in record:
            raise RuntimeError(f"{name}: fewer than two iterations ran; nothing was metered")
        peaks[name] = record["peak"]
    return peaks
