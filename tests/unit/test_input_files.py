"""Input files are not believed as they are (issue 54): every cluster profile, profile, plan and
model config goes through the one bounded reader (``megatron_oases/formats/__init__.py``) and its
format's validator, and a bad one is one line naming the file and the field; plans and profiles
are written whole or not at all."""

import copy
import json
import math
import os
import re
import stat

import pytest
import yaml

from megatron_oases import resources
from megatron_oases.cli import main as oases
from megatron_oases.errors import OasesConfigError
from megatron_oases.formats import MAX_INPUT_BYTES, read_json, read_yaml
from megatron_oases.formats.plan import load_plan, save_plan, uniform_plan
from megatron_oases.formats.profile import Profile, load_profile, save_profile
from megatron_oases.testbed.clusters import load_cluster


def _one_line(capsys):
    err = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]
    assert len(err) == 1, err
    return err[0]


# ---------------------------------------------------------------------------- cluster profiles
def _cluster(tmp_path, name="bad.yaml", **edits):
    """The packaged rtx3090-nvlink profile with ``edits`` ({"intra_node.bandwidth_gbs": 0})."""
    with open(resources.cluster_profile("rtx3090-nvlink")) as f:
        raw = yaml.safe_load(f)
    for dotted, value in edits.items():
        node, *path = dotted.split(".")
        if path:
            raw[node][path[0]] = value
        else:
            raw[node] = value
    out = tmp_path / name
    out.write_text(yaml.safe_dump(raw))
    return out


@pytest.mark.parametrize("link", ["intra_node", "inter_node", "nvlink"])
@pytest.mark.parametrize("value", [0, -11.0, math.nan, math.inf])
def test_a_link_bandwidth_must_be_finite_and_positive(tmp_path, link, value):
    path = _cluster(tmp_path, **{f"{link}.bandwidth_gbs": value})
    with pytest.raises(OasesConfigError) as err:
        load_cluster(str(path))
    assert f"cluster profile {path}: {link}.bandwidth_gbs must be a finite positive number" in str(
        err.value
    )


@pytest.mark.parametrize("value", [-1.0, math.nan, math.inf, "fast"])
def test_a_link_latency_must_be_finite_and_not_negative(tmp_path, value):
    path = _cluster(tmp_path, **{"intra_node.latency_us": value})
    with pytest.raises(OasesConfigError, match=r"intra_node\.latency_us must be a finite number"):
        load_cluster(str(path))


def test_a_zero_latency_link_is_a_valid_model(tmp_path):
    path = _cluster(tmp_path, **{"intra_node.latency_us": 0})
    assert load_cluster(str(path)).intra_node.latency_us == 0.0


def test_a_zero_latency_cluster_profiles_to_a_valid_profile(tmp_path, capsys):
    """At zero latency the analytic fit's α = t0 − β·n0 came out a hair below 0 for some
    bandwidths (27.07 GB/s over 8 ranks: −8.5e-22 s), which the profile check then refused."""
    link = {"bandwidth_gbs": 27.07, "latency_us": 0}
    cluster = _cluster(tmp_path, **{"intra_node": link, "inter_node": link})
    out = tmp_path / "profile.json"
    argv = ["profile", "--model", "h2048-l24", "--analytic", "--cluster", str(cluster)]
    argv += ["--tensor-model-parallel-size", "8", "--data-parallel-size", "1", "--out", str(out)]
    assert oases(argv) == 0, capsys.readouterr().err
    fits = load_profile(str(out)).data["comm"]["all_reduce"]
    assert fits["0,1,2,3,4,5,6,7"]["alpha_s"] == 0.0  # across nodes: the zero-latency link
    assert all(fit["alpha_s"] >= 0 for fit in fits.values())


