"""What made a report: every report generator under ``benchmarks/`` stamps its output with this.

A committed figure means something only beside the code and the models that produced it. Each
report records, in a fixed machine-readable form, the commit it ran at, whether the tree was clean
(tracked files outside ``benchmarks/results/``), the version of each model its figures depend on
(one constant per model, bumped in the commit that changes what the model computes: see
:data:`MODELS`), the date and the host's load. In a report's markdown that is one line
``<!-- provenance: {...} -->`` after its title plus a line for readers; in its JSON the top-level
key ``"provenance"``. A run from a dirty tree is marked "(dirty tree: not for committing)".

:data:`REPORTS` maps every committed report to the command that regenerates it and the models it
depends on; :data:`EXEMPT` lists the files under ``benchmarks/results/`` that are not a
generator's report, with the reason; :data:`PENDING` the reports known to be stale, waiting for a
quiet host. ``tests/unit/test_report_versions.py`` holds every committed report to them.
"""

import datetime
import fnmatch
import importlib
import json
import os
import re
import shlex
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = os.path.join(ROOT, "benchmarks", "results")

#: model name -> (module, constant): the version of each model a report's figures depend on.
MODELS = {
    "emulator": ("megatron_oases.testbed.emulator", "EMULATOR_VERSION"),
    "device_model": ("megatron_oases.device_model", "DEVICE_MODEL_VERSION"),
    "cost_model": ("megatron_oases.planner.time_model", "COST_MODEL_VERSION"),
    "host_table": ("megatron_oases.planner.host_model", "HOST_TABLE_VERSION"),
    "dp_emulation": ("megatron_oases.testbed.collectives", "DATA_PARALLEL_EMULATION_VERSION"),
}
#: what each family of reports depends on
EMULATED = ("emulator", "device_model")
PLANNER = ("cost_model", "host_table", "device_model")

DIRTY_MARK = "(dirty tree: not for committing)"
_SUMMARY = "*Provenance:*"
_LINE = re.compile(r"provenance: (\{.*\})")

_ONE_RANK = "python benchmarks/compare/one_rank_check.py"
_ONE_RANK_SHAPE = _ONE_RANK + " --shape {} --threads-per-rank 0 --variants megatron,oases --pairs 1"

#: (pattern under benchmarks/results/, command that regenerates it, models), first match wins;
#: ``{dir}`` in a command: the report's directory name.
REPORTS = (
    ("planner/search.*", "python benchmarks/planner/search.py", PLANNER),
    ("planner/fsdp.*", "python benchmarks/planner/fsdp.py", PLANNER),
    ("planner/table4.*", "python benchmarks/planner/table4.py", PLANNER),
    (
        "planner/roofline_check.*",
        "flock /tmp/oases-bench.lock python benchmarks/planner/roofline_check.py",
        ("device_model",),
    ),
    ("planner/solve_time.*", "python benchmarks/planner/solve_time.py", PLANNER),
    (
        "planner/verify_search.*",
        "python benchmarks/planner/verify_search.py --top 5 --repeats 3",
        ("cost_model", "device_model", "emulator", "dp_emulation"),
    ),
    (
        "planner/verify_search_gpus2.*",
        "python benchmarks/planner/verify_search.py --gpus 2 --repeats 3",
        ("cost_model", "device_model", "emulator", "dp_emulation"),
    ),
    (
        "validation/results.*",
        "python benchmarks/validation/run_validation.py --out benchmarks/results/validation",
        ("cost_model", "device_model", "emulator"),
    ),
    (
        "auto/*",
        "flock /tmp/oases-e2e.lock python benchmarks/auto/run_auto.py "
        "--out benchmarks/results/auto",
        EMULATED,
    ),
    (
        "compare/calibration/calibration.*",
        "python benchmarks/compare/calibration_check.py "
        "--results benchmarks/results/compare/rtx3090-pcie-h2048/results.json",
        EMULATED,
    ),
    ("compare/host-reprojection.md", "python benchmarks/compare/host_reprojection.py", EMULATED),
    ("compare/one-rank-check/rtx3090-pcie-h1024/*", _ONE_RANK + " --pairs 2", EMULATED),
    (
        "compare/one-rank-check/rtx3090-pcie-h1536s256-threadsdefault/*",
        _ONE_RANK_SHAPE.format("h1536s256"),
        EMULATED,
    ),
    (
        "compare/one-rank-check/rtx3090-pcie-h768s256-threadsdefault/*",
        _ONE_RANK_SHAPE.format("h768s256"),
        EMULATED,
    ),
    (
        "compare/one-rank-check/rtx3090-pcie-issue42-threadsdefault/*",
        _ONE_RANK_SHAPE.format("issue42"),
        EMULATED,
    ),
    ("compare/README.md", "python benchmarks/compare/run_benchmarks.py --report-only", EMULATED),
    ("compare/*/results.*", "python benchmarks/compare/run_benchmarks.py --only {dir}", EMULATED),
)

