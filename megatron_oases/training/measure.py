"""Activation memory of a real Megatron iteration, for the planner's memory model and its checks.

:func:`activation_peaks` runs Megatron's ``pretrain()`` in-process per configuration and meters
the forward+backward of the second iteration with
:class:`~megatron_oases.instrument.memory.LiveTensorMeter` (the first warms up lazy buffers and
creates the optimizer state). A :func:`megatron_oases.launch.run_distributed` worker; per rank.
:func:`memory_per_rank` also counts the rank's parameters (model states follow from them exactly,
see :func:`state_bytes`) and reports a configuration that fails instead of raising.
"""

import shlex

from ..instrument.memory import LiveTensorMeter
from ..patching import Patch


def _meter_patch(record, at_call=2, breakdown=False):
    """Wrap ``train_step`` so that its ``at_call``-th call runs its forward+backward (Megatron's
    ``forward_backward_func``: the schedule, the losses and ``finalize_model_grads``) inside a
    :class:`LiveTensorMeter`; the peak goes to ``record['peak']``. Gradient-buffer zeroing before it
    and the optimizer step after it are outside the metered region. The rank's parameter count
    (its model chunks, shared weights once) goes to ``record['params']``. ``breakdown``: also what
    is live at the peak, ``record['live_at_peak']`` and ``record['peak_site']`` (see the meter)."""
    from megatron.training import training

    original = training.train_step
    calls = {"train_steps": 0}

    def metered(forward_backward_func):
        def run(*a, **k):
            meter = LiveTensorMeter(breakdown=breakdown)
            with meter:
                out = forward_backward_func(*a, **k)
            if meter.peak_bytes > record.get("peak", -1):
                record["peak"] = meter.peak_bytes
                if breakdown:
                    record["live_at_peak"] = meter.live_at_peak
                    record["peak_site"] = meter.peak_site
            return out

        return run

    def train_step(*args, **kwargs):
        calls["train_steps"] += 1
        if calls["train_steps"] == at_call:
            chunks = kwargs["model"] if "model" in kwargs else args[2]
            unique = {id(p): p for chunk in chunks for p in chunk.parameters()}
            record["params"] = sum(p.numel() for p in unique.values())
            if "forward_backward_func" in kwargs:
                kwargs["forward_backward_func"] = metered(kwargs["forward_backward_func"])
            else:  # (forward_step_func, data_iterator, model, optimizer, scheduler, config, f_b_f)
                args = args[:6] + (metered(args[6]),) + args[7:]
        return original(*args, **kwargs)

    return Patch("activation-meter", [(training, "train_step", train_step)])


def _metered_run(name, argv, breakdown=False):
    from .pretrain import run_in_process

    argv = shlex.split(argv) if isinstance(argv, str) else list(argv)
    if "--train-iters" not in argv:
        argv += ["--train-iters", "2"]
    record = {}
    run_in_process(argv, extra_patches=[_meter_patch(record, breakdown=breakdown)])
    if "peak" not in record:
        raise RuntimeError(f"{name}: fewer than two iterations ran; nothing was metered")
    return record


def activation_peaks(configs):
    """``{name: bytes}``: the metered peak per ``(name, argv)`` — activations, temporaries and
    in-flight gradients; parameters, optimizer state and gradient buffers exist before the metered
    region and are not counted. Per rank, like the planner's memory model it is compared with."""
    return {name: _metered_run(name, argv)["peak"] for name, argv in configs}


def memory_per_rank(configs, breakdown=False):
    """``{name: {'activation_bytes', 'params'} or {'error': line}}`` per ``(name, argv)``, this
    rank's (with ``breakdown``, also ``live_at_peak`` and ``peak_site``: what is live at the peak
    and where it was set). A configuration that raises is recorded and the next one runs (``oases
    compare``'s memory pass reports it for that variant only)."""
    out = {}
    for name, argv in configs:
        try:
            record = _metered_run(name, argv, breakdown)
        except Exception as exc:  # noqa: BLE001 - one variant's failure, reported as its result
            lines = str(exc).strip().splitlines()
            out[name] = {"error": f"{type(exc).__name__}: {lines[-1] if lines else ''}"}
            continue
        out[name] = {"activation_bytes": record["peak"], "params": record["params"]}
        if breakdown:
            out[name].update(live_at_peak=record["live_at_peak"], peak_site=record["peak_site"])
    return out


def state_bytes(params, args):
    """Model-state bytes of ``params`` parameters on one rank, from Megatron's args: the weights
    (``params_dtype``), the gradient buffer (fp32 when the weights are or when gradients
    accumulate in fp32, else the weights' dtype), an fp32 master copy for fp16/bf16 weights and the
    optimizer's moments (Adam, and the others counted as Adam: two fp32; SGD: one with momentum). Master copy and moments are
    sharded over the data-parallel ranks under ``--use-distributed-optimizer``. Fp32 on CPU with
    Adam: 4 + 4 + 8 = 16 bytes per parameter. Exact for Megatron's ``DistributedDataParallel``
    with its contiguous gradient buffer and ``FP32Optimizer``/``Float16OptimizerWithFloat16Params``;
    allocator overhead and communication buffers are not counted."""
    import torch

    half = args.params_dtype in (torch.float16, torch.bfloat16)
    weight = 2 if half else 4
    grad = 4 if not half or args.accumulate_allreduce_grads_in_fp32 else 2
    master = 4 if half else 0
    sgd = 4 if getattr(args, "sgd_momentum", 0) else 0
    moments = sgd if args.optimizer == "sgd" else 8  # Adam; the other optimizers counted as Adam
    shard = args.data_parallel_size if args.use_distributed_optimizer else 1
    return int(params * (weight + grad) + params * (master + moments) / shard)