@pytest.mark.parametrize(
    "key, value, message",
    [
        ("peak_tflops", 0, "peak_tflops must be a finite positive number"),
        ("sustained_tflops", math.nan, "sustained_tflops must be a finite positive number"),
        ("memory_gb", -24, "memory_gb must be a finite positive number"),
        ("memory_bandwidth_gbs", math.inf, "memory_bandwidth_gbs must be a finite positive"),
        ("host_us_per_call", -12, "host_us_per_call must be a finite number >= 0"),
        ("gpus_per_node", 0, "gpus_per_node must be a positive integer"),
        ("comm_sms", 2.5, "comm_sms must be a positive integer"),
        ("nvlink_pairs", [[0, 9]], "nvlink_pairs must be a list of lists of local GPU indices"),
        ("intra_node", {"bandwidth_gbs": 11.0}, "intra_node must be a mapping {bandwidth_gbs"),
        ("memory_bandwith_gbs", 1.0, "unknown key 'memory_bandwith_gbs' (did you mean"),
        ("inter_node", None, "missing inter_node"),
    ],
)
def test_every_cluster_field_is_checked(tmp_path, key, value, message):
    path = _cluster(tmp_path, **{key: value})
    with pytest.raises(OasesConfigError, match=re.escape(message)):
        load_cluster(str(path))


def test_packaged_cluster_profiles_pass_the_check():
    for name in resources.available_clusters():
        assert load_cluster(name).name == name


def test_a_python_tag_in_yaml_is_one_line_and_never_constructed(tmp_path):
    path = tmp_path / "evil.yaml"
    path.write_text('name: !!python/object/apply:os.system ["touch pwned"]\n')
    with pytest.raises(OasesConfigError) as err:
        load_cluster(str(path))
    line = str(err.value)
    assert line.startswith(f"cluster profile {path} is not valid YAML (tag !!python/object/apply")
    assert "not allowed" in line and "\n" not in line
    assert not (tmp_path / "pwned").exists()


def test_cli_bad_cluster_profiles_are_one_line(tmp_path, capsys):
    """``oases calibrate``, ``oases profile --analytic`` and ``oases compare`` on a zero-bandwidth,
    binary or tagged cluster profile: exit 2 and one line (a ZeroDivisionError or
    UnicodeDecodeError traceback before; compare wrote a report of negative link times)."""
    zero = _cluster(tmp_path, "zero.yaml", **{"intra_node.bandwidth_gbs": 0})
    negative = _cluster(tmp_path, "neg.yaml", **{"inter_node.bandwidth_gbs": -11})
    binary = tmp_path / "binary.yaml"
    binary.write_bytes(bytes(range(256)))
    tag = tmp_path / "tag.yaml"
    tag.write_text("name: !!python/name:os.system\n")
    for path, message in (
        (zero, "intra_node.bandwidth_gbs must be a finite positive number from 0.001 to"),
        (binary, "is not a text file (binary content)"),
        (tag, "tag !!python/name:os.system"),
    ):
        assert oases(["calibrate", "--profile", str(path)]) == 2
        line = _one_line(capsys)
        assert line.startswith("oases calibrate: error: cluster profile") and message in line
    out = tmp_path / "p.json"
    argv = ["profile", "--model", "tiny-cpu", "--analytic", "--cluster", str(zero), "--out"]
    assert oases(argv + [str(out)]) == 2
    assert "intra_node.bandwidth_gbs must be a finite positive number" in _one_line(capsys)
    assert not out.exists()
    argv = ["compare", "--emulate-link", str(negative), "--out", str(tmp_path / "cmp")]
    assert oases(argv) == 2
    line = _one_line(capsys)
    assert "inter_node.bandwidth_gbs must be a finite positive number" in line and "got -11" in line
    assert not (tmp_path / "cmp").exists()


def test_training_checks_the_emulated_cluster_profile_before_anything_starts(tmp_path):
    """``--emulate-link`` is read and checked with the other flags (no process group, no model):
    before, the emulator's patch read it in every rank and divided by the zero bandwidth there."""
    from helpers.runs import parse

    zero = _cluster(tmp_path, "zero.yaml", **{"intra_node.bandwidth_gbs": 0})
    with pytest.raises(OasesConfigError, match=r"zero\.yaml: intra_node\.bandwidth_gbs must be"):
        parse(f"--tensor-model-parallel-size 2 --emulate-link {zero}", world_size=2)


