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
            "tensor_model_parallel_size must be a positive integer of at most 2147483647, got 'two'",
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
    out[tmp_path / "state.json"] = f"memory.state_bytes_per_layer.{first} must be a finite number"
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


def test_a_save_cut_short_by_the_exit_signal_says_so(tmp_path, monkeypatch):
    """``--exit-signal-handler``: a SIGTERM to every process of the job also stops the manager
    process behind Megatron's writer queue, and a save it cuts short failed on a broken pipe
    blamed on "free space, permissions"; the line names the signal now."""
    import signal
    import types

    from megatron.training import global_vars

    from megatron_oases.training import safe_save
    from megatron_oases.training.pretrain import TrainingStopped

    target = tmp_path / "iter_0000004"
    (tmp_path / "latest_checkpointed_iteration.txt").write_text("2")

    def broken(sharded_state_dict, checkpoint_dir, *args, **kwargs):
        raise BrokenPipeError(32, "Broken pipe")

    handler = types.SimpleNamespace(sig=signal.SIGTERM, _signal_received=True)
    monkeypatch.setattr(global_vars, "_GLOBAL_SIGNAL_HANDLER", handler)
    with pytest.raises(TrainingStopped) as stopped:
        safe_save.guarded_save(broken)({}, str(target))
    assert str(stopped.value) == (
        f"saving iter_0000004 to {tmp_path} was cut short by SIGTERM (--exit-signal-handler): the "
        "signal also stopped the checkpoint writer's helper process (BrokenPipeError); the "
        f"previous checkpoint (iteration 2) is intact: resume with --load {tmp_path}"
    )
    handler._signal_received = False  # no signal: the I/O failure it is
    with pytest.raises(TrainingStopped, match=r"failed \(BrokenPipeError.*free space"):
        safe_save.guarded_save(broken)({}, str(target))


def test_a_save_after_the_writer_queues_manager_was_stopped_gets_a_new_queue(monkeypatch):
    """The save ``--exit-signal-handler`` makes after a SIGTERM to the job's processes: Megatron
    kept the queue of the manager the signal stopped (a broken pipe at once); a new one now."""
    import signal

    from megatron.core.dist_checkpointing.strategies import filesystem_async

    from megatron_oases.training import safe_save

    monkeypatch.setattr(filesystem_async, "_results_queue", None)
    get = safe_save.fresh_results_queue(filesystem_async.get_write_results_queue, filesystem_async)
    first = get(mp_mode="fork")
    assert get(mp_mode="fork") is first  # its manager serves: kept
    manager = first._manager
    os.kill(manager._process.pid, signal.SIGTERM)
    manager._process.join(10)
    second = get(mp_mode="fork")
    try:
        assert second is not first and filesystem_async._results_queue is second
        second.put("written")
        assert second.get(timeout=10) == "written"
    finally:
        second._manager.shutdown()


# ------------------------------------------------------------ issue 43: the probe's new cases


def test_demo_position_table_follows_the_users_seq_length():
    """README's and docs/compare.md's first ``oases compare`` example and ``oases train
    --seq-length 64``: the demo's ``--max-position-embeddings 32`` blamed a value the user never
    gave; the table now follows the user's sequence length (and the demo's length the table)."""
    from helpers.runs import parse

    readme = (
        "--tensor-model-parallel-size 2 --num-layers 2 --hidden-size 1024 "
        "--num-attention-heads 16 --seq-length 512 --micro-batch-size 2 --mock-data"
    )
    compare_md = (
        "--tensor-model-parallel-size 2 --num-layers 2 --hidden-size 2048 "
        "--num-attention-heads 32 --seq-length 1024 --micro-batch-size 2"
    )
    for argv, world, seq, table in (
        (readme, 2, 512, 512),
        (compare_md, 2, 1024, 1024),
        ("--seq-length 64", 1, 64, 64),
        ("--max-position-embeddings 16", 1, 16, 16),
        ("--seq-length 64 --max-position-embeddings 128", 1, 64, 128),
        ("", 1, 32, 32),  # the demo's own
    ):
        args = parse(argv, world_size=world)
        assert (args.seq_length, args.max_position_embeddings) == (seq, table), argv


