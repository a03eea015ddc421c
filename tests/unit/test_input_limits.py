"""The limits of input and control files (issue 60): one numeric rule for every file format
(``megatron_oases/formats/__init__.py``: finite, held by a float, inside a plausible range),
error lines of bounded length, and every small control file read through the one bounded
reader."""

import copy
import json
import math

import pytest
import yaml

from megatron_oases import resources
from megatron_oases.cli import main as oases
from megatron_oases.errors import MAX_LINE_CHARS, OasesConfigError
from megatron_oases.formats import MAX_QUOTED, RANGES, number_fault, quote, read_json, read_yaml
from megatron_oases.formats.plan import load_plan, uniform_plan
from megatron_oases.formats.profile import Profile
from megatron_oases.testbed.clusters import load_cluster

HUGE = 10**400  # an integer no float holds: math.isfinite(HUGE) raises OverflowError


def _one_line(capsys):
    err = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]
    assert len(err) == 1, err
    return err[0]


def _cluster(tmp_path, edits, name="bad.yaml"):
    """The packaged rtx3090-nvlink profile with ``edits`` ({"intra_node.bandwidth_gbs": 0}),
    written as YAML (an integer of any size is written as its digits)."""
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


# ----------------------------------------------------------------- 60.2: one numeric rule
def test_the_rule_holds_what_a_float_holds():
    assert number_fault(HUGE) == "a finite number"
    assert number_fault(-HUGE, "latency_us") is not None
    assert number_fault(True) is not None and number_fault("1") is not None
    assert number_fault(1e-300, "tflops") == "a finite positive number from 0.001 to 1e+06 TFLOPS"
    assert number_fault(0, "latency_us") is None and number_fault(0, "memory_gb", True)
    for low, high, _ in RANGES.values():
        assert 0 <= low < high < math.inf


@pytest.mark.parametrize(
    "dotted, fault",
    [
        ("memory.overhead_bytes", "memory.overhead_bytes must be a finite number >= 0"),
        ("memory_gb", "memory_gb must be a finite positive number of at most 100000 GB"),
        ("model.ffn_hidden_size", "model.ffn_hidden_size must be a finite number"),
        ("model.hidden_size", "model.hidden_size must be a positive integer of at most"),
    ],
)
def test_a_profile_integer_too_large_for_a_float_is_one_line(profile_data, dotted, fault):
    """``memory.overhead_bytes: 10**400`` ended in ``OverflowError: int too large to convert to
    float`` from ``math.isfinite``."""
    with pytest.raises(OasesConfigError) as err:
        Profile(_edited(profile_data, dotted, HUGE), path="p.json")
    assert f"p.json: {fault}" in str(err.value) and "(401 digits)" in str(err.value)


def test_oases_plan_on_a_profile_with_a_huge_integer_is_one_line(profile_data, tmp_path, capsys):
    path = tmp_path / "huge.json"
    path.write_text(json.dumps(_edited(profile_data, "memory.overhead_bytes", HUGE)))
    argv = ["plan", "--profile", str(path), "--global-batch-size", "8", "--memory", "24"]
    assert oases(argv + ["--out", str(tmp_path / "plan.json")]) == 2
    line = _one_line(capsys)
    assert line.startswith(f"oases plan: error: {path}: memory.overhead_bytes must be a finite")
    assert len(line) < 400


@pytest.mark.parametrize(
    "dotted, value, message",
    [
        ("compute.mlp.1.forward_s", [[1, 1e300]], "must be a list of [samples, seconds]"),
        ("memory.overhead_bytes", 1e30, "must be a finite number >= 0 and at most 1e+18"),
        ("fixed_compute.forward_s_per_sample", 1e9, "and at most 1e+06 s"),
    ],
)
def test_implausible_profile_values_are_refused(profile_data, dotted, value, message):
    if dotted.startswith("fixed_compute") and "fixed_compute" not in profile_data:
        profile_data = dict(profile_data, fixed_compute={"forward_s_per_sample": 0.0})
    with pytest.raises(OasesConfigError) as err:
        Profile(_edited(profile_data, dotted, value), path="p.json")
    assert str(err.value).startswith(f"p.json: {dotted} must be") and message in str(err.value)
    fits = profile_data["comm"]["all_reduce"]
    key = next(iter(fits))
    with pytest.raises(OasesConfigError, match="beta_s_per_byte must be a finite number >= 0"):
        Profile(_edited(profile_data, f"comm.all_reduce.{key}.beta_s_per_byte", 1.0), "p.json")