# ------------------------------------------------------------------------------------ profiles
@pytest.fixture(scope="module")
def profile_data():
    from helpers.variants import h2048_profile

    return h2048_profile("rtx3090-pcie").data


def _edited(data, dotted, value):
    d = copy.deepcopy(data)
    node = d
    *path, last = dotted.split(".")
    for key in path:
        node = node[key]
    node[last] = value
    return d


@pytest.mark.parametrize("value", [math.nan, math.inf, -1e-3])
def test_profile_times_must_be_finite_and_not_negative(profile_data, value):
    """A NaN time planned NaN iterations; a negative one "predicted iteration -21856 ms"."""
    bad = _edited(profile_data, "compute.mlp.1.forward_s", [[1, value], [8, 8 * abs(value)]])
    with pytest.raises(OasesConfigError, match=r"compute\.mlp\.1\.forward_s must be a list of"):
        Profile(bad, path="p.json")
    fit = profile_data["comm"]["all_reduce"]
    key = next(iter(fit))
    bad = _edited(profile_data, f"comm.all_reduce.{key}.beta_s_per_byte", value)
    with pytest.raises(OasesConfigError, match=rf"comm\.all_reduce\.{key}\.beta_s_per_byte must"):
        Profile(bad, path="p.json")


@pytest.mark.parametrize("value", [math.nan, math.inf, -1e12])
def test_profile_memory_must_be_finite_and_not_negative(profile_data, value):
    """Infinite memory planned "peak memory inf GB ≤ 24 GB" (or an OverflowError traceback); a
    negative one a negative peak or "no plan fits ... the smallest that fits is 8.84 GB"."""
    for dotted in ("memory.overhead_bytes", "memory.state_bytes_per_layer.1"):
        with pytest.raises(OasesConfigError, match=rf"{dotted} must be a finite number >= 0"):
            Profile(_edited(profile_data, dotted, value), path="p.json")
    with pytest.raises(OasesConfigError, match="memory_gb must be a finite positive number"):
        Profile(_edited(profile_data, "memory_gb", value), path="p.json")


def test_profile_with_nan_is_one_line_from_oases_plan(profile_data, tmp_path, capsys):
    path = tmp_path / "nan.json"
    # json writes NaN and Infinity as bare words; Python's json reads them back
    path.write_text(json.dumps(_edited(profile_data, "memory.overhead_bytes", math.inf)))
    argv = ["plan", "--profile", str(path), "--global-batch-size", "8", "--memory", "24"]
    assert oases(argv + ["--out", str(tmp_path / "plan.json")]) == 2
    line = _one_line(capsys)
    assert (
        f"{path}: memory.overhead_bytes must be a finite number >= 0 and at most 1e+18, got inf"
        in line
    )
    assert not (tmp_path / "plan.json").exists()


def test_saved_profiles_load_back(profile_data, tmp_path):
    path = tmp_path / "profile.json"
    save_profile(profile_data, str(path))
    assert load_profile(str(path)).data == profile_data


# --------------------------------------------------------------------------------------- plans
@pytest.mark.parametrize(
    "key, value, message",
    [
        ("memory_gb", math.nan, "memory_gb must be a finite positive number of at most 100000 GB"),
        (
            "memory_gb",
            -24,
            "memory_gb must be a finite positive number of at most 100000 GB or null",
        ),
        ("memory_margin", math.inf, "memory_margin must be a finite number >= 0 and at most 10 or"),
        ("data_parallel_size", 0, "data_parallel_size must be a positive integer of at most"),
        ("pipeline_model_parallel_size", 1.5, "pipeline_model_parallel_size must be a positive"),
        ("num_layers", "four", "num_layers must be a positive integer of at most 2147483647 or"),
        ("sequence_parallel", "yes", "sequence_parallel must be true, false or null"),
        ("distributed_optimizer", 1, "distributed_optimizer must be true, false or null"),
        ("predicted", [1.0], "predicted must be a mapping or null"),
        ("profile", 7, "profile must be a path or null"),
    ],
)
def test_plan_fields_are_checked_on_load(tmp_path, key, value, message):
    plan = uniform_plan(4, 2)
    plan[key] = value
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(plan))
    with pytest.raises(OasesConfigError, match=re.escape(f"{path}: {message}")):
        load_plan(str(path))


