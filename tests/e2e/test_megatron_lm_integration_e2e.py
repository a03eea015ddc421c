"""Megatron-LM integration on the real package: ``oases-pretrain-gpt`` under torchrun, the patched
``pretrain_gpt.py``'s calls, the launch scripts' helper and dry runs, and the CPU demo.

Every run goes through Megatron-LM's own ``pretrain()`` (``megatron.training`` from the
megatron-core wheel) on 2 CPU/gloo ranks. Megatron-LM's ``pretrain_gpt.py`` itself is not in the
wheel and CI has no network, so :data:`PATCHED_FLOW` runs the patched ``__main__``'s calls —
``parse_and_validate_args`` with our provider, ``install``, ``pretrain`` on a config container —
with our dataset provider and forward step in place of the script's own.
"""

import json
import os
import re
import shlex
import subprocess
import sys
import types

import helpers
import pytest
from helpers.console import console_script, torchrun
from helpers.paths import LAUNCHER, REPO
from helpers.variants import MEGATRON_LM_MOCK as MOCK
from helpers.variants import MEGATRON_LM_TINY as TINY

from megatron_oases.arguments import CPU_DEFAULTS, LOOP_DEFAULTS

PROG = "oases-pretrain-gpt"

RECOMPUTE = helpers.RECOMPUTE.split()


def _flags(defaults):
    return [tok for flag, value in defaults for tok in ([flag] if value is None else [flag, value])]


#: What ``oases-pretrain-gpt`` adds by itself when absent; a patched pretrain_gpt.py takes
#: Megatron-LM's flags as given, so these are spelled out there.
CPU_FLAGS, LOOP_FLAGS = _flags(CPU_DEFAULTS), _flags(LOOP_DEFAULTS)

#: The calls the patch adds to Megatron-LM core_v0.19's pretrain_gpt.py ``__main__``, around the
#: script's own ``parse_and_validate_args`` / ``pretrain_cfg_container_from_args`` / ``pretrain``.
PATCHED_FLOW = """\
from megatron.core.enums import ModelType
from megatron.training import pretrain
from megatron.training.argument_utils import gpt_config_from_args, pretrain_cfg_container_from_args
from megatron.training.arguments import parse_and_validate_args

from megatron_oases import megatron_lm as oases_megatron_lm
from megatron_oases.training import gpt

if __name__ == "__main__":
    args = parse_and_validate_args(
        extra_args_provider=oases_megatron_lm.extra_args_provider(None),
        args_defaults={'tokenizer_type': 'GPT2BPETokenizer'},
    )
    oases_megatron_lm.install(args)
    full_config = pretrain_cfg_container_from_args(args, gpt_config_from_args(args))
    pretrain(
        full_config,
        gpt.train_valid_test_datasets_provider,
        ModelType.encoder_or_decoder,
        gpt.forward_step,
    )
"""


def _console_script():
    return console_script(PROG)


def _losses(path):
    with open(path) as f:
        return json.load(f)["lm loss"]["values"]


def _console_losses(log):
    """``{iteration: lm loss}`` from Megatron's ``training_log`` lines."""
    return {
        int(it): float(loss)
        for it, loss in re.findall(r" iteration +(\d+)/ *\d+ \|.*? lm loss: ([0-9.E+-]+) \|", log)
    }


def _sub_batch_comms(trace_path):
    with open(trace_path) as f:
        events = json.load(f)["traceEvents"]
    return [e for e in events if e.get("cat") == "comm" and e["args"].get("sub_batch", -1) >= 0]


