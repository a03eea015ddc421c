"""Megatron-LM integration without running it: the calls ``patches/pretrain_gpt.oases.patch`` adds
to Megatron-LM's ``pretrain_gpt.py`` (checked as a diff: the script is not in the megatron-core
wheel and CI has no network; ``patches/README.md`` records its manual verification on a real
checkout), the argument provider and model-setup hook on Megatron-LM's own ``parse_args``, the
model configs, comparison matrix and summary table, and the launch scripts' syntax.
Runs under torchrun: ``tests/e2e/test_megatron_lm_integration_e2e.py``.
"""

import json
import os
import re
import subprocess
import sys
import types

import helpers
import pytest
from helpers.paths import LAUNCHER, REPO
from helpers.variants import MEGATRON_LM_MOCK as MOCK
from helpers.variants import MEGATRON_LM_TINY as TINY

from megatron_oases import megatron_lm, patches, resources
from megatron_oases.config import OasesConfig
from megatron_oases.errors import OasesConfigError
from megatron_oases.megatron_lm import configs

PATCH = os.path.join(REPO, "patches", "pretrain_gpt.oases.patch")

RECOMPUTE = helpers.RECOMPUTE.split()


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
    """``install`` installs the hook on ``setup_model_and_optimizer`` and, as
    ``oases-pretrain-gpt`` does before training, the console's loss fix and the dataset-helper build (idempotent);
    ``uninstall`` restores Megatron's functions."""
    from megatron.training import training

    original = training.setup_model_and_optimizer
    cpu = subprocess.run(  # a CUDA-less host needs them spelled out (check_cpu_settings)
        [sys.executable, "-m", "megatron_oases.megatron_lm", "defaults", "--cpu"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    args = megatron_parse(TINY + MOCK + RECOMPUTE + cpu + ["--oases-schedule", "oases"])
    try:
        megatron_lm.install(args)
        megatron_lm.install(args)
        assert patches.installed() == [
            "console-log-interval",
            "dataset-helpers",
            megatron_lm.HOOK_PATCH,
        ]
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
    from megatron_oases.formats.plan import save_plan, uniform_plan

    plan = save_plan(uniform_plan(2, 2, schedule="overlap"), str(tmp_path / "plan.json"))
    args = megatron_parse(
        TINY + MOCK + ["--log-json", str(tmp_path / "g.json"), "--oases-plan", plan]
    )
    seen = []

    def setup_model_and_optimizer(model_type, model_provider_func=None, *rest, **kwargs):
        seen.append(dict(patches=patches.installed(), provider=model_provider_func, **kwargs))
        return "model", "optimizer", "scheduler"

    training = types.SimpleNamespace(
        __name__="training",
        setup_model_and_optimizer=setup_model_and_optimizer,
        pretrain=_fake_pretrain,
    )
    config = OasesConfig.from_args(args)  # the plan read once, here
    hook = megatron_lm.model_setup_hook(args, config, training_module=training)
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