def _plan_file(tmp_path):
    path = tmp_path / "plan.json"
    save_plan(uniform_plan(4, 2), str(path))
    return path, path.read_bytes()


def test_save_plan_keeps_the_old_plan_when_serialising_fails(tmp_path, monkeypatch):
    """Before: ``open(path, "w")`` truncated the old plan, then serialising failed (or Ctrl-C
    came): 0 bytes left. Now the old plan is intact and no temporary file stays behind."""
    from megatron_oases.formats import plan as plan_format

    path, old = _plan_file(tmp_path)
    real = plan_format._dumps

    def dumps_then_fail(obj, indent=0):
        real(obj, indent)
        raise KeyboardInterrupt  # Ctrl-C in the middle of the save

    monkeypatch.setattr(plan_format, "_dumps", dumps_then_fail)
    with pytest.raises(KeyboardInterrupt):
        save_plan(uniform_plan(4, 2, degree=1), str(path))
    assert path.read_bytes() == old
    assert os.listdir(tmp_path) == ["plan.json"]


def test_save_plan_keeps_the_old_plan_when_the_write_fails(tmp_path, monkeypatch):
    """A write that fails after some bytes (a full disk) leaves the old plan whole and says so
    in one line."""
    path, old = _plan_file(tmp_path)

    def full_disk(fd):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "fsync", full_disk)
    with pytest.raises(OasesConfigError, match=r"cannot write plan file .* \(No space left"):
        save_plan(uniform_plan(4, 2, degree=1), str(path))
    assert path.read_bytes() == old
    assert os.listdir(tmp_path) == ["plan.json"]


def test_save_profile_is_whole_or_nothing(profile_data, tmp_path):
    path = tmp_path / "profile.json"
    save_profile(profile_data, str(path))
    old = path.read_bytes()
    unserialisable = _edited(profile_data, "hardware", {"probe": object()})
    with pytest.raises(TypeError):
        save_profile(unserialisable, str(path))
    assert path.read_bytes() == old
    assert os.listdir(tmp_path) == ["profile.json"]


def test_a_replaced_plan_keeps_its_permissions(tmp_path):
    path, _ = _plan_file(tmp_path)
    os.chmod(path, 0o640)
    save_plan(uniform_plan(4, 2, degree=1), str(path))
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o640
    assert load_plan(str(path))["degrees"] == [1] * 4


# ------------------------------------------------------------------------ the bounded reader
#: Address space of the child processes below that read ``/dev/zero``: a reader that reads it
#: whole fails there with MemoryError instead of taking the host's memory.
_CHILD_MEMORY = 2 * 2**30


def _limited():
    import resource

    resource.setrlimit(resource.RLIMIT_AS, (_CHILD_MEMORY, _CHILD_MEMORY))


