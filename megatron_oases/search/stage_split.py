"""Uneven pipeline stage splits (``--decoder-first-pipeline-num-layers`` /
``--decoder-last-pipeline-num-layers``) for ``oases plan --gpus``.

The chain model (:mod:`..planner.build`) costs one stage of ``num_layers / P`` layers and charges
it both ends of the model (embedding, output layer and loss), which is exact for P = 1 and the even
split's bottleneck otherwise. Here each stage gets only its own end: the first the embedding, the
last the output layer and loss, so moving layers off the last stage (a large vocabulary) or off
the first (which holds P micro-batches of activations in 1F1B) can shorten the iteration or fit
memory. 1F1B over stages of per-micro-batch times t_s takes ``Σ_s t_s + (M − 1)·max_s t_s``; each
rank's host issues its own stage (the busiest sets the host timeline); the data-parallel
gradient all-reduce of the largest stage is exposed. A split's time is reported relative to the
even split under the same composition, so candidates stay comparable with the chain model's.
The stage-to-stage sends are in every stage's time (the chain model's ``pipeline_p2p``).
"""

import functools
from dataclasses import replace

from ..errors import OasesConfigError
from ..planner.api import host_term
from ..planner.build import build_problem
from ..planner.time_model import evaluate


def stage_splits(total_layers, pp, spread=None):
    """``(first, middle, last)`` layer counts Megatron can run on ``pp`` stages: the middle stages
    even (``middle`` per stage; 0 when pp = 2), every stage at least one layer. ``spread``: only
    first/last within that many layers of the even split's (None: all)."""
    if pp < 2:
        return []
    even = total_layers / pp
    out = []
    for first in range(1, total_layers):
        for last in range(1, total_layers - first + 1):
            rest = total_layers - first - last
            if pp == 2:
                if rest:
                    continue
                middle = 0
            elif rest <= 0 or rest % (pp - 2):
                continue
            else:
                middle = rest // (pp - 2)
            if spread is not None and (abs(first - even) > spread or abs(last - even) > spread):
                continue
            out.append((first, middle, last))
    return out


def split_flags(first, middle, last, total_layers, pp):
    """Megatron's flags for a split ('' for the even one)."""
    if first == last == total_layers // pp and (pp == 2 or middle == first):
        return ""
    return f"--decoder-first-pipeline-num-layers {first} --decoder-last-pipeline-num-layers {last}"


class StageCosts:
    """Per-micro-batch device time, host time per iteration and peak memory of one stage of
    ``n`` layers at stage index ``s``, for one candidate's setting at a uniform degree."""

    def __init__(self, profile, setting, common, micro_batch, grad_sync):
        self.profile, self.setting, self.common = profile, setting, common
        self.micro_batch, self.grad_sync = micro_batch, grad_sync
        self.pp = int(profile.data.get("pipeline_model_parallel_size", 1))
        self._cost = functools.lru_cache(maxsize=None)(self._stage)

    def _stage(self, n, s):
        s_ = self.setting
        setting = replace(
            self.common,
            schedule=s_["schedule"],
            recompute=s_["recompute"],
            recompute_layers=s_.get("recompute_num_layers"),
            split=s_.get("split", "batch"),
            micro_batch_size=self.micro_batch,
            degrees=[self.profile.tp],
            grad_sync=self.grad_sync,
        )
        # a chain of n layers
        problem = build_problem(self.profile, setting, num_layers=n * self.pp, stage=s)
        ks = [0] * n
        res = evaluate(problem, ks)
        r = problem.repeats
        # per micro-batch: both ends and the stage-to-stage sends (every stage pays those)
        p2p = problem.meta.get("pipeline_p2p_s", 0.0)
        ends = problem.fixed_forward_s + problem.fixed_backward_s - p2p
        layers = (res["forward_s"] + res["backward_s"] + res["edges_s"]) / r - ends
        output = (
            self.profile.fixed_compute("forward") + self.profile.fixed_compute("backward")
        ) * self.micro_batch
        embedding = (ends - output) / 2  # the two ends' TMP reductions: one each
        own = embedding if s == 0 else 0.0
        own += output + embedding if s == self.pp - 1 else 0.0
        host = host_term(self.profile, problem, setting.host_us_per_call)
        return {
            "device_s": layers + own,
            "host_s": host["issue_s"] if host else 0.0,
            "grad_sync_s": res["grad_sync_s"] if problem.include_grad_sync else 0.0,
            "peak_bytes": problem.peak_memory_bytes(ks),
            "budget_bytes": problem.budget_bytes,
            "microbatches": problem.meta["num_microbatches"],
        }

    def iteration(self, first, middle, last):
        """``(seconds, peak bytes of the fullest stage, fits)`` of a split."""
        counts = [first] + [middle] * (self.pp - 2) + [last]
        stages = [self._cost(n, s) for s, n in enumerate(counts)]
        M = stages[0]["microbatches"]
        t = [st["device_s"] for st in stages]
        device = sum(t) + (M - 1) * max(t) + max(st["grad_sync_s"] for st in stages)
        host = max(st["host_s"] for st in stages)
        peak = max(st["peak_bytes"] for st in stages)
        fits = all(st["peak_bytes"] <= st["budget_bytes"] for st in stages)
        return max(device, host), peak, fits


def best_split(profile, setting, common, micro_batch, grad_sync, total_layers, spread=None):
    """The fastest split that fits, as ``{'split': (first, middle, last), 'ratio': its time ÷ the
    even split's, 'peak_bytes', 'flags'}``; None without pipeline parallelism or when the even
    split is best."""
    costs = StageCosts(profile, setting, common, micro_batch, grad_sync)
    pp = costs.pp
    if pp < 2 or total_layers % pp:
        return None
    even = total_layers // pp
    try:
        base, _, _ = costs.iteration(even, even if pp > 2 else 0, even)
    except OasesConfigError:
        return None
    best = None
    for split in stage_splits(total_layers, pp, spread):
        try:
            t, peak, fits = costs.iteration(*split)
        except OasesConfigError:
            continue
        if fits and (best is None or t < best[0] - 1e-12):
            best = (t, peak, split)
    if best is None or not split_flags(*best[2], total_layers, pp):
        return None
    t, peak, split = best
    if t >= base:
        return None
    return {
        "split": split,
        "ratio": t / base,
        "peak_bytes": peak,
        "flags": split_flags(*split, total_layers, pp),
    }