def test_compare_on_a_full_out_disk_ends_at_once_with_one_line(tmp_path, monkeypatch):
    """The log of a variant's run cannot be written (``/dev/full``: ENOSPC on every write): the
    run is stopped at once and the comparison ends on one line; before, the reader thread died,
    nothing drained the ranks' output and the run waited for ``--timeout``."""
    import sys
    import time

    from megatron_oases.compare import runner
    from megatron_oases.compare.variants import VARIANTS
    from megatron_oases.errors import OasesConfigError

    if not os.path.exists("/dev/full"):
        pytest.fail("/dev/full is needed to fill a disk without mounting one")
    forever = "import sys\nwhile True: print('x' * 100, flush=True)"
    monkeypatch.setattr(
        runner, "train_command", lambda *a, **k: ([sys.executable, "-c", forever], {})
    )
    vdir = tmp_path / "megatron"
    vdir.mkdir()
    os.symlink("/dev/full", vdir / "log.txt")
    start = time.time()
    with pytest.raises(OasesConfigError) as err:
        runner.run_variant(VARIANTS["megatron"], [], str(tmp_path), 2, 0, 1, timeout=120)
    assert time.time() - start < 30
    assert str(err.value) == (
        f"cannot write {vdir / 'log.txt'} (No space left on device); the run of megatron was "
        f"stopped: free space in --out {tmp_path} (or make it writable), or choose another --out"
    )


def test_zip_writer_short_write_during_save_is_one_line(tmp_path):
    """Full disk mid-save, as found on a 3 MB tmpfs: torch's zip writer raised ``RuntimeError:
    [enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598`` (no errno) in
    Megatron's writer worker, which logged its text and raised only its class inside torch's
    ``CheckpointException``. Now one line (``TrainingStopped``) naming the intact previous
    checkpoint, the writer's ERROR lines held back and the partial directory removed."""
    import logging

    from torch.distributed.checkpoint.api import CheckpointException

    from megatron_oases.training import safe_save
    from megatron_oases.training.pretrain import TrainingStopped

    (tmp_path / "iter_0000002").mkdir()
    (tmp_path / safe_save.TRACKER).write_text("2")
    target = tmp_path / "iter_0000004"
    worker = RuntimeError(
        "Worker failure: An error is caught while starting worker 0, error: <class "
        "'RuntimeError'>"
    )
    logged = []

    class Keep(logging.Handler):
        def emit(self, record):
            logged.append(record.getMessage())

    keep = Keep()
    logger = logging.getLogger(safe_save.WRITER_LOGGER)
    logger.addHandler(keep)

    def short_write(sharded_state_dict, checkpoint_dir, *args, **kwargs):
        os.makedirs(checkpoint_dir, exist_ok=True)
        (target / "__0_0.distcp").write_bytes(b"part of a shard")
        logger.error(
            "Local worker 0 encountered an error: [enforce fail at inline_container.cc:672] . "
            "unexpected pos 704 vs 598"
        )
        raise CheckpointException("write", {0: (worker, None), 1: (worker, None)})

    def direct(sharded_state_dict, checkpoint_dir, *args, **kwargs):  # torch.save, format torch
        raise RuntimeError(
            "[enforce fail at inline_container.cc:626] . PytorchStreamWriter failed writing "
            "file data/3: file write failed"
        )

    def other_rank(sharded_state_dict, checkpoint_dir, *args, **kwargs):  # its log is not ours
        raise CheckpointException("write", {1: (worker, None)})

    try:
        with pytest.raises(TrainingStopped) as err:
            safe_save.guarded_save(short_write)({}, str(target))
    finally:
        logger.removeHandler(keep)
    line = str(err.value)
    assert line.startswith(
        f"saving iter_0000004 to {tmp_path} failed (RuntimeError: [enforce fail at "
        "inline_container.cc:672] . unexpected pos 704 vs 598 (torch's zip writer: a short "
        "write, as on a full disk), "
    ), line
    assert line.endswith(
        f"the previous checkpoint (iteration 2) is intact: fix the cause (free space, "
        f"permissions), then resume with --load {tmp_path}"
    )
    assert "\n" not in line and logged == []  # the writer's ERROR line is not repeated
    assert sorted(os.listdir(tmp_path)) == ["iter_0000002", safe_save.TRACKER]  # partial gone
    with pytest.raises(TrainingStopped, match=r"PytorchStreamWriter failed writing file data/3"):
        safe_save.guarded_save(direct)({}, str(target))
    with pytest.raises(TrainingStopped, match=r"a checkpoint writer failed, as on a full disk"):
        safe_save.guarded_save(other_rank)({}, str(target))


