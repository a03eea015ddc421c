"""What the tests run in process: Megatron's parse of a command line (:func:`parse`,
:func:`parse_config`) and the comparisons of variants' losses and gradients (:func:`assert_matches`,
:func:`assert_schedules_match_stock`).

The runs themselves (:func:`prepared`, :func:`pretrain_and_capture`, :func:`variants_worker`,
:func:`max_rel_diff`, ...) live in :mod:`megatron_oases.training.inprocess`, which the GPU check
(``benchmarks/gpu/``) imports too; they are re-exported here under their old names.
"""

import shlex

import torch

from megatron_oases.arguments import parse_args_and_config, parse_megatron_args, with_defaults
from megatron_oases.training.inprocess import (  # noqa: F401  (re-exported for tests)
    cache_megatron_field_docstrings,
    max_rel_diff,
    prepared,
    pretrain_and_capture,
    variants_worker,
    with_data_cache,
)


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


def activation_peaks(configs):
    """:func:`megatron_oases.training.measure.activation_peaks` of ``configs`` run as
    :func:`prepared` (a :func:`~megatron_oases.launch.run_distributed` worker). The metered region
    is one training step: neither cache is inside it."""
    from megatron_oases.training import measure

    return measure.activation_peaks([(name, prepared(argv)) for name, argv in configs])


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


def assert_split_schedules_agree_with_dropout(runs, off, tol=1e-5):
    """With dropout the split schedules draw other masks than stock: ``cross-pass-drop`` and
    ``oases-drop`` against ``overlap-drop`` on every rank, and ``overlap-drop``'s losses other than
    the dropout-off run ``off``'s where a rank has losses (a pipeline's last stage), so the dropout
    is on."""
    with_losses = [res for res in runs if res["overlap-drop"]["losses"][0] is not None]
    assert with_losses and all(
        res["overlap-drop"]["losses"] != res[off]["losses"] for res in with_losses
    )
    for rank, res in enumerate(runs):
        for name in ("cross-pass-drop", "oases-drop"):
            assert_matches(res[name], res["overlap-drop"], f"{name} rank {rank}", tol)


def split_bf16_worst(runs, schedules, loss_tol, grads_tol, first_loss_tol=None):
    """Each schedule's ``<s>-bf16`` run against ``stock-bf16``: two losses, within ``loss_tol``
    (the first within ``first_loss_tol`` if given) where a rank has losses, every gradient within
    ``grads_tol``; returns the worst gradient difference."""
    worst = 0.0
    for rank, res in enumerate(runs):
        ref = res["stock-bf16"]
        for s in schedules:
            got, what = res[f"{s}-bf16"], f"{s}-bf16 rank {rank}"
            assert len(got["losses"]) == 2, what
            if ref["losses"][0] is not None:
                if first_loss_tol is not None:
                    assert max_rel_diff(got["losses"][:1], ref["losses"][:1]) < first_loss_tol, what
                assert max_rel_diff(got["losses"], ref["losses"]) < loss_tol, what
            worst = max(worst, assert_matches(got, {**ref, "losses": [None]}, what, grads_tol))
    return worst
