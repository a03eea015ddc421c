"""Bad files and failed saves, one line each, in this process: damaged profile, plan and model
files, Megatron's CPU fallback warnings filtered only without CUDA, the checkpoint tracker replaced
atomically, the staged save and which of its failures are one line.

The same faults under the real training loop (torchrun ranks): ``tests/e2e/test_faults_e2e.py``.
"""

import json
import os

import pytest


@pytest.fixture
def profile(tmp_path):
    from megatron_oases.cli import main

    path = tmp_path / "profile.json"
    assert (
        main(
            [
                "profile",
                "--model",
                "tiny-cpu",
                "--analytic",
                "--cluster",
                "rtx3090-pcie",
                "--out",
                str(path),
            ]
        )
        == 0
    )
    return path


def _bad_profiles(profile, tmp_path):
    data = json.loads(profile.read_text())
    out = {}
    for name, edit, message in (
        (
            "tp",
            ("tensor_model_parallel_size", "two"),
            "tensor_model_parallel_size must be a " "positive integer, got 'two'",
        ),
        ("degrees", ("degrees", "1,2"), "degrees must be a non-empty list of positive integers"),
        ("memory", ("memory", "lots"), "memory must be a mapping, got 'lots'"),
    ):
        bad = dict(data)
        bad[edit[0]] = edit[1]
        path = tmp_path / f"{name}.json"
        path.write_text(json.dumps(bad))
        out[path] = message
    bad = json.loads(json.dumps(data))
    first = next(iter(bad["memory"]["state_bytes_per_layer"]))
    bad["memory"]["state_bytes_per_layer"][first] = "12GB"
    (tmp_path / "state.json").write_text(json.dumps(bad))
    out[tmp_path / "state.json"] = f"memory.state_bytes_per_layer.{first} must be a number"
    bad = json.loads(json.dumps(data))
    bad["compute"]["mlp"][first]["forward_s"] = [[1, "fast"]]
    (tmp_path / "compute.json").write_text(json.dumps(bad))
    out[tmp_path / "compute.json"] = f"compute.mlp.{first}.forward_s must be a list of [samples"
    (tmp_path / "binary.json").write_bytes(bytes(range(256)) * 4)
    out[tmp_path / "binary.json"] = "is not a text file (binary content)"
    (tmp_path / "dir.json").mkdir()
    out[tmp_path / "dir.json"] = "is a directory, not a JSON file"
    (tmp_path / "cut.json").write_text(profile.read_text()[:100])
    out[tmp_path / "cut.json"] = "is not valid JSON"
    return out


def test_damaged_profile_is_one_line(profile, tmp_path, capsys):
    from megatron_oases.cli import main

    for path, message in _bad_profiles(profile, tmp_path).items():
        argv = ["plan", "--profile", str(path), "--global-batch-size", "8", "--memory", "24"]
        assert main(argv + ["--out", str(tmp_path / "plan.json")]) == 2, path
        err = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]
        assert len(err) == 1 and message in err[0], (path, err)


def test_damaged_plan_and_model_files_are_one_line(profile, tmp_path, capsys):
    from helpers.runs import parse

    from megatron_oases.cli import main
    from megatron_oases.errors import OasesConfigError

    binary, directory = tmp_path / "plan.bin", tmp_path / "plan.d"
    binary.write_bytes(bytes(range(256)))
    directory.mkdir()
    for path, message in ((binary, "is not a text file"), (directory, "is a directory")):
        with pytest.raises(OasesConfigError, match=f"plan file {path} {message}"):
            parse(f"--tensor-model-parallel-size 2 --oases-plan {path}", world_size=2)
        assert main(["plan", "--profile", str(profile), "--evaluate", str(path)]) == 2
        err = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]
        assert len(err) == 1 and message in err[0], err
    bad_yaml = tmp_path / "bad.yaml"
    bad_yaml.write_text("num_layers: [1\nhidden_size: {")
    wrong_type = tmp_path / "type.yaml"
    wrong_type.write_text("num_layers: 2\nhidden_size: big\nnum_attention_heads: 4\n")
    for path, message in (
        (
            bad_yaml,
            f"model file {bad_yaml} is not valid YAML (expected ',' or ']', but got ':' "
            "at line 2, column 12); fix the file",
        ),
        (wrong_type, "model type: argument --hidden-size: invalid int value: 'big'"),
        (binary, f"model file {binary} is not a text file (binary content)"),
    ):
        out = tmp_path / "p.json"
        argv = ["profile", "--model", str(path), "--analytic", "--cluster", "rtx3090-pcie"]
        assert main(argv + ["--out", str(out)]) == 2, path
        err = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]
        assert len(err) == 1 and message in err[0], (path, err)


