"""Profiler: analytic profiles from cluster profiles, profile helpers, model configs, the CLI's
errors. Measured profiles on 2 gloo ranks and the memory model against them:
``tests/e2e/test_profiler_e2e.py``."""

import pytest
from helpers.variants import MODELS, h2048_args

from megatron_oases.cli import main as oases
from megatron_oases.errors import OasesConfigError
from megatron_oases.formats.profile import Profile, fit_alpha_beta, interpolate
from megatron_oases.profiler import layer_math
from megatron_oases.profiler.analytic import analytic_profile
from megatron_oases.profiler.model_config import model_args, read_model_file, shape_of
from megatron_oases.testbed.clusters import load_cluster


def test_analytic_profile_matches_cluster_and_flops():
    data = analytic_profile(h2048_args(), "rtx3090-nvlink")
    prof = Profile(data)
    cl = load_cluster("rtx3090-nvlink")
    assert prof.degrees == [1, 2, 4] and prof.tp == 4 and prof.dp == 8
    # comm: α–β reproduces the ring model at any size; links follow placement rules
    for ranks in ([0, 1], [0, 1, 2, 3]):
        for n in (12345, 7_000_000):
            assert prof.all_reduce_time(ranks, n) == pytest.approx(cl.all_reduce_time(n, ranks))
    assert data["comm"]["all_reduce"]["0,1"]["link"] == "nvlink"
    assert data["comm"]["all_reduce"]["0,1,2,3"]["link"] == "intra_node"
    assert data["comm"]["all_gather"]["0,2"]["link"] == "intra_node"  # 2 -> 4 re-shard: no NVLink
    assert prof.all_gather_time([0, 2], 1e6) == pytest.approx(cl.all_gather_time(1e6, [0, 2]))
    # compute: the roofline (GEMM FLOPs / sustained rate + memory-bound bytes / bandwidth),
    # backward = 2 × forward, linear in samples
    from megatron_oases.device_model import DeviceRates, block_work, roofline_time

    shape = data["model"]
    work = block_work(shape, "mlp", 2, cl.dtype_bytes)
    f = roofline_time(work, DeviceRates.from_profile(cl)).total_s
    assert f > layer_math.block_flops_forward(shape, "mlp", 2) / (cl.sustained_tflops * 1e12)
    assert prof.compute_time("mlp", "forward_s", 2, 3) == pytest.approx(3 * f)
    assert prof.compute_time("mlp", "backward_s", 2, 5) == pytest.approx(10 * f)
    # MLP GEMMs of H=2048: 16·s·h² FLOPs per sample
    assert layer_math.block_flops_forward(shape, "mlp", 1) == 16 * 1024 * 2048**2
    # memory: TP-aware parameter state
    st = data["memory"]["state_bytes_per_layer"]
    assert st["1"] > st["2"] > st["4"] and st["2"] / st["4"] == pytest.approx(2, rel=0.01)


def test_profile_helpers():
    assert interpolate([[1, 2.0], [3, 6.0]], 2) == pytest.approx(4.0)
    assert interpolate([[1, 2.0], [3, 6.0]], 5) == pytest.approx(10.0)  # linear extrapolation
    assert interpolate([[2, 4.0]], 3) == pytest.approx(6.0)
    a, b = fit_alpha_beta([[1, 3.0], [2, 5.0], [4, 9.0]])
    assert a == pytest.approx(1.0) and b == pytest.approx(2.0)


def test_model_config_errors(tmp_path):
    p = tmp_path / "m.yaml"
    p.write_text("num_layers: 2\nhidden_size: 64\nbogus_key: 1\n")
    with pytest.raises(OasesConfigError, match="unknown model setting 'bogus_key'"):
        model_args(read_model_file(str(p)))
    with pytest.raises(OasesConfigError, match="pick one with --model"):
        read_model_file(MODELS)
    with pytest.raises(OasesConfigError, match="no model 'h5'"):
        read_model_file(f"{MODELS}:h5")
    p.write_text(
        "model:\n  num-layers: 2\n  hidden-size: 64\n  num-attention-heads: 4\n  seq-length: 32\n"
        "parallel:\n  tensor-model-parallel-size: 2\n"
    )
    margs = model_args(read_model_file(str(p)))
    assert margs.num_layers == 2 and margs.tensor_model_parallel_size == 2


def test_profile_cli_errors(tmp_path, capsys):
    out = str(tmp_path / "p.json")
    assert oases(["profile", "--model", f"{MODELS}:h2048", "--analytic", "--out", out]) == 2
    assert "--analytic needs --cluster" in capsys.readouterr().err
    assert (
        oases(
            [
                "profile",
                "--model",
                f"{MODELS}:h2048",
                "--analytic",
                "--cluster",
                "nope",
                "--out",
                out,
            ]
        )
        == 2
    )
    assert "unknown cluster profile" in capsys.readouterr().err
    assert (
        oases(
            [
                "profile",
                "--model",
                f"{MODELS}:h2048",
                "--analytic",
                "--cluster",
                "rtx3090-pcie",
                "--degrees",
                "8",
                "--out",
                out,
            ]
        )
        == 2
    )
    assert "--degrees: 8 exceeds the TMP domain T=" in capsys.readouterr().err


def test_project_model_configs_are_read():
    margs = model_args(read_model_file("h2048-l24"))  # configs/models name
    assert (margs.num_layers, margs.hidden_size, margs.tensor_model_parallel_size) == (24, 2048, 4)
    assert margs.data_parallel_size == 8  # from the informational 'paper' section
    # benchmarks/planner/models.yaml (Table 4) describes the same layers as configs/models
    import yaml

    models = yaml.safe_load(open(MODELS))["models"]
    for name, m in models.items():
        cfg = f"h{m['hidden_size']}-l{m['num_layers']}"
        ours = model_args(read_model_file(f"{MODELS}:{name}"))
        theirs = model_args(read_model_file(cfg))
        assert shape_of(ours) == shape_of(theirs), name
        assert ours.data_parallel_size == theirs.data_parallel_size
        assert ours.global_batch_size == theirs.global_batch_size
