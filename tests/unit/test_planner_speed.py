"""Where ``oases plan --gpus N`` used to spend its time (issue 62.4), and that the shortcuts change
no figure: the cluster profile parsed once per file content, one analytic profile per
(TP, PP, DP) shared by that layout's micro-batch sizes, the one-degree solver shortcuts equal to
the general DP. The whole ranking against the committed table: test_planner_search_table.py."""

import dataclasses
import os

import numpy as np
import pytest
from helpers.random_instances import random_problem

from megatron_oases.errors import OasesConfigError
from megatron_oases.planner import dp
from megatron_oases.planner.time_model import decompose, evaluate, objective
from megatron_oases.testbed import clusters


def _count_parses(monkeypatch):
    import megatron_oases.formats as formats

    calls = []
    real = formats.read_yaml

    def counting(path, *a, **kw):
        calls.append(path)
        return real(path, *a, **kw)

    monkeypatch.setattr(formats, "read_yaml", counting)
    return calls


def test_a_cluster_profile_is_parsed_once_per_content(tmp_path, monkeypatch):
    monkeypatch.setattr(clusters, "_CACHE", {}, raising=False)
    calls = _count_parses(monkeypatch)
    packaged = [clusters.load_cluster("rtx4090-pcie") for _ in range(5)]
    assert len(calls) == 1 and all(p is packaged[0] for p in packaged)
    with pytest.raises(dataclasses.FrozenInstanceError):  # shared: nobody may change it
        packaged[0].memory_gb = 1.0
    with pytest.raises(dataclasses.FrozenInstanceError):
        packaged[0].intra_node.bandwidth_gbs = 1.0
    # a user's file edited in place, size and timestamps alike: the new content is read
    mine = tmp_path / "mine.yaml"
    text = open(clusters.resources.cluster_profile("rtx4090-pcie")).read()
    mine.write_text(text)
    st = os.stat(mine)
    assert clusters.load_cluster(str(mine)).memory_gb == packaged[0].memory_gb
    assert "memory_gb: 24\n" in text
    mine.write_text(text.replace("memory_gb: 24\n", "memory_gb: 32\n"))
    os.utime(mine, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert os.stat(mine).st_size == st.st_size
    assert clusters.load_cluster(str(mine)).memory_gb == 32.0
    # a bad file is still one line, every time
    (tmp_path / "bad.yaml").write_text("name: [")
    for _ in range(2):
        with pytest.raises(OasesConfigError, match="is not valid YAML"):
            clusters.load_cluster(str(tmp_path / "bad.yaml"))
    with pytest.raises(OasesConfigError, match="unknown cluster profile"):
        clusters.load_cluster("no-such-cluster")


def test_the_search_builds_one_profile_per_parallel_layout_and_parses_its_cluster_once(
    monkeypatch,
):
    from megatron_oases.profiler import analytic
    from megatron_oases.profiler.model_config import read_model_file
    from megatron_oases.search import search as search_mod

    args = search_mod.model_for_search(read_model_file("h2048-l24"), 16)
    monkeypatch.setattr(clusters, "_CACHE", {}, raising=False)
    calls = _count_parses(monkeypatch)
    built = []
    real = analytic.analytic_profile

    def counting(args, cluster, *a, **kw):
        built.append(
            (args.tensor_model_parallel_size, args.pipeline_model_parallel_size,
             args.data_parallel_size)
        )  # fmt: skip
        return real(args, cluster, *a, **kw)

    monkeypatch.setattr(analytic, "analytic_profile", counting)
    result = search_mod.search(args, "rtx3090-pcie", 4, 16, top=2)
    options = search_mod.layouts(args, 4, 16, 4)
    assert len(options) > len({(o.tp, o.pp, o.dp) for o in options})  # micro-batches share
    assert sorted(built) == sorted({(o.tp, o.pp, o.dp) for o in options})
    assert len(calls) == 1, calls
    assert result["candidates"]


@pytest.mark.parametrize("memory", ["none", "random", "tight"])
def test_one_degree_shortcuts_equal_the_general_dp(memory, monkeypatch):
    """With one candidate degree everywhere the DP's answer is the one plan, if it fits: the
    shortcut gives the DP's status, plan, objective, path and smallest memory exactly."""
    rng = np.random.default_rng(62)
    seen = set()
    for _ in range(30):
        p = random_problem(rng, int(rng.integers(1, 9)), degrees=(2,), memory=memory, pins=False)
        fast, fast_min = dp.solve_dp(p), dp.min_memory(p)
        with monkeypatch.context() as m:  # the general path on the same instance
            m.setattr(dp, "_one_plan", lambda problem: False)
            slow, slow_min = dp.solve_dp(p), dp.min_memory(p)
        assert (fast.status, fast.ks, fast.objective) == (slow.status, slow.ks, slow.objective)
        assert fast.info.get("path") == slow.info.get("path")
        assert fast_min == slow_min
        seen.add(fast.status)
        U, P = decompose(p)
        ks = [0] * p.num_layers
        assert objective(U, P, ks) == pytest.approx(evaluate(p, ks)["iteration_time_s"])
    if memory == "random":
        assert seen == {"optimal", "infeasible"}