#: pattern under benchmarks/results/ -> why it carries no provenance of its own (looked up
#: before :data:`REPORTS`)
EXEMPT = {
    "README.md": "hand-written index of the results",
    "planner/README.md": "hand-written index of the planner's reports",
    "validation/README.md": "hand-written notes on validation/results.md",
    "compare/notes.md": "hand-written lab notebook, dated entries",
    "compare/one-rank-check/issue42.md": "hand-written note of issue 42, dated",
    "compare/one-rank-check/rtx3090-pcie-issue42-threadsdefault/one-rank-2threads-1/*": (
        "a hand-run `oases compare` quoted by issue42.md, not a generator's output"
    ),
    "compare/rtx3090-pcie-h2048-halfmb/*": (
        "a hand-run `oases compare` of 2026-11-25 quoted by notes.md, not a generator's output "
        "(no row of run_benchmarks.py's matrix; its variants are in rtx3090-pcie-h2048's row)"
    ),
    "ab/*": "ab_revisions.py runs two named past revisions: a record of those, not of today's code",
    "gpu/*": "GPU check reports (benchmarks/gpu/check.sh), dated per card and session",
    "*/golden.json": "a run's per-iteration values: data of the report beside it",
    "*/log.txt": "a run's log: data of the report beside it",
    "validation/plans/*": "the plans validation ran: inputs of its report",
    "validation/profile.json": "the measured profile validation planned with: input of its report",
}

#: report path under benchmarks/results/ -> why it is not regenerated yet. Each one is stale:
#: the test fails if one listed here is current (drop it) or one stale is not listed.
_QUIET = "timing-sensitive: regenerate on a quiet host"
PENDING = {}


def _match(rel, pattern):
    return fnmatch.fnmatchcase(rel, pattern)


def report_for(rel):
    """``(command, models)`` of the report at ``rel`` (a path under benchmarks/results/), or
    None when no generator writes it (see :func:`exempt_reason` first)."""
    for pattern, command, models in REPORTS:
        if _match(rel, pattern):
            name = os.path.basename(os.path.dirname(rel))
            return command.replace("{dir}", name), tuple(models)
    return None


def exempt_reason(rel):
    """Why the file at ``rel`` carries no provenance, or None."""
    for pattern, reason in EXEMPT.items():
        if _match(rel, pattern):
            return reason
    return None


def current_versions(models=tuple(MODELS)):
    """Today's version of each named model, read from its module's constant."""
    out = {}
    for name in models:
        module, constant = MODELS[name]
        out[name] = getattr(importlib.import_module(module), constant)
    return out


def git_state(root=ROOT):
    """``(commit, dirty)``: HEAD's full hash and whether a tracked file outside
    benchmarks/results/ differs from it (None, None outside a git checkout)."""

    def git(*args):
        return subprocess.run(
            ["git", *args], cwd=root, text=True, capture_output=True, timeout=30, check=True
        ).stdout.strip()

    try:
        commit = git("rev-parse", "HEAD")
        changed = git(
            "status", "--porcelain", "--untracked-files=no", "--", ".", ":!benchmarks/results"
        )
    except (OSError, subprocess.SubprocessError):
        return None, None
    return commit, bool(changed)


def host_load():
    """The host's load now: its load averages (1, 5, 15 min) and logical CPUs."""
    try:
        load = [round(x, 2) for x in os.getloadavg()]
    except OSError:
        load = None
    return {"load_average": load, "logical_cpus": os.cpu_count()}


def _combine(records):
    """One version per model over several version records: the value they share, else
    ``"mixed: a, b"``; a record without the model counts as ``"unrecorded"``."""
    names = sorted({n for r in records for n in r})
    out = {}
    for n in names:
        values = sorted({str(r.get(n, "unrecorded")) for r in records})
        out[n] = values[0] if len(values) == 1 else "mixed: " + ", ".join(values)
    return out