def _dataset(prefix, documents=8):
    import numpy
    import torch
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    rng = numpy.random.default_rng(0)
    builder = IndexedDatasetBuilder(f"{prefix}.bin", dtype=numpy.int32)
    for _ in range(documents):
        builder.add_item(torch.from_numpy(rng.integers(0, 500, size=int(rng.integers(40, 120)))))
        builder.end_document()
    builder.finalize(f"{prefix}.idx")
    return prefix


@pytest.mark.parametrize("damage", ["random-idx", "short-bin", "long-bin", "short-idx", "version"])
def test_corrupt_data_is_refused_by_the_preflight(tmp_path, damage):
    """An ``.idx`` of random bytes failed after the model was built, a ``.bin`` cut short inside
    training (hours in on a real corpus); both are one line before anything is built now."""
    from helpers.runs import parse

    from megatron_oases.errors import OasesConfigError
    from megatron_oases.training.data_check import check_data_paths

    prefix = _dataset(str(tmp_path / "corpus_text_document"))
    args = parse(
        f"--data-path {prefix} --tokenizer-type NullTokenizer --vocab-size 512", world_size=1
    )
    check_data_paths(args)  # the good pair passes
    idx, bin_ = prefix + ".idx", prefix + ".bin"
    size = os.path.getsize(bin_)
    if damage == "random-idx":
        random = os.urandom(os.path.getsize(idx))
        with open(idx, "wb") as f:
            f.write(random)
        why = f"{idx} is not a Megatron index (no MMIDIDX header)"
    elif damage == "short-bin":
        os.truncate(bin_, size - 100)
        why = f"{bin_} is truncated ({size - 100} of {size} bytes that corpus_text_document.idx"
    elif damage == "long-bin":
        with open(bin_, "ab") as f:
            f.write(b"\0" * 8)
        why = f"{bin_} holds {size + 8} bytes, corpus_text_document.idx indexes {size}"
    elif damage == "short-idx":
        os.truncate(idx, os.path.getsize(idx) - 8)
        why = f"{idx} is truncated ("
    else:
        with open(idx, "r+b") as f:
            f.seek(9)
            f.write((2).to_bytes(8, "little"))
        why = f"{idx} has index version 2, Megatron reads version 1"
    with pytest.raises(OasesConfigError) as err:
        check_data_paths(args)
    assert str(err.value).startswith(f"data prefix {prefix}: {why}"), str(err.value)
    assert str(err.value).endswith(
        "preprocess the data again (Megatron's tools/preprocess_data.py)"
    )


@pytest.mark.parametrize("flag", ["--oases-trace", "--log-json"])
def test_trace_and_log_json_paths_are_checked_like_out(tmp_path, flag):
    """A bad ``--oases-trace`` trained to the end and then lost the trace on every rank; a bad
    ``--log-json`` stopped the run after iteration 1. Both are one line before training now."""
    from helpers.runs import parse_config

    from megatron_oases.errors import OasesConfigError
    from megatron_oases.training.preflight import check_output_paths

    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    bad = blocker / "out.json"
    with pytest.raises(OasesConfigError) as err:
        check_output_paths(parse_config(f"{flag} {bad}", world_size=1))
    first = f"{blocker}/out.rank0.json" if flag == "--oases-trace" else bad
    assert str(err.value) == (
        f"{flag} {first}: {blocker} is a file, not a directory; choose another path"
    )
    if flag == "--log-json":
        with pytest.raises(OasesConfigError, match=f"{flag} {tmp_path} is a directory; name the"):
            check_output_paths(parse_config(f"{flag} {tmp_path}", world_size=1))
    later = tmp_path / "new" / "out.json"  # its directory is made later
    check_output_paths(parse_config(f"{flag} {later}", world_size=1))
    if flag == "--oases-trace":
        with pytest.raises(OasesConfigError, match=r"only \{rank\} may stand in braces"):
            check_output_paths(
                parse_config(f"{flag} {tmp_path}/t.{{rank}}.{{step}}.json", world_size=1)
            )


