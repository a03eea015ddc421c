"""In-process runs of Megatron-LM's own ``pretrain()`` for tests: losses and gradients per variant.

Meant to be the ``fn`` of :func:`run_distributed` (the default gloo group is already up; Megatron's
``initialize_megatron`` keeps it). Several variants run one after another in the same processes:
after each, Megatron's global state and the patches are torn down
(``megatron.training.training.destroy_global_state``), so each variant is a fresh Megatron job
apart from the process start-up.

Per iteration the loss is what Megatron's ``train_step`` returns (reduced over micro-batches and
data-parallel ranks, last pipeline stage); gradients are read from DDP's ``main_grad`` buffers at
the first ``optimizer.step()``, i.e. after ``finalize_model_grads`` and before clipping.
"""

import shlex

import torch


def parse(argv, world_size=None, demo=True):
    """Megatron's parsed and validated args for ``argv`` (no global state is set)."""
    from ..arguments import parse_megatron_args, with_defaults

    if isinstance(argv, str):
        argv = shlex.split(argv)
    return parse_megatron_args(with_defaults(argv, demo=demo), prog="test", world_size=world_size)


def _capture_patch(record, grads):
    """Wrap ``train_step`` (by name in ``megatron.training.training``) to record its results."""
    from megatron.training import training

    from ..hetero.shards import full_tensor, global_param_names
    from ..patches.registry import Patch

    original = training.train_step

    def capture_grads(model):
        out = {}
        for chunk in model:
            module = chunk.module if hasattr(chunk, "module") else chunk
            for name, p in global_param_names(module):
                g = getattr(p, "main_grad", None)
                g = (g if g is not None else p.grad).detach().clone()
                out[name] = full_tensor(g, p, name, module.config) if grads == "full" else g
        return out

    def train_step(forward_step_func, data_iterator, model, optimizer, *rest, **kwargs):
        if grads and "grads" not in record:
            step = optimizer.step

            def step_capturing():
                record["grads"] = capture_grads(model)
                return step()

            optimizer.step = step_capturing
            try:
                out = original(forward_step_func, data_iterator, model, optimizer, *rest, **kwargs)
            finally:
                optimizer.step = step
        else:
            out = original(forward_step_func, data_iterator, model, optimizer, *rest, **kwargs)
        loss = out[0].get("lm loss") if out[0] else None
        record["losses"].append(
            None if loss is None else float(torch.as_tensor(loss).reshape(-1)[0])
        )
        return out

    return Patch("test-capture", [(training, "train_step", train_step)])


def pretrain_and_capture(argv, grads=False, demo=True):
    """Run Megatron's ``pretrain()`` on ``argv``; return {'losses', 'grads', 'installed'}.

    ``grads=True`` captures this rank's shards; ``grads="full"`` all-gathers every gradient to its
    full tensor (to compare different TP layouts or per-layer plans).
    """
    import torch.distributed as dist
    from megatron.training.training import destroy_global_state

    from .. import patches, platform
    from ..arguments import parse_megatron_args, with_defaults
    from ..training.pretrain import pretrain_gpt

    if isinstance(argv, str):
        argv = shlex.split(argv)
    if "--num-workers" not in argv:  # no data-loader processes inside spawned test ranks
        argv += ["--num-workers", "0"]
    platform.install_cpu_shims()
    args = parse_megatron_args(
        with_defaults(argv, demo=demo),
        prog="test",
        world_size=dist.get_world_size(),
        set_globals=True,
    )
    record = {"losses": []}
    capture = _capture_patch(record, grads)
    capture.install()
    record["exit_code"] = None
    try:
        try:
            pretrain_gpt(args)
        except SystemExit as exc:  # --exit-interval & co. end the job with sys.exit
            record["exit_code"] = exc.code
            if exc.code not in (0, None):
                raise
        record["installed"] = patches.installed()
    finally:
        capture.uninstall()
        patches.uninstall_all()
        destroy_global_state()
    record.setdefault("grads", {})
    return record


def variants_worker(base, variants, grads=True):
    """Run each (name, extra flags) variant of ``base`` in turn in this process group."""
    return {name: pretrain_and_capture(f"{base} {extra}", grads=grads) for name, extra in variants}


def max_rel_diff(a, b):
    a, b = torch.as_tensor(a, dtype=torch.float64), torch.as_tensor(b, dtype=torch.float64)
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-12)).item()


def _meter_patch(record, at_call=2):
    """Wrap ``train_step`` so that its ``at_call``-th call runs its forward+backward (Megatron's
    ``forward_backward_func``: the schedule, the losses and ``finalize_model_grads``) inside a
    :class:`LiveTensorMeter`; the peak goes to ``record['peak']``. Gradient-buffer zeroing before it
    and the optimizer step after it are outside the metered region."""
    from megatron.training import training

    from ..instrument.memory import LiveTensorMeter
    from ..patches.registry import Patch

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

    return Patch("test-activation-meter", [(training, "train_step", train_step)])


def activation_peaks(configs):
    """``{name: bytes}``: the :class:`LiveTensorMeter` peak of the forward+backward of the second
    iteration (the first warms up lazy buffers and creates the optimizer state) of Megatron's
    ``pretrain()`` per ``(name, argv)`` — activations, temporaries and in-flight gradients;
    parameters, optimizer state and gradient buffers exist before and are not counted. A
    ``run_distributed`` worker, like the planner's memory model it is compared with: per rank."""
    peaks = {}
    for name, argv in configs:
        argv = shlex.split(argv) if isinstance(argv, str) else list(argv)
        if "--train-iters" not in argv:
            argv += ["--train-iters", "2"]
        record = {}
        meter = _meter_patch(record)
        meter.install()
        try:
            pretrain_and_capture(argv)
        finally:
            meter.uninstall()
        if "peak" not in record:
            raise RuntimeError(f"{name}: fewer than two iterations ran; nothing was metered")
        peaks[name] = record["peak"]
    return peaks
