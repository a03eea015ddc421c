"""Unit tests of Patch / PatchRegistry (reversible attribute swaps) and of require_symbol, the
check that makes a patch's missing Megatron target fail loudly instead of patching nothing."""

import types

import pytest

from megatron_oases.compat import require_symbol
from megatron_oases.errors import OasesConfigError
from megatron_oases.patching import Patch, PatchRegistry


def original():
    return "original"


def replacement():
    return "replacement"


@pytest.fixture
def mod():
    m = types.ModuleType("fake_megatron")
    m.fn = original
    m.value = 1
    return m


def test_install_uninstall_idempotent_and_originals_restored(mod):
    p = Patch("p", [(mod, "fn", replacement), (mod, "value", 2)])
    assert not p.installed
    assert p.install() is True
    assert (mod.fn(), mod.value, p.installed) == ("replacement", 2, True)
    assert p.install() is False  # second install: no-op, originals not overwritten
    assert p.uninstall() is True
    assert (mod.fn, mod.value, p.installed) == (original, 1, False)
    assert p.uninstall() is False
    assert (mod.fn, mod.value) == (original, 1)
    assert p.install() is True  # reinstallable after uninstall
    assert mod.value == 2
    p.uninstall()
    assert mod.value == 1


def test_same_attribute_twice_in_one_patch(mod):
    """Replacements revert in reverse, so the first recorded original wins."""
    p = Patch("p", [(mod, "value", 2), (mod, "value", 3)])
    p.install()
    assert mod.value == 3
    p.uninstall()
    assert mod.value == 1


def test_absent_attribute_is_added_then_removed(mod):
    p = Patch("p", [(mod, "new_symbol", 5)])
    p.install()
    assert mod.new_symbol == 5
    p.uninstall()
    assert not hasattr(mod, "new_symbol")


def test_class_attributes_are_restored_as_they_were():
    """Class owners restore their own ``__dict__`` entry: an inherited method is not copied onto
    the subclass, and a staticmethod stays a staticmethod (getattr would unwrap it)."""

    class Base:
        def forward(self):
            return "base"

    class Sub(Base):
        @staticmethod
        def helper():
            return "static"

    p = Patch("p", [(Sub, "forward", lambda self: "patched"), (Sub, "helper", staticmethod(str))])
    p.install()
    assert Sub().forward() == "patched" and Base().forward() == "base"
    p.uninstall()
    assert "forward" not in Sub.__dict__
    assert Sub().forward() == "base"
    assert isinstance(Sub.__dict__["helper"], staticmethod)
    assert Sub.helper() == "static" and Sub().helper() == "static"


def test_hooks_run_once_and_see_the_patched_state(mod):
    log = []
    p = Patch(
        "p",
        [(mod, "value", 2)],
        on_install=lambda: log.append(("install", mod.value)),
        on_uninstall=lambda: log.append(("uninstall", mod.value)),
    )
    p.install()
    p.install()
    p.uninstall()
    p.uninstall()
    assert log == [("install", 2), ("uninstall", 2)]
    assert mod.value == 1


def test_bad_owner_fails_loudly():
    with pytest.raises(AttributeError):
        Patch("p", [(None, "fn", replacement)]).install()


def test_failed_install_leaves_nothing_behind(mod):
    reg = PatchRegistry()
    p = Patch("p", [(mod, "value", 2), (int, "real", 0)])  # builtin type: setattr raises
    with pytest.raises(TypeError):
        reg.install(p)
    reg.uninstall_all()
    assert mod.value == 1


def test_registry_install_get_and_uninstall(mod):
    reg = PatchRegistry()
    p = Patch("p", [(mod, "value", 2)])
    assert reg.install(p) is p
    assert reg.get("p") is p and reg.installed() == ["p"]
    assert reg.get("q") is None
    assert reg.uninstall("p") is p
    assert (mod.value, p.installed, reg.installed()) == (1, False, [])
    assert reg.uninstall("p") is None


def test_registry_same_name_keeps_the_first(mod):
    """A second patch of an installed name is not installed; the first stays in effect."""
    reg = PatchRegistry()
    first = Patch("p", [(mod, "value", 2)])
    second = Patch("p", [(mod, "value", 3)])
    reg.install(first)
    assert reg.install(second) is first
    assert (mod.value, second.installed, reg.installed()) == (2, False, ["p"])
    reg.uninstall_all()
    assert mod.value == 1


def test_uninstall_all_reverts_in_reverse_install_order(mod):
    """Patches stacked on one attribute only come back to the original in reverse order."""
    reg, log = PatchRegistry(), []
    for name, value in (("a", 2), ("b", 3), ("c", 4)):
        reg.install(Patch(name, [(mod, "value", value)], on_uninstall=lambda n=name: log.append(n)))
    assert mod.value == 4
    assert reg.uninstall_all() == ["a", "b", "c"]
    assert log == ["c", "b", "a"]
    assert (mod.value, reg.installed()) == (1, [])
    assert reg.uninstall_all() == []


class TestRequireSymbol:
    """What the patch factories call before building a Patch on a Megatron symbol."""

    def test_present_symbol_is_returned(self, mod):
        assert require_symbol(mod, "fn") is original

    def test_missing_symbol(self, mod):
        with pytest.raises(OasesConfigError, match=r"has no: fake_megatron\.missing"):
            require_symbol(mod, "missing")

    def test_caller_no_longer_calls_it(self, mod):
        def caller():
            return mod.fn()

        assert require_symbol(mod, "fn", called_by=[caller]) is original
        with pytest.raises(OasesConfigError, match="no longer calls it from"):
            require_symbol(mod, "value", called_by=[caller])

    def test_signature_must_have_the_forwarded_parameters(self, mod):
        def target(x, group=None):
            return x

        mod.target = target
        assert require_symbol(mod, "target", parameters=("group",)) is target
        with pytest.raises(OasesConfigError, match="async_op"):
            require_symbol(mod, "target", parameters=("group", "async_op"))