def test_torch_format_and_missing_index_are_told_apart_before_torch_loads(tmp_path):
    """``--ckpt-format torch`` checkpoints were called "incomplete or damaged"; a torch_dist
    checkpoint without ``.metadata`` got its line only after torch's warnings on every rank.
    Both are decided from the directory alone now (no torch load), and a torch-format file cut
    short is refused."""
    import argparse

    import torch

    from megatron_oases.errors import OasesConfigError
    from megatron_oases.training.checkpoint_check import check_torch_format_plan, check_tracker

    torch_ckpt = tmp_path / "torch"
    rank = torch_ckpt / "iter_0000002" / "mp_rank_00"
    rank.mkdir(parents=True)
    torch.save({"iteration": 2, "weights": torch.zeros(4096)}, rank / "model_optim_rng.pt")
    (torch_ckpt / "latest_checkpointed_iteration.txt").write_text("2")
    assert check_tracker(str(torch_ckpt)) == 2
    os.truncate(rank / "model_optim_rng.pt", 4000)
    with pytest.raises(OasesConfigError, match="mp_rank_00/model_optim_rng.pt is truncated"):
        check_tracker(str(torch_ckpt))

    dist = tmp_path / "dist"
    it = dist / "iter_0000004"
    it.mkdir(parents=True)
    (it / "metadata.json").write_text(
        '{"sharded_backend": "torch_dist", "sharded_backend_version": 1}'
    )
    (it / "__0_0.distcp").write_bytes(b"shard")
    (dist / "latest_checkpointed_iteration.txt").write_text("4")
    with pytest.raises(OasesConfigError) as err:
        check_tracker(str(dist))
    assert str(err.value).startswith(
        f"--load {dist}: the checkpoint of iteration 4 is incomplete or damaged: .metadata is "
        "missing (torch_dist's index of the shards); no complete checkpoint is left there"
    ), str(err.value)

    # a per-layer plan's torch-format checkpoint: each layer at its degree, no layout loads it
    plan = tmp_path / "plan.json"
    plan.write_text(json.dumps({"degrees": [2, 1]}))
    os.truncate(rank / "model_optim_rng.pt", 0)  # (not read: the saved args decide)
    saved = argparse.Namespace(oases_plan=str(plan), tensor_model_parallel_size=2)
    with pytest.raises(OasesConfigError, match=f"under the per-layer plan {plan}, each layer"):
        check_torch_format_plan(str(torch_ckpt), 2, saved)
    plan.write_text(json.dumps({"degrees": [2, 2]}))  # uniform: the stock layout
    check_torch_format_plan(str(torch_ckpt), 2, saved)


class _Crafted:
    """A ``.metadata`` that creates ``path`` when it is unpickled (as ``os.system`` would run)."""

    def __init__(self, path):
        self.path = str(path)

    def __reduce__(self):
        return (open, (self.path, "w"))


def test_older_checkpoints_metadata_is_never_unpickled(tmp_path):
    """When the tracked iteration is damaged the pre-flight looks for a complete older one to
    suggest: it unpickled every older iteration's ``.metadata`` (torch's index of the shards), so
    a crafted one ran its code from a checkpoint nothing was going to load. Only the tracked
    iteration's index is read now (torch unpickles it at the load anyway)."""
    import pickle

    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex

    from megatron_oases.errors import OasesConfigError
    from megatron_oases.training.checkpoint_check import check_tracker

    ran = tmp_path / "crafted-metadata-ran"
    ckpt = tmp_path / "ckpt"
    # the tracked iteration's index wants 100 bytes of its shard; it holds 5
    index = Metadata({}, storage_data={MetadataIndex("w"): _StorageInfo("__0_0.distcp", 0, 100)})
    for it, metadata, shard in ((2, _Crafted(ran), b"shard"), (4, index, b"short")):
        d = ckpt / f"iter_{it:07d}"
        d.mkdir(parents=True)
        (d / "metadata.json").write_text('{"sharded_backend": "torch_dist"}')
        (d / ".metadata").write_bytes(pickle.dumps(metadata))
        (d / "__0_0.distcp").write_bytes(shard)
    (ckpt / "latest_checkpointed_iteration.txt").write_text("4")
    with pytest.raises(OasesConfigError) as err:
        check_tracker(str(ckpt))
    assert str(err.value) == (
        f"--load {ckpt}: the checkpoint of iteration 4 is incomplete or damaged: __0_0.distcp is "
        f"truncated (5 of 100 bytes); write 2 (a complete checkpoint there) into "
        f"{ckpt / 'latest_checkpointed_iteration.txt'}"
    )
    assert not ran.exists()  # the older iteration's index was never unpickled
    (ckpt / "iter_0000002" / "__0_0.distcp").write_bytes(b"")  # judged by its files: not offered
    with pytest.raises(OasesConfigError, match="no complete checkpoint is left there"):
        check_tracker(str(ckpt))
    assert not ran.exists()


