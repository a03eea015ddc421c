"""Megatron-LM integration on the real package: ``oases-pretrain-gpt`` under torchrun, the calls
``patches/pretrain_gpt.oases.patch`` adds to Megatron-LM's ``pretrain_gpt.py``, and the model
configs and comparison matrix the launch scripts turn into Megatron-LM flags.

Every run goes through Megatron-LM's own ``pretrain()`` (``megatron.training`` from the
megatron-core wheel) on 2 CPU/gloo ranks. Megatron-LM's ``pretrain_gpt.py`` itself is not in the
wheel and CI has no network, so the patch is checked as a diff here (``patches/README.md`` records
its manual verification on a real checkout), and :data:`PATCHED_FLOW` runs the patched
``__main__``'s calls — ``parse_and_validate_args`` with our provider, ``install``, ``pretrain`` on a
config container — with our dataset provider and forward step in place of the script's own.
"""

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import types

import helpers
import pytest

from megatron_oases import megatron_lm, patches, resources
from megatron_oases.arguments import CPU_DEFAULTS, LOOP_DEFAULTS
from megatron_oases.errors import OasesConfigError
from megatron_oases.launch import torchrun_command
from megatron_oases.megatron_lm import configs

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PATCH = os.path.join(REPO, "patches", "pretrain_gpt.oases.patch")
PROG = "oases-pretrain-gpt"

#: Megatron-LM flags of the tiny model; dropout 0 so that schedules can be compared exactly.
TINY = (
    "--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 32 "
    "--max-position-embeddings 32 --micro-batch-size 2 --global-batch-size 4 --lr 1e-3 "
    "--log-interval 1 --attention-dropout 0 --hidden-dropout 0 --tensor-model-parallel-size 2"
).split()
MOCK = "--mock-data --tokenizer-type NullTokenizer --vocab-size 512".split()
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
    path = shutil.which(
        PROG, path=os.path.dirname(sys.executable) + os.pathsep + os.environ["PATH"]
    )
    assert path, f"{PROG} is not installed next to {sys.executable} (pip install -e .)"
    return path


def torchrun(program, argv, nproc=2, timeout=240, cwd=None):
    """``torchrun --nproc_per_node N PROGRAM ARGV`` with this interpreter; stdout+stderr together."""
    cmd = torchrun_command(argv, nproc, program=program)
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run(
        cmd,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        timeout=timeout,
        env=env,
        cwd=cwd,
    )
    return proc.returncode, proc.stdout


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
    assert "{off,overlap,cross-pass,oases}" in proc.stdout
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


# ------------------------------------------------------------- patches/pretrain_gpt.oases.patch


def _hunks(text):
    """[(old_start, old_len, new_start, new_len, lines)] of a one-file unified diff; checks counts."""
    hunks = []
    header = re.compile(r"^@@ -(\d+)(?:,(\d+))? \+(\d+)(?:,(\d+))? @@")
    lines = text.splitlines()
    i = 0
    while i < len(lines):
        m = header.match(lines[i])
        if not m:
            i += 1
            continue
        old_start, old_len, new_start, new_len = (int(g) if g else 1 for g in m.groups())
        body, old, new = [], 0, 0
        i += 1
        while i < len(lines) and (old < old_len or new < new_len):
            line = lines[i]
            assert line[:1] in (" ", "-", "+"), f"bad hunk line {line!r}"
            old += line[:1] in (" ", "-")
            new += line[:1] in (" ", "+")
            body.append(line)
            i += 1
        assert (old, new) == (old_len, new_len), f"hunk @@ -{old_start} counts do not match"
        hunks.append((old_start, old_len, new_start, new_len, body))
    return hunks


