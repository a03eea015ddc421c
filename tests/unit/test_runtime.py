"""Issue 59.2: one runtime object instead of the patch registry as a bus. ``install(config)``
returns a frozen :class:`~megatron_oases.patches.OasesRuntime` holding what the run's stages and
patches share; every patch the package can carry is named in the one catalogue, and only the
catalogue (and the CPU shims, below it, before arguments are parsed) writes to the registry."""

import ast
import dataclasses
import re
from pathlib import Path

import pytest
from helpers.runs import parse
from helpers.variants import VERSIONS_TINY as TINY

from megatron_oases import patches
from megatron_oases.config import OasesConfig
from megatron_oases.validation import Schedule

PKG = Path(__file__).resolve().parents[2] / "megatron_oases"


def _patch_names_made_in_the_package():
    """Every patch name the package's modules give a ``Patch`` (literal first arguments,
    ``PATCH_NAME``/``HOOK_PATCH`` constants, ``Patch`` subclasses' ``super().__init__``)."""
    names = {}
    for path in PKG.rglob("*.py"):
        text = path.read_text()
        for m in re.finditer(r'^(?:PATCH_NAME|HOOK_PATCH) = "([^"]+)"', text, re.M):
            names[m.group(1)] = path
        for node in ast.walk(ast.parse(text)):
            if not isinstance(node, ast.Call) or not node.args:
                continue
            fn = node.func
            called = fn.attr if isinstance(fn, ast.Attribute) else getattr(fn, "id", "")
            first = node.args[0]
            if called in ("Patch", "__init__") and isinstance(first, ast.Constant):
                if isinstance(first.value, str) and re.fullmatch(r"[a-z0-9-]+", first.value):
                    names[first.value] = path
    return names


def test_every_patch_of_the_package_is_in_the_catalogue():
    names = _patch_names_made_in_the_package()
    assert len(names) >= 19, sorted(names)  # the scan still finds them
    missing = {n: str(p.relative_to(PKG)) for n, p in names.items() if n not in patches.CATALOGUE}
    assert not missing, f"add to megatron_oases/patches/__init__.py's catalogue: {missing}"


def test_only_the_catalogue_writes_to_the_registry():
    allowed = {"patches/__init__.py", "platform/cpu.py", "patching.py"}
    writers = sorted(
        str(path.relative_to(PKG))
        for path in PKG.rglob("*.py")
        if re.search(r"REGISTRY\.(install|uninstall)\(", path.read_text())
    )
    assert set(writers) <= allowed, writers


def test_no_attributes_are_stuck_onto_patch_objects():
    stuck = [
        f"{path.relative_to(PKG)}: {line.strip()}"
        for path in PKG.rglob("*.py")
        for line in path.read_text().splitlines()
        if re.match(r"\s*patch\.[a-z_]+ = ", line)
    ]
    assert not stuck, stuck


def test_a_catalogue_patch_outside_it_is_refused():
    with pytest.raises(RuntimeError, match="not in the catalogue"):
        patches.install_patch(patches.Patch("not-catalogued"))


@pytest.mark.parametrize(
    "flags, schedule, ends",
    [
        ("--oases-schedule overlap", Schedule.OVERLAP, True),
        ("--oases-schedule auto --oases-tune-steps 8", Schedule.OFF, True),
        ("", None, False),
    ],
)
def test_a_runtime_is_made_without_installing_anything_and_is_frozen(flags, schedule, ends):
    config = OasesConfig.from_args(parse(TINY + flags, world_size=2))
    before = patches.installed()
    runtime = patches.make_runtime(config)
    assert patches.installed() == before
    with pytest.raises(dataclasses.FrozenInstanceError):
        runtime.selection = None
    if schedule is None:
        assert runtime.selection is None and not runtime.patches
    else:
        assert runtime.selection.schedule == schedule and runtime.stage_ends == ends
        assert runtime.patch("oases-schedule") is not None
    assert (runtime.tuner is not None) == ("auto" in flags)
    order = list(patches.RUN_PATCHES)
    assert [p.name for p in runtime.patches] == sorted(
        (p.name for p in runtime.patches), key=order.index
    )


def test_two_runtimes_share_nothing():
    config = OasesConfig.from_args(parse(TINY + "--oases-schedule auto --oases-tune-steps 8", 2))
    first, second = patches.make_runtime(config), patches.make_runtime(config)
    for field in ("selection", "tuner"):
        assert getattr(first, field) is not getattr(second, field), field
    assert not set(map(id, first.patches)) & set(map(id, second.patches))
    first.selection.select(Schedule.OASES)
    assert second.selection.schedule == Schedule.OFF


def test_installed_patches_wrap_what_the_ones_before_them_put_in_place(tmp_path):
    """The run's patches are made and installed one after another: each replacement of a symbol
    another patch replaced before it wraps that one (the tuner's ``train_step`` wraps
    ``--log-json``'s, which wraps ``--oases-trace``'s), so none is bypassed. Made all first and
    installed after, each captured Megatron's own function and the earlier ones never ran."""
    from megatron.training import training

    flags = f"--oases-schedule auto --oases-tune-steps 8 --log-json {tmp_path / 'g.json'} "
    flags += f"--oases-trace {tmp_path / 'trace.json'}"
    config = OasesConfig.from_args(parse(TINY + flags, world_size=2))
    original = training.train_step
    runtime = patches.install(config)
    try:
        chain = [
            (p.name, orig, new)
            for p in runtime.patches
            for (owner, attr, orig), (_, _, new) in zip(p._originals, p.replacements)
            if owner is training and attr == "train_step"
        ]
        names = [name for name, _, _ in chain]
        assert names == ["oases-trace", "golden-values", "oases-autotune"], names
        assert chain[0][1] is original
        for (_, _, below), (name, wrapped, _) in zip(chain, chain[1:]):
            assert wrapped is below, f"{name} bypasses the patch installed before it"
        assert training.train_step is chain[-1][2]
    finally:
        for patch in reversed(runtime.patches):
            patches.uninstall(patch.name)
    assert training.train_step is original