# ------------------------------------------------------------------------- end to end (torchrun)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Three 3-iteration TP=2 runs on mock data, shared by the tests below (~30 s each):
    ``off`` and ``oases`` through ``oases-pretrain-gpt``, ``patched`` through :data:`PATCHED_FLOW`
    with ``--oases-schedule oases`` and a trace."""
    tmp = tmp_path_factory.mktemp("megatron_lm_runs")
    script = tmp / "pretrain_gpt_patched_flow.py"
    script.write_text(PATCHED_FLOW)
    common = TINY + MOCK + ["--train-iters", "3"]
    out = {}
    for name, program, extra in (
        ("off", _console_script(), ["--oases-schedule", "off", *RECOMPUTE]),
        ("oases", _console_script(), ["--oases-schedule", "oases", *RECOMPUTE]),
        (
            "patched",
            str(script),
            [
                "--oases-schedule",
                "oases",
                *RECOMPUTE,
                "--oases-trace",
                str(tmp / "trace.json"),
                *CPU_FLAGS,
                *LOOP_FLAGS,
            ],
        ),
    ):
        golden = tmp / f"golden-{name}.json"
        rc, log = torchrun(program, common + extra + ["--log-json", str(golden)])
        out[name] = types.SimpleNamespace(rc=rc, log=log, golden=golden, tmp=tmp)
    return out


def _ok(run):
    assert run.rc == 0, run.log[-6000:]
    return run


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_oases_pretrain_gpt_runs_megatron_lm_loop(runs):
    for name in ("off", "oases"):
        log = _ok(runs[name]).log
        for needed in (
            "> building train, validation, and test datasets for GPT ...",
            "[after training is done]",
            "  oases_schedule .................................. " + name,
            "  transformer_impl ................................ local",
        ):
            assert needed in log, f"{name}: {needed!r} missing\n{log[-3000:]}"
        console = _console_losses(log)
        assert sorted(console) == [1, 2, 3], log[-3000:]
        golden = _losses(runs[name].golden)
        # Megatron's console line at iteration 1 is that iteration's loss (later lines average
        # over the log interval); the golden values are per iteration.
        assert console[1] == pytest.approx(golden[0], rel=1e-6)


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_golden_values_equal_between_schedules(runs):
    off, oases = _losses(_ok(runs["off"]).golden), _losses(_ok(runs["oases"]).golden)
    assert len(off) == len(oases) == 3
    with open(runs["oases"].golden) as f:
        golden = json.load(f)
    assert golden["lm loss"]["start_step"] == 1 and golden["lm loss"]["end_step"] == 3
    assert all(t > 0 for t in golden["iteration-time"]["values"])
    for a, b in zip(off, oases):
        assert b == pytest.approx(a, rel=1e-5), (off, oases)


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_patched_pretrain_gpt_flow_installs_the_schedule(runs):
    """The patch's calls: the schedule runs (sub-batch communication in the trace of each rank,
    written at exit) and the losses equal stock Megatron's."""
    run = _ok(runs["patched"])
    assert _losses(run.golden) == pytest.approx(_losses(_ok(runs["off"]).golden), rel=1e-5)
    for rank in (0, 1):
        comms = _sub_batch_comms(run.tmp / f"trace.rank{rank}.json")
        assert comms and {e["args"]["pass"] for e in comms} == {"forward", "backward"}


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_bad_flag_combination_is_one_line_per_job_exit_2():
    rc, log = torchrun(
        _console_script(), TINY + MOCK + ["--train-iters", "3", "--oases-schedule", "oases"]
    )
    expected = (
        f"{PROG}: error: --oases-schedule oases merges recompute with backward; add "
        "--recompute-granularity full or use --oases-schedule overlap"
    )
    errors = [ln for ln in log.splitlines() if ": error:" in ln]
    assert errors == [expected], log[-4000:]
    assert rc != 0 and re.search(r"exitcode\s*:\s*2\b", log), log[-3000:]
    # No traceback from the ranks (torchrun's own, after it saw the exit status, is expected).
    assert "Traceback" not in log.split("failed (exitcode: 2)")[0], log[-3000:]


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_help_lists_the_oases_flags():
    proc = subprocess.run(
        [_console_script(), "--help"],
        capture_output=True,
        text=True,
        timeout=110,
        env=dict(os.environ, OMP_NUM_THREADS="1"),
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    for flag in (
        "--oases-schedule",
        "--oases-trace",
        "--oases-plan",
        "--emulate-link",
        "--log-json",
    ):
        assert flag in proc.stdout, flag
    assert "{off,overlap,cross-pass,oases,auto}" in proc.stdout
    assert "--tensor-model-parallel-size" in proc.stdout  # Megatron-LM's own flags too


def _write_indexed_dataset(prefix, vocab, documents=64, seed=0):
    import numpy
    import torch
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    rng = numpy.random.default_rng(seed)
    builder = IndexedDatasetBuilder(f"{prefix}.bin", dtype=numpy.int32)
    for _ in range(documents):
        builder.add_item(
            torch.from_numpy(rng.integers(0, vocab - 1, size=int(rng.integers(40, 120))))
        )
        builder.end_document()
    builder.finalize(f"{prefix}.idx")


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_train_from_data_path(tmp_path):
    """A real Megatron indexed dataset (``--data-path``) with the NullTokenizer."""
    prefix = tmp_path / "tiny_text_document"
    _write_indexed_dataset(str(prefix), vocab=512)
    golden = tmp_path / "golden.json"
    argv = TINY + [
        "--train-iters",
        "2",
        "--data-path",
        str(prefix),
        "--split",
        "100,0,0",
        "--data-cache-path",
        str(tmp_path / "cache"),
        "--tokenizer-type",
        "NullTokenizer",
        "--vocab-size",
        "512",
        "--oases-schedule",
        "oases",
        *RECOMPUTE,
        "--log-json",
        str(golden),
    ]
    rc, log = torchrun(_console_script(), argv)
    assert rc == 0, log[-6000:]
    assert "  mock_data ....................................... False" in log
    assert re.search(r"Build and save the GPTDataset train indices", log), log[-3000:]
    assert sorted(_console_losses(log)) == [1, 2]
    losses = _losses(golden)
    assert len(losses) == 2 and all(0 < v < 20 for v in losses)
    assert list((tmp_path / "cache").rglob("*.npy")), "GPTDataset wrote no index cache"


def _helper(*args):
    return subprocess.run(
        [sys.executable, "-m", "megatron_oases.megatron_lm", *args],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=REPO,
    )


MATRIX_FILE = "megatron_oases/configs/compare_matrix.yaml"  # what compare_vs_megatron.sh passes


def test_helper_cli_for_bash():
    out = _helper("flags", "tiny-cpu", "--section", "model")
    assert out.returncode == 0 and out.stdout.split()[:2] == ["--num-layers", "2"]
    assert (
        _helper("get", "gpt-18.4b", "parallel.pipeline-model-parallel-size").stdout.strip() == "4"
    )
    assert _helper("get", "tiny-cpu", "training.nope", "7").stdout.strip() == "7"
    out = _helper("matrix", MATRIX_FILE, "ci")
    lines = out.stdout.strip().splitlines()
    assert [ln.split("\t")[:4] for ln in lines] == [
        ["megatron-tp2-pp1", "2", "1", "off"],
        ["oases-tp2-pp1", "2", "1", "oases"],
    ]
    assert _helper("matrix", MATRIX_FILE, "ci", "--field", "baseline").stdout.strip() == "megatron"
    bad = _helper("matrix", MATRIX_FILE, "nope")
    assert bad.returncode == 2 and "no matrix 'nope'" in bad.stderr
    assert shlex.split(_helper("defaults").stdout) == LOOP_FLAGS
    assert shlex.split(_helper("defaults", "--cpu").stdout) == LOOP_FLAGS + CPU_FLAGS


def _dry_run(tmp_path, **env):
    full = dict(
        os.environ,
        PYTHON=sys.executable,
        DRY_RUN="1",
        DEVICE="cpu",
        MASTER_PORT="29999",
        PATH=os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", ""),
    )
    full.pop("SLURM_JOB_ID", None)
    full.update({k: str(v) for k, v in env.items()})
    return subprocess.run(
        ["bash", LAUNCHER], capture_output=True, text=True, timeout=60, env=full, cwd=tmp_path
    )


def _program_and_flags(stdout):
    cmd = [ln for ln in stdout.splitlines() if ln.startswith("oases launch: ") and "--" in ln][-1]
    return shlex.split(cmd[len("oases launch: ") :])


def test_launcher_entries(tmp_path):
    """ENTRY picks the program; each gets the same Megatron-LM flags (DRY_RUN prints them)."""
    mlm = tmp_path / "Megatron-LM"
    mlm.mkdir()
    (mlm / "pretrain_gpt.py").write_text("# stands for a patched checkout; never run\n")
    commands = {}
    for entry, extra in (
        ("oases-train", {}),
        ("pretrain-gpt-oases", {}),
        ("pretrain-gpt", {"MEGATRON_LM_DIR": mlm}),
    ):
        proc = _dry_run(
            tmp_path, ENTRY=entry, OASES_SCHEDULE="oases", EXTRA_ARGS=" ".join(RECOMPUTE), **extra
        )
        assert proc.returncode == 0, proc.stderr
        commands[entry] = _program_and_flags(proc.stdout)
    assert commands["oases-train"][:3] == ["-m", "megatron_oases", "train"]
    assert os.path.basename(commands["pretrain-gpt-oases"][0]) == PROG
    assert commands["pretrain-gpt"][0] == str(mlm / "pretrain_gpt.py")
    flags = commands["pretrain-gpt"][1:]
    for needed in ("--max-position-embeddings", "--oases-schedule", "--log-json", "--mock-data"):
        assert needed in flags, needed
    # A patched checkout's pretrain_gpt.py gets no defaults from us: the CPU and loop flags are
    # spelled out there; the oases entries add them themselves.
    assert all(flag in flags for flag in CPU_FLAGS + LOOP_FLAGS)
    assert "--use-cpu-initialization" not in commands["pretrain-gpt-oases"]
    # Everything Megatron-LM accepts: the oases-pretrain-gpt command line parses and validates.
    sample = commands["pretrain-gpt-oases"][1:]
    assert sample[sample.index("--oases-schedule") + 1] == "oases"


def test_launcher_rejects_bad_entries(tmp_path):
    proc = _dry_run(tmp_path, ENTRY="pretrain-gpt", MEGATRON_LM_DIR="")
    assert proc.returncode == 2 and "needs MEGATRON_LM_DIR" in proc.stderr
    proc = _dry_run(tmp_path, ENTRY="pretrain-gpt", MEGATRON_LM_DIR=tmp_path)
    assert proc.returncode == 2 and "has no pretrain_gpt.py" in proc.stderr
    proc = _dry_run(tmp_path, ENTRY="nope")
    assert (
        proc.returncode == 2
        and "choose oases-train, pretrain-gpt-oases or pretrain-gpt" in proc.stderr
    )


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_cpu_demo_script(tmp_path):
    """launch_scripts/run_cpu_demo.sh: 2 gloo ranks, tiny model, no SLURM."""
    golden = str(tmp_path / "demo.json")
    env = dict(
        os.environ,
        PYTHON=sys.executable,
        TRAIN_ITERS="2",
        LOG_JSON=golden,
        PATH=os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", ""),
    )
    proc = subprocess.run(
        ["bash", os.path.join(REPO, "launch_scripts", "run_cpu_demo.sh")],
        capture_output=True,
        text=True,
        timeout=230,
        env=env,
        cwd=str(tmp_path),
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "entry=oases-train model=tiny-cpu device=cpu" in proc.stdout
    assert re.search(r"^lm loss: [\d.]+ [\d.]+$", proc.stdout, re.M), proc.stdout
    with open(golden) as f:
        assert len(json.load(f)["lm loss"]["values"]) == 2
