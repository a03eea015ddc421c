"""In-process training runs for tests: parse ``oases train`` flags, train, return losses/gradients.

Meant to be the ``fn`` of :func:`run_distributed` (the default process group is already up).
"""

import shlex

import torch


def parse(argv, world_size=None):
    from ..arguments import build_parser, validate_args

    if isinstance(argv, str):
        argv = shlex.split(argv)
    args = build_parser().parse_args(argv)
    return validate_args(args, world_size=world_size)


def train_and_capture(argv, iters=None, grads=False, step=True):
    """Train; return {'losses': [...], 'grads': {global param name: grad}}.

    ``grads=True`` captures this rank's shards; ``grads="full"`` gathers every gradient to its
    full, unsharded tensor (for comparing different TP layouts or per-layer plans).

    With ``step=False`` only forward/backward runs for the first iteration (gradients of the
    initial weights), which is what gradient parity needs.
    """
    import torch.distributed as dist

    from .. import patches
    from ..training.initialize import initialize_distributed
    from ..training.loop import Trainer
    from ..training.model import full_tensor, global_param_names

    args = parse(argv, world_size=dist.get_world_size())
    initialize_distributed(args)
    installed = patches.install_from_args(args)
    try:
        trainer = Trainer(args)
        losses, captured = [], {}
        for _ in range(iters or args.train_iters):
            if step:
                losses.append(trainer.train_step())
            else:
                losses.append(_forward_backward(trainer))
                break
        if grads:
            for name, p in global_param_names(trainer.module):
                g = getattr(p, "main_grad", None)
                g = (g if g is not None else p.grad).detach().clone()
                captured[name] = full_tensor(g, p, name) if grads == "full" else g
        return {"losses": losses, "grads": captured, "installed": installed}
    finally:
        patches.uninstall_all()


def _forward_backward(trainer):
    """Forward+backward of iteration 0 without the optimizer step (grads stay in main_grad)."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from ..training.data import mock_data_iterator

    args = trainer.args
    trainer.model.zero_grad_buffer()
    losses = get_forward_backward_func()(
        forward_step_func=trainer._forward_step,
        data_iterator=mock_data_iterator(args, 0),
        model=[trainer.model],
        num_microbatches=args.num_microbatches,
        seq_length=args.seq_length,
        micro_batch_size=args.micro_batch_size,
        forward_only=False,
    )
    return trainer._reduce_loss(losses)


def max_rel_diff(a, b):
    a, b = torch.as_tensor(a, dtype=torch.float64), torch.as_tensor(b, dtype=torch.float64)
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-12)).item()


def activation_peaks(configs):
    """``{name: bytes}``: the :class:`LiveTensorMeter` peak of one forward+backward (after a warm-up
    one) per ``(name, argv)`` — activations, temporaries and in-flight gradients; parameters,
    optimizer state and gradient buffers exist before and are not counted. A ``run_distributed``
    worker, like the planner's memory model it is compared with: per rank."""
    from .. import patches
    from ..schedule.memory import LiveTensorMeter
    from ..training.initialize import initialize_distributed
    from ..training.loop import Trainer

    peaks = {}
    for name, argv in configs:
        args = parse(argv, world_size=torch.distributed.get_world_size())
        initialize_distributed(args)
        patches.install_from_args(args)
        try:
            trainer = Trainer(args)
            _forward_backward(trainer)  # warm-up (lazy buffers, caches)
            meter = LiveTensorMeter()
            with meter:
                _forward_backward(trainer)
            peaks[name] = meter.peak_bytes
        finally:
            patches.uninstall_all()
    return peaks