def test_a_device_or_pipe_is_refused_without_reading_it(tmp_path):
    """``/dev/zero`` was read whole (MemoryError); a FIFO without a writer would hang."""
    import subprocess
    import sys

    code = (
        "from megatron_oases.errors import OasesConfigError\n"
        "from megatron_oases.formats.plan import load_plan\n"
        "from megatron_oases.formats.profile import load_profile\n"
        "for load in (load_plan, load_profile):\n"
        "    try:\n"
        "        load('/dev/zero')\n"
        "    except OasesConfigError as exc:\n"
        "        print(exc)\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=120,
        preexec_fn=_limited,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.splitlines() == [
        "plan file /dev/zero is not a regular file (a device, pipe or socket); write one with "
        "`oases plan --out PLAN_JSON`",
        "profile /dev/zero is not a regular file (a device, pipe or socket); create it with "
        "`oases profile`",
    ]
    fifo = tmp_path / "fifo.yaml"
    os.mkfifo(fifo)
    with pytest.raises(OasesConfigError, match=f"cluster profile {fifo} is not a regular file"):
        load_cluster(str(fifo))


def test_an_oversized_file_is_refused_by_its_size(tmp_path):
    big = tmp_path / "big.json"
    with open(big, "wb") as f:  # sparse: nothing is written (or read)
        f.truncate(MAX_INPUT_BYTES + 1)
    with pytest.raises(OasesConfigError, match=f"plan file {big} is larger than 64 MiB"):
        load_plan(str(big))
    big_yaml = tmp_path / "big.yaml"
    os.rename(big, big_yaml)
    with pytest.raises(OasesConfigError, match=f"model file {big_yaml} is larger than 64 MiB"):
        read_yaml(str(big_yaml), "model file")


def test_binary_and_malformed_files_are_one_line(tmp_path):
    zeros = tmp_path / "zeros.json"
    zeros.write_bytes(b"\0" * 64)  # valid UTF-8, still binary
    with pytest.raises(OasesConfigError, match="profile .* is not a text file"):
        read_json(str(zeros), "profile", "fix")
    deep = tmp_path / "deep.json"
    deep.write_text("[" * 100_000 + "]" * 100_000)
    with pytest.raises(OasesConfigError, match="is not valid JSON"):
        read_json(str(deep), "plan file", "fix")


def _limited_for_torch():
    import resource

    limit = 8 * 2**30  # torch's import maps more address space than it uses
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))


def test_cli_plan_on_dev_zero_is_one_line_exit_2(tmp_path):
    """``python -m megatron_oases plan --evaluate /dev/zero``: exit 2, one stderr line."""
    import subprocess
    import sys

    from helpers.variants import h2048_profile

    profile = tmp_path / "profile.json"
    save_profile(h2048_profile("rtx3090-pcie").data, str(profile))
    cmd = [sys.executable, "-m", "megatron_oases", "plan", "--profile", str(profile)]
    proc = subprocess.run(
        cmd + ["--evaluate", "/dev/zero"],
        capture_output=True,
        text=True,
        timeout=300,
        preexec_fn=_limited_for_torch,
    )
    err = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert proc.returncode == 2 and len(err) == 1, proc.stderr[-2000:]
    assert err[0].startswith("oases plan: error: plan file /dev/zero is not a regular file")


# -------------------------------------------------------------------------------- model configs
def test_model_config_values_must_be_finite(tmp_path, capsys):
    from megatron_oases.megatron_lm.configs import load_model_config
    from megatron_oases.profiler.model_config import read_model_file

    flat = tmp_path / "nan.yaml"
    flat.write_text(
        "num_layers: 2\nhidden_size: 64\nnum_attention_heads: 4\nhidden_dropout: .nan\n"
    )
    with pytest.raises(OasesConfigError, match=f"model file {flat}: hidden_dropout is nan"):
        read_model_file(str(flat))
    project = tmp_path / "project.yaml"
    project.write_text("model: {num-layers: 2, hidden-size: 64, attention-dropout: .inf}\n")
    with pytest.raises(OasesConfigError, match=f"{project}: model: attention-dropout is inf"):
        load_model_config(str(project))
    tagged = tmp_path / "tagged.yaml"
    tagged.write_text("num_layers: !!python/object/apply:os.getcwd []\n")
    argv = ["profile", "--model", str(tagged), "--analytic", "--cluster", "rtx3090-pcie"]
    assert oases(argv + ["--out", str(tmp_path / "p.json")]) == 2
    line = _one_line(capsys)
    assert f"model file {tagged} is not valid YAML (tag !!python/object/apply:os.getcwd" in line