def test_per_layer_plan_with_torch_format_checkpoints_is_refused_up_front(tmp_path):
    from helpers.runs import parse

    from megatron_oases.errors import OasesConfigError
    from megatron_oases.formats.plan import load_plan
    from megatron_oases.validation import check_plan_checkpoint_format

    path = tmp_path / "plan.json"
    path.write_text(json.dumps({"version": 1, "tensor_model_parallel_size": 2, "degrees": [2, 1]}))
    plan = load_plan(str(path), num_layers=2, tensor_model_parallel_size=2)
    flags = f"--tensor-model-parallel-size 2 --save {tmp_path / 'ckpt'}"
    args = parse(f"{flags} --ckpt-format torch", world_size=2)
    with pytest.raises(OasesConfigError, match="^--oases-plan with --ckpt-format torch: "):
        check_plan_checkpoint_format(plan, args)
    check_plan_checkpoint_format(plan, parse(flags, world_size=2))  # torch_dist: stock layout


def test_patched_pretrain_gpt_on_cpu_without_the_cpu_settings_names_the_fix(monkeypatch, capsys):
    """Megatron-LM's ``pretrain_gpt.py`` (patched) on a CUDA-less host without the CPU settings
    died in NCCL's init with a traceback per rank; ``install`` (the patch's call after parsing)
    now exits 2 with one line naming ``defaults --cpu``."""
    from megatron_oases import megatron_lm
    from megatron_oases.arguments import parse_megatron_args, with_defaults
    from megatron_oases.megatron_lm.hooks import CPU_SETTINGS, check_cpu_settings

    monkeypatch.setattr("megatron_oases.errors.ERROR_EXIT_GRACE_S", 0)
    monkeypatch.setenv("RANK", "0")
    argv = "--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 32 "
    argv += "--max-position-embeddings 32 --micro-batch-size 2 --train-iters 2 --lr 1e-3 "
    argv = (argv + "--mock-data --tokenizer-type NullTokenizer --vocab-size 512").split()
    gpu = parse_megatron_args(with_defaults(argv, cuda=True), prog="test", world_size=1)
    cpu = parse_megatron_args(with_defaults(argv, cuda=False), prog="test", world_size=1)
    assert all(hasattr(cpu, name) for name, _, _ in CPU_SETTINGS)  # Megatron's names
    check_cpu_settings(cpu, cuda=False)
    check_cpu_settings(gpu, cuda=True)
    monkeypatch.setattr("torch.cuda.is_available", lambda: False)
    try:
        with pytest.raises(SystemExit) as exc:
            megatron_lm.install(gpu, prog="pretrain_gpt.py")
    finally:
        megatron_lm.uninstall()
    assert exc.value.code == 2
    err = [ln for ln in capsys.readouterr().err.splitlines() if ": error: " in ln]
    assert len(err) == 1 and err[0].startswith(
        "pretrain_gpt.py: error: no CUDA GPU here, but Megatron-LM's GPU defaults are on "
        "(--distributed-backend nccl, "
    ), err
    assert err[0].endswith(
        "add the CPU settings to the command line: "
        "$(python -m megatron_oases.megatron_lm defaults --cpu)"
    )


def test_compare_derives_nproc_from_the_parallel_sizes(tmp_path):
    """``oases compare --one-rank -- --tensor-model-parallel-size 4`` without ``--nproc`` failed
    with "world size (2) is not divisible by total_model_size 4", a world size the user never
    gave; it runs 4 ranks now, and a --nproc that cannot hold the model is one line."""
    from megatron_oases.cli import main
    from megatron_oases.compare.settings import resolve_nproc as _nproc
    from megatron_oases.errors import OasesConfigError

    assert _nproc(None, "--tensor-model-parallel-size 4".split()) == 4
    assert (
        _nproc(None, "--tensor-model-parallel-size=2 --pipeline-model-parallel-size 2".split()) == 4
    )
    assert _nproc(None, []) == 2  # TP=PP=1: two data-parallel ranks, as before
    assert _nproc(8, "--tensor-model-parallel-size 4".split()) == 8
    with pytest.raises(OasesConfigError) as err:
        _nproc(2, "--tensor-model-parallel-size 4".split())
    assert str(err.value) == (
        "--nproc 2 is not a multiple of the model-parallel size 4 (tensor x pipeline x context "
        "parallel); use --nproc 4 or leave --nproc out"
    )
    argv = ["compare", "--one-rank", "--emulate-link", "rtx3090-pcie", "--nproc", "2"]
    argv += ["--out", str(tmp_path / "cmp"), "--", "--tensor-model-parallel-size", "4"]
    assert main(argv) == 2


