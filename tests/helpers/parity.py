"""Parity runs that record every iteration, not only the first: per iteration the loss, every
gradient and the parameters the iteration's forward used (for data parallelism with Megatron's
distributed optimizer and overlapped gradient reduce / parameter gather, where what happens
between steps is what is under test).

Like :mod:`helpers.runs`, meant to be the ``fn`` of :func:`megatron_oases.launch.run_distributed`:
each ``(name, flags)`` variant is one Megatron-LM ``pretrain()`` job in the same spawned gloo ranks
(:func:`megatron_oases.training.pretrain.run_in_process` tears it down after).

What is read, at each ``optimizer.step()`` (after ``finalize_model_grads``: every overlapped
reduce-scatter has finished; before clipping and the update):

* ``grads``: each parameter's DDP ``main_grad`` on this rank (fp32 also under ``--bf16``). With
  ``--use-distributed-optimizer`` the reduce-scatter writes the data-parallel average into this
  rank's shard of the bucket in place; the rest of the bucket keeps this rank's own (pre-scaled)
  local gradient. Both are compared, and every element is some rank's shard, so over the ranks
  every reduced gradient and every local one is checked.
* ``params``: the parameters (this rank's tensor-parallel shard), i.e. what this iteration's
  forward used: with ``--overlap-param-gather`` the previous step's all-gather finishes inside the
  forward (DDP's forward pre-hooks), so by the step every bucket is gathered. Iteration 1's are the
  initial weights; iteration k's the result of step k-1.
"""

import time

import torch

from megatron_oases.layer_degrees.shards import global_param_names
from megatron_oases.patching import Patch
from megatron_oases.training.pretrain import run_in_process

from .runs import prepared


def _modules(model):
    """The model chunks without their wrappers (DDP, and ``Float16Module`` under ``--bf16``)."""
    for chunk in model:
        while hasattr(chunk, "module"):
            chunk = chunk.module
        yield chunk


def _snapshot(model):
    grads, params = {}, {}
    for module in _modules(model):
        for name, p in global_param_names(module):
            g = getattr(p, "main_grad", None)
            grads[name] = (g if g is not None else p.grad).detach().float().clone()
            params[name] = p.detach().float().clone()
    return grads, params


def _steps_patch(record):
    """Wrap ``train_step`` (by name in ``megatron.training.training``) to record every iteration."""
    from megatron.training import training

    original = training.train_step

    def train_step(forward_step_func, data_iterator, model, optimizer, *rest, **kwargs):
        step = optimizer.step

        def step_capturing():
            grads, params = _snapshot(model)
            record["grads"].append(grads)
            record["params"].append(params)
            return step()

        optimizer.step = step_capturing
        try:
            out = original(forward_step_func, data_iterator, model, optimizer, *rest, **kwargs)
        finally:
            optimizer.step = step
        loss = out[0].get("lm loss") if out[0] else None
        record["losses"].append(
            None if loss is None else float(torch.as_tensor(loss).reshape(-1)[0])
        )
        return out

    return Patch("test-capture-steps", [(training, "train_step", train_step)])


def steps_worker(base, variants):
    """Run each ``(name, extra flags)`` variant of ``base`` in turn in this process group; per
    variant ``{'losses': [per iteration], 'grads': [per iteration {name: tensor}], 'params': [...],
    'installed': patch names, 'seconds': wall time of the job}``."""
    out = {}
    for name, extra in variants:
        record = {"losses": [], "grads": [], "params": []}
        t0 = time.monotonic()
        argv = prepared(f"{base} {extra}")
        record.update(run_in_process(argv, extra_patches=[_steps_patch(record)]))
        record["seconds"] = time.monotonic() - t0
        out[name] = record
    return out


def rel_diff(a, b):
    """Largest absolute difference of ``a`` from ``b``, relative to ``b``'s largest magnitude."""
    a, b = torch.as_tensor(a, dtype=torch.float64), torch.as_tensor(b, dtype=torch.float64)
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item()


def norm_diff(a, b):
    """``‖a - b‖ / ‖b‖`` (Frobenius)."""
    a, b = a.to(torch.float64), b.to(torch.float64)
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def diffs(got, ref):
    """Per iteration, how far ``got`` is from ``ref``: ``loss`` (``|Δ|/|ref|``; None where this
    rank has no loss), ``grads`` / ``params`` (the worst parameter's :func:`rel_diff`: elementwise,
    relative to the tensor's largest element), ``grads_norm`` / ``params_norm`` (the worst
    :func:`norm_diff`), and ``where``: the parameter behind each worst value."""
    assert len(got["losses"]) == len(ref["losses"]) == len(got["grads"]) == len(ref["grads"])
    out = []
    for it, loss in enumerate(ref["losses"]):
        d = {"loss": None if loss is None else abs(got["losses"][it] - loss) / abs(loss)}
        d["where"] = {}
        for kind in ("grads", "params"):
            g_it, r_it = got[kind][it], ref[kind][it]
            assert set(g_it) == set(r_it) and r_it, (kind, it)
            for metric, fn in ((kind, rel_diff), (kind + "_norm", norm_diff)):
                d[metric] = 0.0
                for pname, r in r_it.items():
                    x = fn(g_it[pname], r)
                    if x >= d[metric]:
                        d[metric], d["where"][metric] = x, pname
        out.append(d)
    return out
