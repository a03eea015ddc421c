"""Megatron-LM's flags and what each schedule does with them (``megatron_oases/megatron_flags.py``).

Every option string of Megatron's parser, built as ``megatron_oases/arguments.py`` builds it, has a
verdict; every refused verdict is one error line naming the fix (through the rules, or a full
parse); ``docs/reliability.md``'s table is the module's. No process group is started."""

import shlex
from pathlib import Path

import pytest
from helpers.runs import cache_megatron_field_docstrings, parse

from megatron_oases import megatron_flags
from megatron_oases.arguments import add_oases_args, with_defaults
from megatron_oases.config import transformer_engine_installed
from megatron_oases.errors import OasesConfigError
from megatron_oases.megatron_flags import (
    NO_TE,
    NOT_INSTALLED,
    REFUSED,
    RULES,
    VERDICTS,
    refusals,
    rule_for,
)
from megatron_oases.validation import check_megatron_flags, check_transformer_impl

ROOT = Path(__file__).resolve().parents[2]
RECOMPUTE = "--recompute-granularity full --recompute-method uniform --recompute-num-layers 1 "


class _Built(Exception):
    pass


@pytest.fixture(scope="module")
def parser():
    """Megatron-LM's parser with the ``oases`` group, as ``parse_args_and_config`` builds it
    (``megatron.training.arguments.parse_args`` with :func:`add_oases_args`), stopped before it
    parses anything."""
    from megatron.training import arguments as margs

    cache_megatron_field_docstrings()
    built = []

    def provider(p):
        built.append(add_oases_args(p))
        raise _Built

    with pytest.raises(_Built):
        margs.parse_args(provider)
    return built[0]


def megatron_options(parser):
    """``(option string, group title, action)`` of every Megatron flag (not the ``oases`` group)."""
    return [
        (option, group.title, action)
        for group in parser._action_groups
        if group.title != "oases"
        for action in group._group_actions
        for option in action.option_strings
    ]


def test_every_megatron_flag_has_a_verdict_under_every_schedule(parser):
    options = megatron_options(parser)
    assert len(options) > 500  # the whole parser, not a part of it
    unclassified = [(o, g) for o, g, _ in options if rule_for(o, g) is None]
    assert not unclassified, f"add them to megatron_oases/megatron_flags.py: {unclassified}"
    for option, group, _ in options:
        rule = rule_for(option, group)
        assert rule.off in VERDICTS and rule.split in VERDICTS, option


def test_the_rules_name_megatron_flags_and_each_covers_one(parser):
    """No rule names a flag, prefix or group Megatron does not have (a renamed flag would
    otherwise fall silently to its group's default), and none is shadowed by the others."""
    options = megatron_options(parser)
    names = {o for o, _, _ in options}
    groups = {g for _, g, _ in options}
    dests = {o: a.dest for o, _, a in options}
    used = {id(rule_for(o, g)) for o, g, _ in options}
    for rule in RULES:
        assert rule.group in groups, rule.group
        assert set(rule.flags) <= names, set(rule.flags) - names
        for prefix in rule.prefixes:
            assert any(n.startswith(prefix) for n in names), prefix
        assert id(rule) in used, f"no flag falls under {rule}"
        assert rule.why
        if REFUSED in (rule.off, rule.split) or NO_TE in (rule.off, rule.split):
            assert rule.example, rule
            assert (rule.refusal is None) != (rule.enforced_by is None), rule
        else:
            assert rule.refusal is None and rule.enforced_by is None, rule
        for flag, attribute, _ in rule.refusal.uses if rule.refusal else ():
            if flag.startswith("-"):  # the attribute its flag sets
                assert flag in rule.flags and dests[flag] == attribute, (flag, attribute)
            else:  # one Megatron derives
                assert attribute not in dests.values(), attribute


def test_the_docs_table_is_the_modules():
    text = (ROOT / "docs" / "reliability.md").read_text()
    begin, end = "<!-- megatron-flags:begin -->\n", "<!-- megatron-flags:end -->"
    assert begin in text and end in text
    table = text.split(begin, 1)[1].split(end, 1)[0]
    assert table == megatron_flags.markdown_table(), (
        "docs/reliability.md's table of Megatron's flags differs from megatron_flags.RULES; "
        "replace it by the output of python -m megatron_oases.megatron_flags"
    )


def _parsed(parser, example, schedule):
    """Megatron's parse (without its checks) of ``example`` as a command line gives it."""
    argv = with_defaults(shlex.split(example) + ["--oases-schedule", schedule], demo=True)
    return parser.parse_args(argv)


def _flag_of(rule):
    return (rule.refusal.uses[0][0] if rule.refusal else rule.flags[0]).split()[0]