def test_split_schedule_at_tp1_warns_once_that_nothing_overlaps(monkeypatch, capsys):
    """TP=1 under an Oases schedule ran with no word (0.48x in the report): one warning line."""
    from helpers.runs import parse

    from megatron_oases.config import OasesConfig

    monkeypatch.setenv("RANK", "0")
    parse("--oases-schedule overlap", world_size=1)  # Megatron's checks, then OasesConfig's
    err = [ln for ln in capsys.readouterr().err.splitlines() if "oases: warning" in ln]
    assert err == [
        "oases: warning: --oases-schedule overlap at --tensor-model-parallel-size 1 has no "
        "tensor-parallel communication to overlap: it only splits the matmuls (slower than "
        "--oases-schedule off); use --tensor-model-parallel-size 2 or more"
    ]
    parse("--tensor-model-parallel-size 2 --oases-schedule overlap", world_size=2)
    parse("", world_size=1)
    monkeypatch.setenv("RANK", "1")
    OasesConfig.from_args(parse("--oases-schedule overlap", world_size=1))  # rank 0 only
    assert "oases: warning" not in capsys.readouterr().err


def test_viz_and_calibrate_bad_input_is_one_line(tmp_path, capsys):
    """``viz`` printed a traceback for a damaged trace or a bad ``--emulated``; ``calibrate``
    accepted ``--threads 0`` and died on ``--hidden-size 0``."""
    from megatron_oases.cli import main
    from megatron_oases.viz.__main__ import main as viz

    bad = tmp_path / "trace.rank0.json"
    bad.write_text('{"traceEvents": ')
    for argv, line in (
        ([str(bad)], f"{bad} is not a trace written by --oases-trace (JSONDecodeError: "),
        (["--emulated", "rtx3090-pcie:abc", str(bad)], "--emulated rtx3090-pcie:abc: expected "),
        (["--emulated", "nope:2", str(bad)], "unknown cluster profile 'nope'"),
    ):
        assert viz(argv) == 2, argv
        err = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]
        assert len(err) == 1 and err[0].startswith(f"python -m megatron_oases.viz: error: {line}")
    for argv, line in (
        (["--threads", "0"], "--threads 0: must be >= 1"),
        (["--hidden-size=0"], "--hidden-size 0: must be >= 1"),
    ):
        assert main(["calibrate", *argv]) == 2, argv
        err = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]
        assert err == [f"oases calibrate: error: {line}"], err


@pytest.mark.parametrize(
    "env,line",
    [
        ({"LR": "abc"}, "error: LR=abc: must be a number, e.g. LR=1.0e-4"),
        ({"TP": "0"}, "error: TP=0: must be a positive integer"),
        ({"GPUS_PER_NODE": "0"}, "error: GPUS_PER_NODE=0: must be a positive integer"),
        (
            {"TP": "4"},
            "error: GPUS_PER_NODE x NUM_NODES = 2 ranks is not a multiple of TP x PP = 4; change "
            "GPUS_PER_NODE, TP or PP",
        ),
    ],
)
def test_slurm_script_bad_values_are_one_line(env, line):
    """The SLURM script answered ``LR=abc`` with a Python traceback, ``TP=0`` with bash's
    "division by 0" and ``GPUS_PER_NODE=0`` with a torchrun assertion."""
    import subprocess
    import sys

    from helpers.paths import REPO

    script = os.path.join(REPO, "launch_scripts", "slurm_pretrain_gpt_oases.sh")
    keep = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    for k in ("TP", "PP", "LR", "GPUS_PER_NODE", "NUM_NODES", "MODEL", "DEVICE"):
        keep.pop(k, None)
    full = dict(keep, DRY_RUN="1", DEVICE="cpu", PYTHON=sys.executable, **env)
    proc = subprocess.run(["bash", script], env=full, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert proc.stderr.splitlines() == [line], proc.stderr[-2000:]
    assert "oases launch:" not in proc.stdout  # refused before the command line is built