def test_a_plan_memory_gb_too_large_for_a_float_is_one_line(tmp_path):
    """``memory_gb: 10**400`` in a plan: an ``OverflowError`` traceback on every rank."""
    for key, value, fault in (
        ("memory_gb", HUGE, "memory_gb must be a finite positive number of at most 100000 GB"),
        ("memory_margin", HUGE, "memory_margin must be a finite number >= 0 and at most 10"),
        ("global_batch_size", HUGE, "global_batch_size must be a positive integer of at most"),
    ):
        plan = uniform_plan(4, 2)
        plan[key] = value
        path = tmp_path / "plan.json"
        path.write_text(json.dumps(plan))
        with pytest.raises(OasesConfigError) as err:
            load_plan(str(path))
        assert f"{path}: {fault}" in str(err.value) and "(401 digits)" in str(err.value)


@pytest.mark.parametrize(
    "key, value, fault",
    [
        ("intra_node.bandwidth_gbs", HUGE, "a finite positive number from 0.001 to 1e+06 GB/s"),
        ("sustained_tflops", 1e-300, "a finite positive number from 0.001 to 1e+06 TFLOPS"),
        ("peak_tflops", 1e9, "a finite positive number from 0.001 to 1e+06 TFLOPS"),
        ("nvlink.bandwidth_gbs", 1e-300, "a finite positive number from 0.001 to 1e+06 GB/s"),
        ("inter_node.latency_us", 1e12, "a finite number >= 0 and at most 1e+06 us"),
        ("memory_gb", 1e9, "a finite positive number of at most 100000 GB"),
        ("memory_bandwidth_gbs", 1e-12, "a finite positive number from 0.001 to 1e+06 GB/s"),
        ("host_us_per_call", HUGE, "a finite number >= 0 and at most 1e+06 us"),
        ("comm_sms", 10**9, "a positive integer of at most 1024"),
        ("gpus_per_node", HUGE, "a positive integer of at most 4096"),
        ("dtype_bytes", 64, "a positive integer of at most 8"),
    ],
)
def test_cluster_values_are_finite_and_plausible(tmp_path, key, value, fault):
    """``bandwidth_gbs: 10**400``: ``OverflowError``; ``sustained_tflops: 1e-300``: plans with
    300-digit iteration times."""
    path = _cluster(tmp_path, {key: value})
    with pytest.raises(OasesConfigError) as err:
        load_cluster(str(path))
    assert f"cluster profile {path}: {key} must be {fault}, got " in str(err.value)
    assert len(str(err.value)) < 400


def test_packaged_clusters_are_inside_the_rule():
    for name in resources.available_clusters():
        load_cluster(name)


def test_a_model_config_integer_too_large_for_a_float_is_one_line(tmp_path):
    from megatron_oases.megatron_lm.configs import load_model_config

    project = tmp_path / "project.yaml"
    project.write_text(f"model: {{num-layers: 2, hidden-size: 64, lr: {HUGE}}}\n")
    with pytest.raises(OasesConfigError, match=rf"{project}: model: lr is 10000000\.\.\. \(401"):
        load_model_config(str(project))


def test_a_number_beyond_pythons_digit_limit_is_one_line(tmp_path):
    """An integer of more than 4300 digits: a ``ValueError`` from the JSON and YAML parsers."""
    path = tmp_path / "plan.json"
    path.write_text('{"memory_gb": ' + "9" * 5000 + "}")
    with pytest.raises(OasesConfigError, match="holds a number too large for any field"):
        read_json(str(path), "plan file", "fix it")
    path = tmp_path / "c.yaml"
    path.write_text("memory_gb: " + "9" * 5000 + "\n")
    with pytest.raises(OasesConfigError, match="holds a number too large for any field"):
        read_yaml(str(path), "cluster profile")


# ------------------------------------------------------------- 60.2: bounded error lines
def test_quoted_values_are_bounded():
    for value in ("x" * 10**6, [list(range(10**4))] * 10**3, HUGE, 10**10000, {"k" * 10**5: 1}):
        assert len(quote(value)) <= MAX_QUOTED


def test_an_error_line_is_cut_keeping_its_start_and_its_fix():
    exc = OasesConfigError("plan p.json: schedule " + "x" * 106_000 + "; choose one of off, oases")
    text = str(exc)
    assert len(text) <= MAX_LINE_CHARS + 50 and "\n" not in text
    assert text.startswith("plan p.json: schedule xxx")
    assert text.endswith("; choose one of off, oases") and "characters cut" in text


def test_a_cluster_key_of_100_kb_is_a_short_line(tmp_path, capsys):
    """One error line reached 106 kB: a mistyped key (or value) was quoted whole."""
    path = _cluster(tmp_path, {"k" * 106_000: 1})
    assert oases(["calibrate", "--profile", str(path)]) == 2
    line = _one_line(capsys)
    assert "unknown key 'kkkk" in line and len(line) < 1000