@pytest.mark.parametrize(
    "rule", [r for r in refusals() if not r.refusal.after_megatron], ids=_flag_of
)
def test_each_refused_flag_is_one_line_naming_the_fix(parser, rule):
    """Each refusal of the table, under ``off`` and a split schedule, with and without
    Transformer Engine (and for a per-layer plan under ``off`` where the rule says): one line
    naming the flag and the fix where the verdict is refused, nothing where it is not."""
    cases = [(s, te, False) for s in ("off", "overlap") for te in (True, False)]
    cases += [("off", True, True)] if rule.refusal.plan else []
    for schedule, te, plan in cases:
        args = _parsed(parser, rule.example, schedule)
        verdict = rule.verdict(schedule)
        refused = verdict == REFUSED or (verdict == NO_TE and not te) or plan
        check = dict(plan=plan, te_installed=te, after_megatron=rule.refusal.after_megatron)
        if not refused:
            check_megatron_flags(args, schedule, **check)
            continue
        with pytest.raises(OasesConfigError) as err:
            check_megatron_flags(args, schedule, **check)
        message = str(err.value)
        assert "\n" not in message
        assert any(flag in message for flag in rule.flags), message
        assert "drop" in message, message  # the fix
        assert (NOT_INSTALLED in message) == (not te and "{te}" in rule.refusal.message)
    assert rule.refusal.given(_parsed(parser, "", "overlap")) is None  # the defaults are no use


def _world(argv):
    """The ranks a command line's model-parallel sizes need."""
    words = shlex.split(argv)
    size = 1
    for flag in ("--tensor-model-parallel-size", "--pipeline-model-parallel-size"):
        if flag in words:
            size *= int(words[words.index(flag) + 1])
    return size


@pytest.mark.parametrize(
    "argv, match",
    [
        # issue 54: FP8 trained bit for bit as --bf16 alone under a split schedule ...
        (f"--bf16 --fp8-format hybrid --oases-schedule oases {RECOMPUTE}", "FP8 needs Transformer"),
        # ... and was a traceback per rank under off (Transformer Engine absent)
        (f"--bf16 --fp8-format hybrid --oases-schedule off {RECOMPUTE}", "FP8 needs Transformer"),
        # two chained tracebacks per rank in Megatron's set-up; before Megatron's own check,
        # whose fix (add --sequence-parallel) leads to them
        (
            "--tensor-model-parallel-size 2 --tp-comm-overlap --oases-schedule overlap",
            "userbuffers",
        ),
        ("--tensor-model-parallel-size 2 --sequence-parallel --tp-comm-overlap", "userbuffers"),
        ("--oases-schedule overlap --cuda-graph-impl local", "Megatron's CUDA graphs|--cuda-graph"),
        ("--oases-schedule overlap --mlp-chunks-for-training 2", "--mlp-chunks-for-training 2"),
    ],
)
def test_flags_the_run_cannot_honour_are_one_line_up_front(argv, match):
    with pytest.raises(OasesConfigError, match=match) as err:
        parse(argv, world_size=_world(argv))
    assert "\n" not in str(err.value) and "drop" in str(err.value)


@pytest.mark.parametrize(
    "rule",
    [r for r in RULES if r.enforced_by or (r.refusal and r.refusal.after_megatron)],
    ids=lambda r: r.flags[0].lstrip("-"),
)
def test_refusals_on_what_megatron_checks_hold(rule):
    """The refused verdicts that another check enforces (Megatron's own, or a rule of
    ``validation.py``), or that read what Megatron derives: a full parse refuses the example."""
    schedule = "off" if rule.off == REFUSED else "overlap"
    argv = f"{rule.example} --oases-schedule {schedule}"
    with pytest.raises(OasesConfigError) as err:
        parse(argv, world_size=_world(argv) * (2 if "weight-shards" in argv else 1))
    message = str(err.value)
    assert "\n" not in message
    assert any(flag in message for flag in rule.flags) or (
        rule.enforced_by == "Megatron's validate_args" and "transformer_engine" in message
    ), message


def test_what_the_split_schedules_refuse_still_runs_under_off():
    """Stock Megatron honours it: ``off`` parses it as before."""
    args = parse(
        "--mlp-chunks-for-training 2 --distribute-saved-activations "
        "--tensor-model-parallel-size 2 " + RECOMPUTE,
        world_size=2,
    )
    assert args.mlp_chunks_for_training == 2 and args.distribute_saved_activations


def test_transformer_engine_impl_is_refused_with_the_reason_of_its_case():
    """Issue 54: under ``off`` the refusal spoke of split schedules only."""
    with pytest.raises(OasesConfigError, match="not installed here; use --transformer-impl local"):
        check_transformer_impl("transformer_engine", "off", te_installed=False)
    with pytest.raises(OasesConfigError, match="local layer spec only") as err:
        check_transformer_impl("transformer_engine", "off", te_installed=True)
    assert "TP communication" not in str(err.value)
    for schedule, plan, what in (
        ("oases", False, "--oases-schedule oases"),
        ("off", True, "--oases-plan"),
    ):
        with pytest.raises(OasesConfigError, match=f"{what}: TE linears do their own TP"):
            check_transformer_impl("transformer_engine", schedule, plan=plan, te_installed=True)
    check_transformer_impl("local", "off", te_installed=False)
    # the command line: the case of this host
    te = transformer_engine_installed()
    with pytest.raises(OasesConfigError, match="not installed here" if not te else "spec only"):
        parse("--transformer-impl transformer_engine --oases-schedule off", world_size=1)
