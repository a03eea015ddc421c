"""No ``--oases-*`` flag is accepted where it does nothing (issue 60.5): each is refused in one
line naming the flag that would make it act, and accepted where it acts (a split-only flag under
``auto``, which may choose a split schedule; ``--oases-trace`` under every schedule)."""

import argparse

import pytest
from helpers import GPT, RECOMPUTE
from helpers.runs import parse, parse_config

from megatron_oases.arguments import add_oases_args
from megatron_oases.errors import OasesConfigError
from megatron_oases.validation import ACT_ALWAYS, ACT_WHEN

TP2 = GPT.format(layers=2) + "--tensor-model-parallel-size 2 --global-batch-size 4 "


@pytest.mark.parametrize(
    "flags,match",
    [
        # split-only flags under the default --oases-schedule off (issue 60.5: trained stock)
        (
            "--micro-batch-size 4 --oases-sub-batches 3",
            "--oases-sub-batches 3 has no effect under --oases-schedule off: it sets the split "
            "schedules' sub-batches per micro-batch; add --oases-schedule overlap \\(or "
            "cross-pass, oases, auto\\) or drop --oases-sub-batches",
        ),
        ("--micro-batch-size 4 --oases-sub-batches 2", "--oases-sub-batches 2 has no effect"),
        (
            "--micro-batch-size 1 --oases-split sequence",
            "--oases-split sequence has no effect under --oases-schedule off: .*add "
            r"--oases-schedule overlap \(or cross-pass, oases, auto\) or drop --oases-split",
        ),
        (
            "--oases-cuda-graphs eager",
            "--oases-cuda-graphs eager has no effect under --oases-schedule off: .*add "
            "--oases-schedule overlap",
        ),
        # auto's flags without auto
        (
            "--oases-schedule overlap --oases-tune-steps 8",
            "--oases-tune-steps 8 has no effect under --oases-schedule overlap: .*add "
            "--oases-schedule auto or drop --oases-tune-steps",
        ),
        ("--oases-retune", "--oases-retune has no effect under --oases-schedule off"),
        (
            RECOMPUTE + "--oases-schedule oases --oases-retune-interval 20",
            "--oases-retune-interval 20 has no effect under --oases-schedule oases",
        ),
        # --oases-retune acts on a resumed run only
        (
            "--oases-schedule auto --oases-retune",
            "--oases-retune has no effect without --load: .*; add --load DIR .*or drop "
            "--oases-retune",
        ),
        # --oases-start-over acts on a --save directory the run does not resume from
        (
            "--oases-start-over",
            "--oases-start-over has no effect without --save: .*add --save DIR",
        ),
        (
            "--oases-start-over --save /tmp/x --load /tmp/x/",
            "--oases-start-over has no effect with --load the same directory as --save",
        ),
    ],
)
def test_a_flag_that_does_nothing_here_is_one_line(flags, match):
    with pytest.raises(OasesConfigError, match=match) as err:
        parse(TP2 + flags + " --train-iters 400", 2)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize(
    "flags",
    [
        # auto may choose a split schedule: its split-only flags act
        "--micro-batch-size 4 --oases-schedule auto --oases-sub-batches 3",
        "--micro-batch-size 1 --oases-schedule auto --oases-split sequence",
        "--micro-batch-size 2 --oases-schedule auto --oases-cuda-graphs eager",
        "--micro-batch-size 2 --oases-schedule auto --oases-tune-steps 8",
        "--micro-batch-size 2 --oases-schedule auto --oases-retune --load /tmp/none",
        "--micro-batch-size 2 --oases-schedule auto --oases-retune-interval 20",
        # a split schedule's own
        "--micro-batch-size 4 --oases-schedule overlap --oases-sub-batches 3",
        "--micro-batch-size 1 --oases-schedule overlap --oases-split sequence",
        "--micro-batch-size 2 --oases-schedule overlap --oases-cuda-graphs eager",
        # the defaults, given, and the flags that act under every schedule
        "--micro-batch-size 2 --oases-split batch",
        "--micro-batch-size 2 --oases-trace /tmp/t.json --log-json /tmp/l.json",
        "--micro-batch-size 2 --oases-start-over --save /tmp/x",
        "--micro-batch-size 2 --oases-start-over --save /tmp/x --load /tmp/y",
    ],
)
def test_a_flag_that_acts_is_accepted(flags):
    parse_config(TP2 + flags + " --train-iters 400", 2)


def test_every_oases_flag_has_a_verdict():
    """A new ``--oases-*`` flag must say when it acts: in :data:`ACT_WHEN` (with the condition)
    or :data:`ACT_ALWAYS`; each ``ACT_WHEN`` row's default is argparse's."""
    parser = add_oases_args(argparse.ArgumentParser())
    group = next(g for g in parser._action_groups if g.title == "oases")
    flags = {a.option_strings[0]: a.default for a in group._group_actions}
    rows = {row.flag: row for row in ACT_WHEN}
    assert set(flags) == set(rows) | set(ACT_ALWAYS)
    assert not set(rows) & set(ACT_ALWAYS)
    for flag, row in rows.items():
        assert row.default == flags[flag], flag
