"""Every committed report under benchmarks/results/ records what made it, and that is today's
code (issue 62.1): the commit, a clean tree and the version of each model its figures depend on
(``benchmarks/provenance.py``). A stale report fails here with the command that regenerates it,
unless it is listed in ``PENDING`` (known stale, printed below); an entry there that is current
again fails too, so the list stays the truth."""

import json
import os
import re
import subprocess

import pytest
from helpers.paths import REPO, load_script

P = load_script("benchmarks/provenance.py", "benchmarks_provenance")
#: what a report is written as; everything else under benchmarks/results/ is charts
SCANNED = (".md", ".json", ".txt")


def _committed():
    """The tracked files under benchmarks/results/ that a report could be, relative to it."""
    out = subprocess.run(
        ["git", "ls-files", "--", "benchmarks/results"],
        cwd=REPO,
        text=True,
        capture_output=True,
        check=True,
    ).stdout.split()
    assert out, "git ls-files lists nothing under benchmarks/results: not a checkout?"
    return [os.path.relpath(p, "benchmarks/results") for p in out if p.endswith(SCANNED)]


def test_every_committed_report_is_todays():
    errors, pending = [], []
    for rel in _committed():
        if P.exempt_reason(rel):
            continue
        entry = P.report_for(rel)
        if entry is None:
            errors.append(
                f"{rel}: no generator in benchmarks/provenance.py's REPORTS (nor EXEMPT): "
                "register it"
            )
            continue
        command, models = entry
        problems = P.problems(P.read(os.path.join(P.RESULTS, rel)), models)
        if rel in P.PENDING:
            if not problems:
                errors.append(f"{rel}: current now: drop it from PENDING")
            else:
                pending.append(f"{rel}: stale ({P.PENDING[rel]}): regenerate with `{command}`")
        elif problems:
            errors.append(f"{rel}: {'; '.join(problems)}: regenerate with `{command}`")
    print(f"{len(pending)} reports pending regeneration (benchmarks/provenance.py PENDING):")
    print("\n".join(pending))
    assert not errors, "\n".join(errors)


def test_pending_lists_committed_reports_only():
    committed = set(_committed())
    for rel in P.PENDING:
        assert rel in committed, f"PENDING names {rel}, not a committed report"
        assert not P.exempt_reason(rel) and P.report_for(rel), f"PENDING names {rel}: no report"


def test_every_generator_stamps_its_reports():
    """Each command REPORTS names runs a script that writes provenance."""
    for _, command, models in P.REPORTS:
        script = re.search(r"(benchmarks/\S+\.py)", command).group(1)
        with open(os.path.join(REPO, script)) as f:
            text = f.read()
        assert "provenance.record(" in text, f"{script} does not record its provenance"
        assert set(models) <= set(P.MODELS)


def test_model_constants():
    versions = P.current_versions()
    assert set(versions) == set(P.MODELS)
    assert all(isinstance(v, str) and v for v in versions.values()), versions


def _prov(**kw):
    base = {
        "command": "python benchmarks/planner/search.py",
        "commit": "0" * 40,
        "dirty": False,
        "versions": P.current_versions(P.PLANNER),
        "date": "2026-12-07 10:00 UTC",
        "host": {"load_average": [0.5, 0.5, 0.5], "logical_cpus": 2},
    }
    return {**base, **kw}


def test_markdown_stamp_round_trip(tmp_path):
    prov = _prov()
    text = "# Title\n\nintro\n\n| a |\n"
    once = P.markdown(text, prov)
    assert once.startswith("# Title\n\n<!-- provenance: ")
    assert "*Provenance:* made by `python benchmarks/planner/search.py`" in once
    assert once.endswith("intro\n\n| a |\n")
    again = P.markdown(once, _prov(commit="1" * 40))  # a new run replaces, not appends
    assert again.count("provenance: {") == 1 and "1111111111" in again
    (tmp_path / "r.md").write_text(once)
    assert P.read(str(tmp_path / "r.md")) == prov
    untitled = P.markdown("| a |\n", prov)
    assert untitled.startswith("<!-- provenance: ") and P.markdown(untitled, prov) == untitled
    (tmp_path / "r.json").write_text(json.dumps(P.with_provenance({"rows": []}, prov)))
    assert P.read(str(tmp_path / "r.json")) == prov
    with pytest.raises(TypeError):
        P.with_provenance([1], prov)
    assert "dirty tree: not for committing" in P.markdown(text, _prov(dirty=True))


def test_stale_dirty_and_missing_provenance_are_named():
    assert P.problems(_prov(), P.PLANNER) == []
    assert P.problems(None, P.PLANNER) == ["no provenance"]
    assert P.problems(_prov(dirty=True), P.PLANNER) == ["made from a dirty tree"]
    old = _prov(versions={**P.current_versions(P.PLANNER), "cost_model": "2000-01-01"})
    (msg,) = P.problems(old, P.PLANNER)
    assert msg.startswith("cost_model 2000-01-01 (today ")
    (msg,) = P.problems(_prov(), ("emulator",))
    assert msg.startswith("emulator unrecorded")


def test_derived_report_is_as_stale_as_its_inputs():
    """A report that re-reads others' figures (the compare index) records their versions."""
    now = P.current_versions(P.EMULATED)
    same = P.record(P.EMULATED, "x", inputs=[{"versions": now}, {"versions": now}])
    assert same["versions"] == now
    mixed = P.record(P.EMULATED, "x", inputs=[{"versions": now}, None])
    assert mixed["versions"]["emulator"] == f"mixed: {now['emulator']}, unrecorded"
    assert P.problems({**_prov(), "versions": mixed["versions"]}, P.EMULATED)


def test_git_state_counts_tracked_code_not_results(tmp_path):
    def git(*args):
        subprocess.run(["git", *args], cwd=tmp_path, check=True, capture_output=True)

    git("init", "-q")
    (tmp_path / "code.py").write_text("x = 1\n")
    (tmp_path / "benchmarks" / "results").mkdir(parents=True)
    (tmp_path / "benchmarks" / "results" / "r.md").write_text("old\n")
    git("add", ".")
    git("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-q", "-m", "c")
    commit, dirty = P.git_state(str(tmp_path))
    assert len(commit) == 40 and dirty is False
    (tmp_path / "benchmarks" / "results" / "r.md").write_text("new\n")  # a run's own output
    (tmp_path / "untracked.py").write_text("")
    assert P.git_state(str(tmp_path))[1] is False
    (tmp_path / "code.py").write_text("x = 2\n")
    assert P.git_state(str(tmp_path))[1] is True
    assert P.git_state(str(tmp_path / "benchmarks" / "nowhere")) == (None, None)