def test_patch_is_a_well_formed_diff_of_pretrain_gpt_only():
    with open(PATCH) as f:
        text = f.read()
    assert re.findall(r"^diff --git a/(\S+) b/(\S+)$", text, re.M) == [
        ("pretrain_gpt.py", "pretrain_gpt.py")
    ]
    assert re.findall(r"^(?:---|\+\+\+) (\S+)$", text, re.M) == [
        "a/pretrain_gpt.py",
        "b/pretrain_gpt.py",
    ]
    assert re.search(r"^index [0-9a-f]{7,40}\.\.[0-9a-f]{7,40} 100644$", text, re.M)
    hunks = _hunks(text)
    assert len(hunks) == 2
    added = [ln[1:] for *_, body in hunks for ln in body if ln.startswith("+")]
    removed = [ln[1:] for *_, body in hunks for ln in body if ln.startswith("-")]
    # The only line of Megatron-LM's replaced: the provider passed to parse_and_validate_args.
    assert [ln.strip() for ln in removed] == [
        "extra_args_provider=add_modelopt_args if has_nvidia_modelopt else None,"
    ]
    assert "from megatron_oases import megatron_lm as oases_megatron_lm" in added
    # Line offsets stay consistent: each hunk shifts later ones by its net added lines.
    shift = 0
    for old_start, old_len, new_start, new_len, _ in hunks:
        assert new_start == old_start + shift
        shift += new_len - old_len


def test_patch_calls_existing_megatron_oases_functions():
    with open(PATCH) as f:
        added = "\n".join(
            ln[1:]
            for ln in f.read().splitlines()
            if ln.startswith("+") and not ln.startswith("+++")
        )
    called = set(re.findall(r"oases_megatron_lm\.(\w+)\(", added))
    assert called == {"extra_args_provider", "install"}
    for name in called:
        assert callable(getattr(megatron_lm, name)), name
    assert megatron_lm.MEGATRON_LM_TAG.startswith("core_v0.19.")


def _git(*args, cwd):
    return subprocess.run(["git", *args], cwd=cwd, capture_output=True, text=True, timeout=60)


def test_patch_applies_to_its_own_preimage_and_reverts(tmp_path):
    """``git apply`` accepts the diff against the text it claims to change (context and removed
    lines, with the unchanged lines between hunks elided) and produces the added lines."""
    with open(PATCH) as f:
        text = f.read()
    hunks = _hunks(text)
    pre, post = [], []
    for *_, body in hunks:
        pre += [ln[1:] for ln in body if ln[:1] in (" ", "-")] + ["# (elided)"]
        post += [ln[1:] for ln in body if ln[:1] in (" ", "+")] + ["# (elided)"]
    (tmp_path / "pretrain_gpt.py").write_text("\n".join(pre) + "\n")
    assert _git("init", "-q", cwd=tmp_path).returncode == 0
    check = _git("apply", "--check", "-v", PATCH, cwd=tmp_path)
    assert check.returncode == 0, check.stderr
    assert _git("apply", PATCH, cwd=tmp_path).returncode == 0
    assert (tmp_path / "pretrain_gpt.py").read_text() == "\n".join(post) + "\n"
    assert _git("apply", "-R", "--check", PATCH, cwd=tmp_path).returncode == 0


# ------------------------------------------------------------------ megatron_oases.megatron_lm


@pytest.fixture
def megatron_parse(monkeypatch):
    """Megatron-LM's own ``parse_args`` on a command line (no global state, no process group)."""
    from megatron.training import arguments as margs

    monkeypatch.setattr(megatron_lm.hooks, "_install_cpu_shims", lambda: False)
    monkeypatch.setenv("CUDA_DEVICE_MAX_CONNECTIONS", "1")

    def parse(argv, existing=None):
        monkeypatch.setattr(sys, "argv", ["pretrain_gpt.py", *argv])
        return margs.parse_args(megatron_lm.extra_args_provider(existing))

    return parse


def test_extra_args_provider_chains_the_existing_provider(megatron_parse):
    seen = []

    def modelopt_like(parser):
        seen.append(parser)
        parser.add_argument("--existing-flag", type=int, default=3)
        return parser

    args = megatron_parse(TINY + MOCK + ["--oases-schedule", "overlap"], existing=modelopt_like)
    assert len(seen) == 1 and args.existing_flag == 3
    assert args.oases_schedule == "overlap" and args.log_json is None
    assert args.transformer_impl == "local"  # our default; Megatron-LM's is transformer_engine
    args = megatron_parse(TINY + MOCK + ["--transformer-impl", "transformer_engine"])
    assert args.transformer_impl == "transformer_engine"  # an explicit flag wins (and is rejected)