def test_a_plan_with_a_100_kb_value_is_a_short_line(tmp_path):
    plan = uniform_plan(4, 2)
    plan["schedule"] = "s" * 106_000
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(plan))
    with pytest.raises(OasesConfigError) as err:
        load_plan(str(path))
    assert len(str(err.value)) <= MAX_LINE_CHARS + 50


# ------------------------------------------- 60.3: control files through the bounded reader
#: The address space a child process may map: a file read whole fails there with MemoryError
#: instead of taking the host's memory (a tracker linked to /dev/zero took 3.1 GB).
_CHILD_MEMORY = 4 * 2**30


def _limited():
    import resource

    resource.setrlimit(resource.RLIMIT_AS, (_CHILD_MEMORY, _CHILD_MEMORY))


def _load_check_in_a_child(load_dir):
    """``check_load`` (what every rank runs first for ``--load``: ``safe_save.recover``, then the
    tracker) on ``load_dir`` in a child process with bounded memory and time: its line, or how it
    failed (a FIFO hung the job, ``/dev/zero`` ended in ``MemoryError``)."""
    import subprocess
    import sys

    code = (
        "import argparse, sys\n"
        "from megatron_oases.errors import OasesConfigError\n"
        "from megatron_oases.training import safe_save\n"
        "from megatron_oases.training.checkpoint_check import check_load\n"
        "assert safe_save.recover(sys.argv[1]) is False\n"
        "try:\n"
        "    check_load(argparse.Namespace(load=sys.argv[1], ckpt_format='torch_dist'))\n"
        "except OasesConfigError as exc:\n"
        "    print(exc)\n"
    )
    try:
        proc = subprocess.run(
            [sys.executable, "-c", code, str(load_dir)],
            capture_output=True,
            text=True,
            timeout=120,
            preexec_fn=_limited,
        )
    except subprocess.TimeoutExpired:
        return "hung"
    return proc.stdout.strip() or proc.stderr.strip().splitlines()[-1]


@pytest.mark.parametrize("kind", ["dev-zero", "fifo", "oversized"])
def test_a_load_tracker_that_is_not_a_small_regular_file_is_one_line(tmp_path, kind):
    """``latest_checkpointed_iteration.txt`` linked to ``/dev/zero`` was read until
    ``MemoryError``; a FIFO hung the job silently until it was killed."""
    import os

    load = tmp_path / "ckpt"
    load.mkdir()
    tracker = load / "latest_checkpointed_iteration.txt"
    if kind == "dev-zero":
        os.symlink("/dev/zero", tracker)
        problem = "is not a regular file (a device, pipe or socket)"
    elif kind == "fifo":
        os.mkfifo(tracker)
        problem = "is not a regular file (a device, pipe or socket)"
    else:
        tracker.write_text("2" * 100_000)
        problem = "is larger than 65536 bytes, the most a tracker may be"
    line = _load_check_in_a_child(load)
    assert line == (
        f"--load {load}: tracker {tracker} {problem}; no complete checkpoint is left there: start "
        "without --load or use another directory"
    )


def test_a_run_lock_that_is_not_a_regular_file_is_refused(tmp_path):
    """``.oases-lock`` linked to another file was truncated and written over; a FIFO there
    ended in a traceback (a seek on a pipe)."""
    import os

    from megatron_oases.outputs import LOCK_FILE, lock_dir

    victim = tmp_path / "important.txt"
    victim.write_text("keep me")
    linked = tmp_path / "linked"
    linked.mkdir()
    os.symlink(victim, linked / LOCK_FILE)
    with pytest.raises(OasesConfigError, match=f"--save {linked}: cannot open its run lock"):
        lock_dir(str(linked), "--save")
    assert victim.read_text() == "keep me"
    fifo = tmp_path / "fifo"
    fifo.mkdir()
    os.mkfifo(fifo / LOCK_FILE)
    with pytest.raises(OasesConfigError, match=f"--out {fifo}: its run lock .* is not a regular"):
        lock_dir(str(fifo), "--out")
    held = lock_dir(str(tmp_path), "--out")  # a regular lock file still works
    assert held is not None
    held.close()


def test_a_run_lock_holder_is_read_bounded(tmp_path):
    from megatron_oases.outputs import _holder

    lock = tmp_path / "lock"
    lock.write_text(json.dumps({"pid": 1, "host": "h" * 10**6, "started": "now"}))
    assert len(_holder(str(lock))) <= 200
    lock.write_text("x" * 10**6)
    assert _holder(str(lock)) == "another process"


# ------------------------------------------------------------- 60.6: checkpoint and data
def _torch_dist_checkpoint(load, iteration=2):
    """A complete torch_dist checkpoint directory as the pre-flight sees it (its files; the saved
    arguments come from the test's stand-in for Megatron's peek)."""
    import pickle

    from torch.distributed.checkpoint.metadata import Metadata

    it = load / f"iter_{iteration:07d}"
    it.mkdir(parents=True)
    (it / "metadata.json").write_text('{"sharded_backend": "torch_dist"}')
    (it / ".metadata").write_bytes(pickle.dumps(Metadata({}, storage_data={})))
    (it / "__0_0.distcp").write_bytes(b"shard")
    (load / "latest_checkpointed_iteration.txt").write_text(str(iteration))


