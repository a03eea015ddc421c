"""``--log-json``: Megatron functional-test golden values, recorded from Megatron-LM's own loop.

Shape: ``{"lm loss": {"start_step", "end_step", "step_interval", "values"}, "iteration-time",
"tokens-per-sec", "throughput", "mem-allocated-bytes"}`` with one value per iteration (Megatron's
console line shows a running mean over the log interval; golden values are per iteration); under
``--oases-schedule auto`` also ``"oases-autotune"``: the choice, its flags, the trial's table. The
patch wraps ``megatron.training.training.train_step`` (timed on the host, after a barrier-free
``torch.cuda.synchronize``) and ``training_log`` (this iteration's reduced ``lm loss``). The last
rank writes; the file is rewritten after every iteration so a run cut short keeps what it reached.
:func:`read_golden` reads the file back (``oases compare``, the launch scripts' summary table).

torch and Megatron are imported by the patch only, so reading the file does not import them.
"""

import json
import os
import time

from ..compat import require_symbol
from ..patching import Patch

KEYS = ("lm loss", "iteration-time", "tokens-per-sec", "throughput", "mem-allocated-bytes")


def read_golden(path):
    """The golden values written to ``path`` (the dict above); a missing or unreadable file raises
    :class:`OSError`, malformed JSON :class:`ValueError`."""
    with open(path) as f:
        return json.load(f)


class GoldenValuesRecorder:
    def __init__(self, path):
        self.path = path
        self.steps = []
        self.values = {k: [] for k in KEYS}
        #: Entries beside the series, written with them (``oases-autotune``: the choice and the
        #: table of ``--oases-schedule auto``, :mod:`megatron_oases.tuning.runtime`).
        self.extra = {}

    def record(self, iteration, **values):
        self.steps.append(int(iteration))
        for key in KEYS:
            self.values[key].append(values.get(key))

    def as_dict(self):
        if not self.steps:
            return dict(self.extra)
        start, end = self.steps[0], self.steps[-1]
        interval = self.steps[1] - self.steps[0] if len(self.steps) > 1 else 1
        series = {
            key: {"start_step": start, "end_step": end, "step_interval": interval, "values": vals}
            for key, vals in self.values.items()
            if any(v is not None for v in vals)
        }
        return {**series, **self.extra}

    def write(self):
        os.makedirs(os.path.dirname(os.path.abspath(self.path)) or ".", exist_ok=True)
        tmp = f"{self.path}.tmp"
        with open(tmp, "w") as f:
            json.dump(self.as_dict(), f, indent=1)
        os.replace(tmp, self.path)


def _scalar(value):
    import torch

    if value is None:
        return None
    if isinstance(value, torch.Tensor):
        value = value.detach().float().reshape(-1)
        return value[0].item() if value.numel() else None
    if isinstance(value, (list, tuple)):
        return _scalar(value[0]) if value else None
    return float(value)


def _is_last_rank():
    """The rank Megatron logs the loss on; on a fake process group (one-rank runs) the one rank
    there is, as in Megatron's ``print_rank_last``."""
    import torch.distributed as dist

    if not dist.is_initialized() or dist.get_backend() == "fake":
        return True
    return dist.get_rank() == dist.get_world_size() - 1


def make_recorder(config):
    """The run's :class:`GoldenValuesRecorder` iff ``--log-json PATH``, else None."""
    return GoldenValuesRecorder(config.log_json) if config.log_json else None


def make_patch(config, recorder):
    """``golden-values`` recording into ``recorder`` (:func:`make_recorder`) iff ``--log-json
    PATH``."""
    if not config.log_json:
        return None
    import torch
    from megatron.training import training

    orig_step = require_symbol(training, "train_step", called_by=[training.train])
    orig_log = require_symbol(training, "training_log", called_by=[training.train])
    state = {"elapsed": None}

    def train_step(*a, **k):
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        out = orig_step(*a, **k)
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        state["elapsed"] = time.perf_counter() - t0
        return out

    def training_log(loss_dict, total_loss_dict, learning_rate, iteration, *rest, **kwargs):
        result = orig_log(loss_dict, total_loss_dict, learning_rate, iteration, *rest, **kwargs)
        loss = _scalar((loss_dict or {}).get("lm loss"))
        if _is_last_rank() and loss is not None and state["elapsed"]:
            from megatron.training import get_args

            margs = get_args()
            elapsed = state["elapsed"]
            batch = margs.global_batch_size
            flops = training.num_floating_point_operations(margs, batch)
            mem = torch.cuda.memory_allocated() if torch.cuda.is_available() else None
            recorder.record(
                iteration,
                **{
                    "lm loss": loss,
                    "iteration-time": elapsed,
                    "tokens-per-sec": batch * margs.seq_length / elapsed,
                    "throughput": flops / (elapsed * 1e12 * margs.world_size),
                    "mem-allocated-bytes": mem,
                },
            )
            recorder.write()
        return result

    return Patch(
        "golden-values",
        [(training, "train_step", train_step), (training, "training_log", training_log)],
    )
