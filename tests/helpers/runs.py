"""In-process runs of Megatron-LM's own ``pretrain()`` for tests: losses and gradients per variant.

Meant to be the ``fn`` of :func:`megatron_oases.launch.run_distributed` (the default gloo group is
already up; Megatron's ``initialize_megatron`` keeps it). Several variants run one after another in
the same processes (:func:`megatron_oases.training.pretrain.run_in_process` tears Megatron's global
state and the patches down after each), so each variant is a fresh Megatron job apart from the
process start-up.

Per iteration the loss is what Megatron's ``train_step`` returns (reduced over micro-batches and
data-parallel ranks, last pipeline stage); gradients are read from DDP's ``main_grad`` buffers at
the first ``optimizer.step()``, i.e. after ``finalize_model_grads`` and before clipping.
"""

import os
import shlex

import torch

from megatron_oases.arguments import parse_args_and_config, parse_megatron_args, with_defaults
from megatron_oases.layer_degrees.shards import full_tensor, global_param_names
from megatron_oases.patching import Patch
from megatron_oases.training.pretrain import run_in_process


def parse(argv, world_size=None, demo=True):
    """Megatron's parsed and validated args for ``argv`` (no global state is set)."""
    if isinstance(argv, str):
        argv = shlex.split(argv)
    return parse_megatron_args(with_defaults(argv, demo=demo), prog="test", world_size=world_size)


def parse_config(argv, world_size=None, demo=True):
    """The checked :class:`~megatron_oases.config.OasesConfig` for ``argv`` (no global state)."""
    if isinstance(argv, str):
        argv = shlex.split(argv)
    argv = with_defaults(argv, demo=demo)
    return parse_args_and_config(argv, prog="test", world_size=world_size)[1]


def _capture_patch(record, grads):
    """Wrap ``train_step`` (by name in ``megatron.training.training``) to record its results."""
    from megatron.training import training
    from torch.distributed.tensor import DTensor

    original = training.train_step

    def capture_grads(model):
        out = {}
        for chunk in model:
            module = chunk.module if hasattr(chunk, "module") else chunk
            for name, p in global_param_names(module):
                g = getattr(p, "main_grad", None)
                g = (g if g is not None else p.grad).detach()
                if isinstance(g, DTensor):  # --use-torch-fsdp2: this rank's shard of the average
                    g = g.full_tensor()
                g = g.clone()
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


def with_data_cache(argv):
    """``argv`` (a string or a list) with Megatron's own ``--data-cache-path`` where it uses
    ``--mock-data``: the mock dataset's shuffled indices (about two million samples per split at
    the tests' sequence lengths, 1.5 s per run) are built once per test session and loaded by every
    later run of the same shape. ``OASES_TEST_DATA_CACHE`` (set by ``tests/conftest.py``) names it.
    """
    cache = os.environ.get("OASES_TEST_DATA_CACHE")
    flags = argv.split() if isinstance(argv, str) else list(argv)
    if not cache or "--mock-data" not in flags or "--data-cache-path" in flags:
        return argv
    extra = ["--data-cache-path", cache]
    return f"{argv} {' '.join(extra)}" if isinstance(argv, str) else flags + extra


def cache_megatron_field_docstrings():
    """Megatron's argument parser re-reads and re-parses the source of each of its config
    dataclasses on every parse, for the help texts (``ArgumentGroupFactory._get_field_docstrings``:
    ~0.45 s a parse, two parses a run). A test process runs many: keep them per class (the sources
    do not change while it runs). Idempotent; nothing else changes."""
    from megatron.training.argument_utils import ArgumentGroupFactory

    original = ArgumentGroupFactory._get_field_docstrings
    if getattr(original, "cached_for_tests", False):
        return
    cache = {}

    def get_field_docstrings(self, src_cfg_class):
        if src_cfg_class not in cache:
            cache[src_cfg_class] = original(self, src_cfg_class)
        return dict(cache[src_cfg_class])

    get_field_docstrings.cached_for_tests = True
    ArgumentGroupFactory._get_field_docstrings = get_field_docstrings