def command_line(script, argv=None, root=ROOT):
    """``python benchmarks/.../script.py ARGS``: the command that ran ``script`` (its path
    relative to the checkout) with ``argv`` (None: this process's arguments)."""
    argv = sys.argv[1:] if argv is None else argv
    return shlex.join(["python", os.path.relpath(os.path.abspath(script), root), *argv])


def record(models, command=None, inputs=(), root=ROOT):
    """The provenance of a report made now, from the figures of today's ``models``; ``inputs``:
    the provenance (or None) of reports whose figures this one re-reads, so that it is as stale
    as they are. ``command``: how to regenerate it (default: this process's command line)."""
    if command is None:
        command = command_line(sys.argv[0], sys.argv[1:], root)
    commit, dirty = git_state(root)
    versions = current_versions(models)
    if inputs:
        got = [((p or {}).get("versions") or {}) for p in inputs]
        versions = _combine([versions] + [{n: g.get(n, "unrecorded") for n in models} for g in got])
    return {
        "command": command,
        "commit": commit,
        "dirty": dirty,
        "versions": versions,
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "host": host_load(),
    }


def summary(prov):
    """One line for a reader of the report."""
    commit = (prov.get("commit") or "unknown")[:12]
    models = ", ".join(f"{k.replace('_', ' ')} {v}" for k, v in prov["versions"].items())
    host = prov.get("host") or {}
    load = host.get("load_average") or ["?"]
    out = (
        f"{_SUMMARY} made by `{prov['command']}` at commit {commit} on {prov['date']}; "
        f"models: {models}; host load average {load[0]} (1 min) on {host.get('logical_cpus', '?')} CPUs."
    )
    return out + (f" **{DIRTY_MARK}**" if prov.get("dirty") else "")


def markdown(text, prov):
    """``text`` (a report's markdown) with its provenance after the title line (at the top if
    it has none), replacing any provenance it already carries."""
    lines = [
        line
        for line in text.split("\n")
        if not _LINE.search(line) and not line.startswith(_SUMMARY)
    ]
    block = [f"<!-- provenance: {json.dumps(prov, sort_keys=True)} -->", summary(prov), ""]
    head = lines[:1] if lines and lines[0].startswith("# ") else []
    rest = lines[len(head) :]
    while rest and not rest[0].strip():
        rest.pop(0)
    return "\n".join(head + ([""] if head else []) + block + rest)


def with_provenance(doc, prov):
    """A report's JSON document with its provenance under ``"provenance"`` (an object's key;
    a list is a generator's mistake)."""
    if not isinstance(doc, dict):
        raise TypeError("a report's JSON must be an object to carry its provenance")
    return {**doc, "provenance": prov}


def stamp(prov, md=None, json_path=None):
    """Stamp reports already written (``oases compare``'s results.md / results.json) in place."""
    if md and os.path.exists(md):
        with open(md) as f:
            text = f.read()
        with open(md, "w") as f:
            f.write(markdown(text, prov))
    if json_path and os.path.exists(json_path):
        with open(json_path) as f:
            doc = json.load(f)
        with open(json_path, "w") as f:
            json.dump(with_provenance(doc, prov), f, indent=1)


def read(path):
    """The provenance a report at ``path`` carries (.json: its key; else the marked line), or
    None."""
    with open(path) as f:
        text = f.read()
    if path.endswith(".json"):
        try:
            doc = json.loads(text)
        except ValueError:
            return None
        return doc.get("provenance") if isinstance(doc, dict) else None
    m = _LINE.search(text)
    if not m:
        return None
    try:
        return json.loads(m.group(1))
    except ValueError:
        return None


def problems(prov, models):
    """Why a report with provenance ``prov`` is not today's (empty when it is)."""
    if not prov:
        return ["no provenance"]
    out = []
    if not prov.get("commit"):
        out.append("no commit recorded")
    if prov.get("dirty") is not False:
        out.append("made from a dirty tree")
    have, now = prov.get("versions") or {}, current_versions(models)
    for name, version in now.items():
        if have.get(name) != version:
            out.append(f"{name} {have.get(name, 'unrecorded')} (today {version})")
    return out


def print_summary(prov):
    """Print the line :func:`summary` gives, and a warning on stderr when the tree was dirty."""
    print(summary(prov))
    if prov.get("dirty"):
        print(f"warning: the tree has local changes: the report is marked {DIRTY_MARK}",
              file=sys.stderr)  # fmt: skip