@pytest.mark.parametrize("rank,printed", [(0, True), (1, False)])
def test_install_rejects_a_bad_combination_once_per_job(
    megatron_parse, monkeypatch, capsys, rank, printed
):
    monkeypatch.setenv("RANK", str(rank))
    monkeypatch.setattr("megatron_oases.errors.ERROR_EXIT_GRACE_S", 0)
    args = megatron_parse(TINY + MOCK + ["--oases-schedule", "cross-pass"])
    with pytest.raises(SystemExit) as exc:
        megatron_lm.install(args)
    assert exc.value.code == 2
    err = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]
    expected = (
        "pretrain_gpt.py: error: --oases-schedule cross-pass merges recompute with backward; "
        "add --recompute-granularity full or use --oases-schedule overlap"
    )
    assert err == ([expected] if printed else [])
    assert megatron_lm.HOOK_PATCH not in patches.installed()


def test_install_hooks_megatron_model_setup_once(megatron_parse, monkeypatch):
    """``install`` installs nothing but the hook on ``setup_model_and_optimizer`` (idempotent);
    ``uninstall`` restores Megatron's function."""
    from megatron.training import training

    original = training.setup_model_and_optimizer
    args = megatron_parse(TINY + MOCK + RECOMPUTE + ["--oases-schedule", "oases"])
    try:
        megatron_lm.install(args)
        megatron_lm.install(args)
        assert patches.installed() == [megatron_lm.HOOK_PATCH]
        assert training.setup_model_and_optimizer.__wrapped__ is original
    finally:
        megatron_lm.uninstall()
    assert patches.installed() == [] and training.setup_model_and_optimizer is original


def _fake_pretrain(setup_model_and_optimizer):
    """A stand-in for ``megatron.training.training``'s ``pretrain`` → ``setup_model_and_optimizer``."""
    return setup_model_and_optimizer("model_type")


def test_model_setup_hook_installs_the_patches_before_the_build(
    megatron_parse, monkeypatch, tmp_path
):
    """Called by ``pretrain()``: the patches install first, then Megatron builds; a plan becomes a
    pre-wrap hook of the model config (or wraps an old-style model provider)."""
    import megatron.training as mtraining

    from megatron_oases.formats.plan import save_plan, uniform_plan

    plan = save_plan(uniform_plan(2, 2, schedule="overlap"), str(tmp_path / "plan.json"))
    args = megatron_parse(
        TINY + MOCK + ["--log-json", str(tmp_path / "g.json"), "--oases-plan", plan]
    )
    monkeypatch.setattr(mtraining, "get_args", lambda: args)
    seen = []

    def setup_model_and_optimizer(model_type, model_provider_func=None, *rest, **kwargs):
        seen.append(dict(patches=patches.installed(), provider=model_provider_func, **kwargs))
        return "model", "optimizer", "scheduler"

    training = types.SimpleNamespace(
        __name__="training",
        setup_model_and_optimizer=setup_model_and_optimizer,
        pretrain=_fake_pretrain,
    )
    hook = megatron_lm.model_setup_hook(training_module=training)
    hook.install()
    try:
        model_cfg = types.SimpleNamespace(pre_wrap_hooks=[])
        container = types.SimpleNamespace(model=model_cfg)
        out = training.setup_model_and_optimizer("type", None, cfg_container=container)
        assert out == ("model", "optimizer", "scheduler")
        assert {"golden-values", "oases-schedule"} <= set(seen[0]["patches"])
        assert len(model_cfg.pre_wrap_hooks) == 1  # attaches the plan to each built stage
        provider = lambda *a, **k: "stage"  # noqa: E731
        training.setup_model_and_optimizer("type", model_provider_func=provider)
        assert seen[1]["provider"].__wrapped__ is provider
    finally:
        hook.uninstall()
        patches.uninstall_all()
    assert training.setup_model_and_optimizer is setup_model_and_optimizer