def test_cpu_fallback_warnings_are_filtered_only_without_cuda():
    import warnings

    from megatron_oases.training import quiet

    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        quiet.install(cuda=True)
        warnings.warn("Transformer Engine and Apex are not installed. Falling back to X")
        warnings.warn("absl.logging is not installed. Using logging.getLogger")
        warnings.warn("something that matters")
    shown = [str(w.message) for w in seen]
    assert len(shown) == 2 and shown[0].startswith("Transformer Engine and Apex")
    assert shown[1] == "something that matters"
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        quiet.install(cuda=False)
        warnings.warn("Transformer Engine and Apex are not installed. Falling back to X")
        warnings.warn("Apex is not installed. Falling back to Torch Norm")
        warnings.warn("something that matters")
    assert [str(w.message) for w in seen] == ["something that matters"]


def test_tracker_is_replaced_atomically(tmp_path):
    """Megatron writes the tracker with ``open(path, "w")``; through the safe-save patch it is
    written beside and renamed over: until then the old content stays whole."""
    from megatron.core.msc_utils import maybe_msc

    from megatron_oases.training.safe_save import TRACKER, _AtomicTracker

    path = tmp_path / TRACKER
    path.write_text("2")
    msc = _AtomicTracker(maybe_msc)
    with msc.open(str(path), "w") as f:
        f.write("4")
        assert path.read_text() == "2"  # not truncated while the new one is written
    assert path.read_text() == "4" and os.listdir(tmp_path) == [TRACKER]
    other = tmp_path / "other.txt"
    with msc.open(str(other), "w") as f:  # any other file: Megatron's own open
        assert not hasattr(f, "tmp")


def test_staged_save_and_which_failures_are_one_line(tmp_path):
    """In one process: a save into a directory holding files goes to a fresh one that replaces
    it when complete; an I/O failure stops the run with one line, a bug is raised as it is."""
    import errno

    from megatron_oases.training import safe_save
    from megatron_oases.training.pretrain import TrainingStopped

    target = tmp_path / "iter_0000002"
    target.mkdir()
    (target / "__3_0.distcp").write_text("old layout")
    (tmp_path / "latest_checkpointed_iteration.txt").write_text("2")

    def writes(sharded_state_dict, checkpoint_dir, *args, **kwargs):
        assert str(checkpoint_dir).endswith(".saving")  # never in place
        assert (target / "__3_0.distcp").exists()  # the old one is whole meanwhile
        with open(os.path.join(checkpoint_dir, "__0_0.distcp"), "w") as f:
            f.write("new")

    safe_save.guarded_save(writes)({}, str(target))
    assert sorted(os.listdir(target)) == ["__0_0.distcp"]
    assert sorted(os.listdir(tmp_path)) == ["iter_0000002", "latest_checkpointed_iteration.txt"]

    def disk_full(sharded_state_dict, checkpoint_dir, *args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    def bug(sharded_state_dict, checkpoint_dir, *args, **kwargs):
        raise NameError("name 'stage_of' is not defined")

    with pytest.raises(TrainingStopped, match=r"No space left on device.*iteration 2\) is intact"):
        safe_save.guarded_save(disk_full)({}, str(target))
    with pytest.raises(NameError):
        safe_save.guarded_save(bug)({}, str(target))
    assert sorted(os.listdir(target)) == ["__0_0.distcp"]  # the good one survived both