@pytest.mark.parametrize("saved_with", [True, False])
def test_a_checkpoint_of_the_other_optimizer_is_intact_and_names_the_flag(
    tmp_path, monkeypatch, saved_with
):
    """A distributed-optimizer checkpoint loaded without ``--use-distributed-optimizer`` was
    called "damaged" (Megatron-Core's load: ``KeyError: optimizer.state.exp_avg...``); the
    reverse was a ``CheckpointingException`` traceback. Both are intact: one line names the
    flag, and ``--no-load-optim`` loads either."""
    import copy

    from helpers.runs import parse
    from megatron.training import checkpointing

    from megatron_oases.training.checkpoint_check import check_load

    load = tmp_path / "ckpt"
    _torch_dist_checkpoint(load)
    flag = "" if saved_with else " --use-distributed-optimizer"
    args = parse(f"--load {load} --train-iters 4{flag}", world_size=2)
    saved = copy.deepcopy(args)
    saved.use_distributed_optimizer = saved_with
    peek = {"args": saved, "checkpoint_version": 3.0, "iteration": 2}
    monkeypatch.setattr(checkpointing, "_load_base_checkpoint", lambda *a, **k: (peek, "", 0, 0))
    monkeypatch.setattr(checkpointing, "check_checkpoint_args", lambda *a, **k: None)
    monkeypatch.setattr(checkpointing, "set_checkpoint_version", lambda *a, **k: None)
    with pytest.raises(OasesConfigError) as err:
        check_load(args)
    text = str(err.value)
    assert "damaged" not in text and "\n" not in text
    if saved_with:
        assert text == (
            f"--load {load}: the checkpoint was saved with --use-distributed-optimizer and is "
            "intact: its optimizer state is sharded for the distributed optimizer; add "
            "--use-distributed-optimizer to resume it, or --no-load-optim to start a new "
            "optimizer from its weights"
        )
    else:
        assert text.startswith(f"--load {load}: the checkpoint was saved without ")
        assert "drop --use-distributed-optimizer to resume it" in text
    args.no_load_optim = True
    check_load(args)  # the weights alone: both load
    args.no_load_optim = False
    args.use_distributed_optimizer = saved_with
    check_load(args)  # the flag it was saved with


def _dataset(prefix, ids, dtype="int32"):
    import numpy
    import torch
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    builder = IndexedDatasetBuilder(f"{prefix}.bin", dtype=getattr(numpy, dtype))
    for start in range(0, len(ids), 50):
        builder.add_item(torch.tensor(ids[start : start + 50]))
        builder.end_document()
    builder.finalize(f"{prefix}.idx")
    return prefix


@pytest.mark.parametrize("dtype", ["int32", "uint16"])
def test_token_ids_beyond_the_vocabulary_are_one_line_before_training(tmp_path, monkeypatch, dtype):
    """Token ids beyond ``--vocab-size`` in an indexed dataset were masked by Megatron at
    TP > 1 without a word; the data pre-flight reads the largest id once."""
    from helpers.runs import parse

    from megatron_oases.training import data_check

    monkeypatch.setattr(data_check, "_CHUNK", 64, raising=False)  # several chunks
    ids = list(range(500)) * 2 + [700] + [3] * 20
    prefix = _dataset(str(tmp_path / "corpus_text_document"), ids, dtype)
    argv = f"--data-path {prefix} --tokenizer-type NullTokenizer --tensor-model-parallel-size 2"
    with pytest.raises(OasesConfigError) as err:
        data_check.check_data_paths(parse(f"{argv} --vocab-size 512", world_size=2))
    assert str(err.value).startswith(
        f"data prefix {prefix}: {prefix}.bin holds token id 700, beyond --vocab-size 512 (ids 0 "
        "to 511; "
    )
    assert "set --vocab-size to at least 701" in str(err.value)
    data_check.check_data_paths(parse(f"{argv} --vocab-size 701", world_size=2))


def test_a_negative_token_id_is_one_line(tmp_path):
    from helpers.runs import parse

    from megatron_oases.training.data_check import check_data_paths

    prefix = _dataset(str(tmp_path / "neg_text_document"), [5, -3] * 30)
    args = parse(f"--data-path {prefix} --tokenizer-type NullTokenizer --vocab-size 512", 1)
    with pytest.raises(OasesConfigError, match=r"neg_text_document\.bin holds token id -3, below"):
        check_data_paths(args)