# ------------------------------------------------------------------------- configs and scripts

TABLE4 = {  # H: (L, heads, TMP, DP, global batch) — Oases paper, Appendix B.2
    1024: (24, 16, 2, 16, 256),
    2048: (24, 32, 4, 8, 128),
    3072: (24, 48, 4, 8, 32),
    4096: (16, 64, 4, 8, 32),
    6144: (16, 96, 8, 4, 8),
    8192: (8, 128, 8, 4, 8),
    12288: (4, 192, 8, 4, 8),
}
TABLE5 = {  # name: (H, L, heads, PP, TP, DP, micro-batch, billions of parameters)
    "gpt-18.4b": (6144, 40, 48, 4, 4, 2, 2, 18.4),
    "gpt-39.1b": (8192, 48, 64, 4, 8, 1, 2, 39.1),
}


@pytest.fixture
def megatron_validate(monkeypatch):
    """Megatron-LM's parse + validate (and ours) of a config's flags as on ``world_size`` GPUs."""
    from megatron.training import arguments as margs

    from megatron_oases.arguments import parse_megatron_args, with_defaults

    monkeypatch.setattr(margs, "get_device_arch_version", lambda: 9)  # Hopper; no GPU queried
    monkeypatch.setenv("CUDA_DEVICE_MAX_CONNECTIONS", "1")

    def validate(cfg, world_size, extra=()):
        argv = configs.model_flags(cfg) + ["--mock-data", "--train-iters", "10", *extra]
        return parse_megatron_args(
            with_defaults(argv, cuda=True), prog="test", world_size=world_size
        )

    return validate


@pytest.mark.parametrize("hidden", sorted(TABLE4))
def test_table4_model_configs(hidden, megatron_validate):
    layers, heads, tp, dp, gbs = TABLE4[hidden]
    cfg = configs.load_model_config(f"h{hidden}-l{layers}")
    assert (cfg["model"]["hidden-size"], cfg["model"]["num-layers"]) == (hidden, layers)
    assert cfg["model"]["num-attention-heads"] == heads and cfg["model"]["seq-length"] == 1024
    assert cfg["parallel"]["tensor-model-parallel-size"] == tp
    assert cfg["training"]["global-batch-size"] == gbs and cfg["paper"]["gpus"] == tp * dp == 32
    args = megatron_validate(cfg, world_size=32)  # Megatron-LM accepts every flag, on 32 ranks
    assert args.data_parallel_size == dp and args.global_batch_size == gbs


@pytest.mark.parametrize("name", sorted(TABLE5))
def test_table5_model_configs(name, megatron_validate):
    hidden, layers, heads, pp, tp, dp, mbs, billions = TABLE5[name]
    cfg = configs.load_model_config(name)
    m = cfg["model"]
    assert (m["hidden-size"], m["num-layers"], m["num-attention-heads"]) == (hidden, layers, heads)
    assert cfg["parallel"] == {"tensor-model-parallel-size": tp, "pipeline-model-parallel-size": pp}
    assert cfg["training"]["micro-batch-size"] == mbs
    assert configs.parameter_count(cfg) / 1e9 == pytest.approx(billions, abs=0.1)
    assert megatron_validate(cfg, world_size=pp * tp * dp).data_parallel_size == dp


def test_tiny_cpu_config_and_flag_rendering(megatron_validate):
    cfg = configs.load_model_config("tiny-cpu")
    assert megatron_validate(cfg, world_size=2).tensor_model_parallel_size == 2
    assert configs.to_flags({"a_b": 1, "swiglu": True, "bias": False, "x": None, "l": [1, 2]}) == [
        "--a-b",
        "1",
        "--swiglu",
        "--l",
        "1",
        "2",
    ]
    with pytest.raises(OasesConfigError, match="unknown model config 'nope'"):
        configs.load_model_config("nope")


