"""``oases plan --gpus N`` ranks as it did before it was made fast (issue 62.4): the committed
search table (``benchmarks/results/planner/search.json``) and the ordered candidates recorded in
``tests/fixtures/planner_search_ranking.json`` come out of today's search figure for figure.

The fixture was written by the search before its caches, shared profiles and one-degree solver
shortcuts; a change to the cost model (a new ``COST_MODEL_VERSION``) must write it anew::

    python tests/unit/test_planner_search_table.py --regenerate
"""

import json
import math
import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TABLE = os.path.join(ROOT, "benchmarks", "results", "planner", "search.json")
FIXTURE = os.path.join(ROOT, "tests", "fixtures", "planner_search_ranking.json")
REGENERATE = "python tests/unit/test_planner_search_table.py --regenerate"
#: The committed table's cases checked here (model with its overrides, cluster, GPUs): a
#: pipelined overlap winner, sharded stock winners, an uneven stage split, block recompute.
CASES = (
    ("gpt-6.7b", "rtx3090-pcie", 8),
    ("gpt-6.7b", "h100-nvlink", 64),
    ("gpt-6.7b vocab_size=256000", "rtx3090-pcie", 16),
    ("llama-7b", "rtx4090-pcie", 8),
)
#: How many candidates of each ranking the fixture holds, in order.
TOP = 12
RTOL = 1e-9


def _model(spec):
    """``"gpt-6.7b vocab_size=256000"`` -> ("gpt-6.7b", {"vocab_size": 256000})."""
    name, *sets = spec.split()
    return name, {k: int(v) for k, v in (s.split("=") for s in sets)}


def _rows():
    with open(TABLE) as f:
        doc = json.load(f)
    rows = doc["rows"] if isinstance(doc, dict) else doc
    return {(r["model"], r["cluster"], r["gpus"]): r for r in rows}


_RESULTS = {}


def _search(spec, cluster, gpus, gbs):
    """The search's result for one case (once per session)."""
    key = (spec, cluster, gpus, gbs)
    if key not in _RESULTS:
        from megatron_oases.profiler.model_config import read_model_file
        from megatron_oases.search.search import model_for_search, search

        name, overrides = _model(spec)
        args = model_for_search(read_model_file(name), gbs, overrides=overrides)
        _RESULTS[key] = search(args, cluster, gpus, gbs)
    return _RESULTS[key]


def _load_report_cli():
    """``benchmarks/planner/report_cli.py``, whose ``setting`` labels the committed table's rows:
    the test reads them back with the very function that wrote them."""
    from helpers.paths import load_script

    return load_script("benchmarks/planner/report_cli.py", "planner_report_cli")


_setting = _load_report_cli().setting


def _ranking(result):
    """The ``TOP`` fastest candidates in order: name, setting, level, predicted s, peak GB."""
    return [
        [c["name"], _setting(c), c["level"], c["iteration_time_s"], c["peak_memory_gb"]]
        for c in result["candidates"][:TOP]
    ]


def _close(a, b):
    return a is b is None or (
        a is not None and b is not None and math.isclose(a, b, rel_tol=RTOL, abs_tol=0.0)
    )


@pytest.mark.parametrize("spec,cluster,gpus", CASES, ids=lambda x: str(x).replace(" ", "-"))
def test_the_committed_search_table_comes_out_of_todays_search(spec, cluster, gpus):
    row = _rows()[(spec, cluster, gpus)]
    r = _search(spec, cluster, gpus, row["global_batch_size"])
    w, thumb, bs, bo = r["candidates"][0], r["rule_of_thumb"], r["best_stock"], r["best_oases"]
    assert r["layouts_searched"] == row["layouts"]
    assert (w["name"], _setting(w), w["host_bound"]) == (
        row["winner"],
        row["winner_setting"],
        row["winner_host_bound"],
    )
    assert r["winner_plan"]["launch_flags"] == row["launch_flags"]
    assert f"{bs['name']} {_setting(bs)}" == row["best_stock"]
    assert bs["stock_launch_flags"] == row["best_stock_launch_flags"]
    assert f"{bo['name']} {_setting(bo)}" == row["best_oases"]
    from megatron_oases.planner.choose import setting_name

    assert f"{thumb['name']} {setting_name('off', thumb['recompute'])}" == row["rule_of_thumb"]
    for got, want in (
        (w["iteration_time_s"], row["winner_s"]),
        (thumb["iteration_time_s"], row["rule_of_thumb_s"]),
        (bs["iteration_time_s"], row["best_stock_s"]),
        (bo["iteration_time_s"], row["best_oases_s"]),
        (r["stock_over_oases"], row["stock_over_oases"]),
    ):
        assert _close(got, want), (got, want)


def _fixture():
    with open(FIXTURE) as f:
        return json.load(f)


def test_the_fixture_is_of_todays_cost_model():
    from megatron_oases.planner.host_model import HOST_TABLE_VERSION
    from megatron_oases.planner.time_model import COST_MODEL_VERSION

    fixture = _fixture()
    now = {"cost_model": COST_MODEL_VERSION, "host_table": HOST_TABLE_VERSION}
    assert fixture["versions"] == now, f"the fixture is of another model: run `{REGENERATE}`"


@pytest.mark.parametrize("spec,cluster,gpus", CASES, ids=lambda x: str(x).replace(" ", "-"))
def test_the_ranking_is_the_one_recorded(spec, cluster, gpus):
    """The ``TOP`` fastest candidates, in order, with their predicted times and memory."""
    want = _fixture()["rankings"][f"{spec} {cluster} x{gpus}"]
    got = _ranking(
        _search(spec, cluster, gpus, _rows()[(spec, cluster, gpus)]["global_batch_size"])
    )
    assert [g[:3] for g in got] == [w[:3] for w in want]
    for g, w in zip(got, want):
        assert _close(g[3], w[3]) and _close(g[4], w[4]), (g, w)


def regenerate():
    """Write the fixture from this tree's search (``--regenerate``)."""
    from megatron_oases.planner.host_model import HOST_TABLE_VERSION
    from megatron_oases.planner.time_model import COST_MODEL_VERSION
    from megatron_oases.training import quiet

    quiet.install(cuda=False)
    rows = _rows()
    rankings = {}
    for spec, cluster, gpus in CASES:
        result = _search(spec, cluster, gpus, rows[(spec, cluster, gpus)]["global_batch_size"])
        rankings[f"{spec} {cluster} x{gpus}"] = _ranking(result)
    doc = {
        "written_by": REGENERATE,
        "versions": {"cost_model": COST_MODEL_VERSION, "host_table": HOST_TABLE_VERSION},
        "rankings": rankings,
    }
    with open(FIXTURE, "w") as f:
        json.dump(doc, f, indent=1)
        f.write("\n")
    print(f"wrote {FIXTURE}")


if __name__ == "__main__":
    if sys.argv[1:] != ["--regenerate"]:
        sys.exit(f"usage: {REGENERATE}")
    regenerate()