def prepared(argv):
    """``argv`` as every in-process test run takes it: Megatron's parser with its dataclass
    docstrings cached (:func:`cache_megatron_field_docstrings`) and the session's mock-data cache
    (:func:`with_data_cache`). Together ~1.3 s of a ~2.6 s run on each rank (two parses a run,
    three splits' shuffled indices)."""
    cache_megatron_field_docstrings()
    return with_data_cache(argv)


def activation_peaks(configs):
    """:func:`megatron_oases.training.measure.activation_peaks` of ``configs`` run as
    :func:`prepared` (a :func:`~megatron_oases.launch.run_distributed` worker). The metered region
    is one training step: neither cache is inside it."""
    from megatron_oases.training import measure

    return measure.activation_peaks([(name, prepared(argv)) for name, argv in configs])


def pretrain_and_capture(argv, grads=False, demo=True):
    """Run Megatron's ``pretrain()`` on ``argv``; return {'losses', 'grads', 'installed',
    'exit_code', 'compiled_graphs'}. ``grads=True`` captures this rank's shards; ``grads="full"``
    all-gathers every gradient to its full tensor (to compare different TP layouts or per-layer
    plans). ``compiled_graphs``: graphs ``torch.compile`` built in this process so far (0 where
    the suite runs Megatron's fused functions eagerly, see ``tests/conftest.py``)."""
    from torch._dynamo.utils import counters

    record = {"losses": []}
    patches = [_capture_patch(record, grads)]
    record.update(run_in_process(prepared(argv), demo=demo, extra_patches=patches))
    record.setdefault("grads", {})
    record["compiled_graphs"] = counters["stats"]["unique_graphs"]
    return record


def variants_worker(base, variants, grads=True):
    """Run each (name, extra flags) variant of ``base`` in turn in this process group."""
    return {name: pretrain_and_capture(f"{base} {extra}", grads=grads) for name, extra in variants}


def max_rel_diff(a, b):
    a, b = torch.as_tensor(a, dtype=torch.float64), torch.as_tensor(b, dtype=torch.float64)
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-12)).item()


def assert_matches(got, ref, what, tol=1e-5):
    """``got``'s loss (where this rank has one: the last pipeline stage) and every gradient within
    ``tol`` of ``ref``'s, relative to the largest magnitude; returns the worst difference."""
    worst = 0.0
    if ref["losses"][0] is not None:
        worst = max_rel_diff(got["losses"], ref["losses"])
        assert worst < tol, (what, got["losses"], ref["losses"])
    assert set(got["grads"]) == set(ref["grads"]) and ref["grads"], what
    for pname, g in ref["grads"].items():
        err = max_rel_diff(got["grads"][pname], g)
        assert err < tol, f"{what} {pname}: rel err {err:.2e}"
        worst = max(worst, err)
    return worst


def assert_schedules_match_stock(results, what, nonzero=True):
    """Per rank of ``variants_worker`` results over :data:`helpers.variants.SCHEDULE_VARIANTS`:
    stock ran unpatched, every split schedule under the ``oases-schedule`` patch, two losses each,
    (``nonzero``) stock's gradients non-trivial (biases aside; an untied embedding shard that no
    token of a tiny batch hits has none), and loss and every gradient of each schedule within
    :func:`assert_matches`'s tolerance of stock's. Returns the worst difference."""
    from megatron_oases.validation import SPLIT_SCHEDULES

    worst = 0.0
    for rank, res in enumerate(results):
        stock = res["stock"]
        assert stock["installed"] == []
        for pname, g in stock["grads"].items():
            assert not nonzero or torch.count_nonzero(g) > 0 or "bias" in pname, pname
        for name in SPLIT_SCHEDULES:
            got = res[name]
            assert got["installed"] == ["oases-schedule"]
            assert len(got["losses"]) == len(stock["losses"]) == 2
            worst = max(worst, assert_matches(got, stock, f"{what} {name} rank {rank}"))
    print(f"{what}: worst relative difference (loss and gradients) {worst:.2e}")
    return worst