def test_every_compare_matrix_run_is_a_valid_megatron_lm_command_line(megatron_validate):
    path = resources.compare_matrix()
    import yaml

    with open(path) as f:
        names = list(yaml.safe_load(f)["matrices"])
    assert {"ci", "cpu-demo", "paper-h4096-l16", "paper-gpt-18.4b"} <= set(names)
    for name in names:
        matrix = configs.load_matrix(path, name)
        runs = configs.expand_matrix(matrix)
        assert len(runs) == len(matrix["layouts"]) * len(matrix["variants"])
        assert any(r["variant"] == matrix["baseline"] for r in runs)
        cfg = configs.load_model_config(matrix["model"])
        world = (cfg.get("paper") or {}).get("gpus") or matrix["gpus-per-node"]
        for run in runs:
            extra = [
                "--tensor-model-parallel-size",
                str(run["tp"]),
                "--pipeline-model-parallel-size",
                str(run["pp"]),
                "--oases-schedule",
                run["schedule"],
                *run["args"],
            ]
            megatron_validate(cfg, world_size=world, extra=extra)
    assert configs.load_matrix(path)["name"] == "cpu-demo"
    assert configs.load_matrix()["name"] == "cpu-demo"  # the packaged file by default


def test_summary_table(tmp_path):
    def golden(losses, times):
        p = tmp_path / f"g{len(os.listdir(tmp_path))}.json"
        series = lambda vals: {  # noqa: E731
            "start_step": 1,
            "end_step": len(vals),
            "step_interval": 1,
            "values": vals,
        }
        p.write_text(json.dumps({"lm loss": series(losses), "iteration-time": series(times)}))
        return str(p)

    runs = tmp_path / "runs.tsv"
    rows = [
        ("megatron-tp2-pp1", 2, 1, "off", "ok", golden([6.0, 5.0, 4.0], [None, 0.2, 0.2])),
        ("oases-tp2-pp1", 2, 1, "oases", "ok", golden([6.0, 5.0, 4.5], [0.9, 0.1, 0.1])),
        ("oases-tp1-pp2", 1, 2, "oases", "failed(1)", str(tmp_path / "missing.json")),
    ]
    runs.write_text("".join("\t".join(map(str, r)) + "\n" for r in rows))
    table = configs.summary_table(configs.read_runs_file(str(runs)), baseline="megatron")
    lines = table.splitlines()
    assert lines[0].startswith("| run | schedule | TP | PP | status |") and len(lines) == 5
    assert [c.strip() for c in lines[2].split("|")[1:-1]] == [
        "megatron-tp2-pp1",
        "off",
        "2",
        "1",
        "ok",
        "3",
        "4.000000",
        "200.0",
        "-",
        "1.00",
    ]
    assert "| 100.0 | - | 2.00 |" in lines[3]
    assert "| failed(1) | 0 | - | - | - | - |" in lines[4]


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


LAUNCHER = os.path.join(REPO, "launch_scripts", "slurm_pretrain_gpt_oases.sh")


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


def test_launch_scripts_are_valid_bash():
    for name in ("slurm_pretrain_gpt_oases.sh", "compare_vs_megatron.sh", "run_cpu_demo.sh"):
        path = os.path.join(REPO, "launch_scripts", name)
        assert os.access(path, os.X_OK), f"{name} is not executable"
        assert subprocess.run(["bash", "-n", path], capture_output=True).returncode == 0
    with open(LAUNCHER) as f:
        text = f.read()
    for needle in (
        "#SBATCH",
        "scontrol show hostnames",
        "GPUS_PER_NODE",
        "NUM_NODES",
        "CUDA_DEVICE_MAX_CONNECTIONS",
        "--kill-on-bad-exit",
        "DISTRIBUTED_ARGS=(",
        "GPT_MODEL_ARGS",
        "MODEL_PARALLEL_ARGS=(",
        "TRAINING_ARGS=(",
        "OASES_ARGS=(",
        megatron_lm.MEGATRON_LM_TAG.rsplit(".", 1)[0],
    ):
        assert needle in text, needle
