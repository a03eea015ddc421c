"""Megatron's dataset-helper build on any device: nothing for the wheel, ``make`` for a checkout."""

import pytest

from megatron_oases.training.dataset_helpers import compile_dataset_helpers


def test_the_wheel_has_no_makefile_and_builds_nothing(tmp_path):
    compile_dataset_helpers(str(tmp_path))  # no Makefile: a no-op, no error


def test_a_checkout_runs_its_makefile(tmp_path):
    (tmp_path / "Makefile").write_text("all:\n\ttouch built\n")
    compile_dataset_helpers(str(tmp_path))
    assert (tmp_path / "built").exists()


def test_a_failed_build_is_one_line_naming_the_fix(tmp_path, capsys):
    (tmp_path / "Makefile").write_text(
        "all:\n\t@echo 'fatal error: pybind11.h: No such file' >&2; false\n"
    )
    with pytest.raises(SystemExit) as exit_:
        compile_dataset_helpers(str(tmp_path))
    assert exit_.value.code == 1
    (line,) = capsys.readouterr().err.splitlines()
    assert "pybind11.h: No such file" in line
    assert f"run `pip install pybind11 && make -C {tmp_path}`" in line


def test_the_patch_replaces_what_initialize_megatron_calls_and_reverts(tmp_path):
    from megatron.core.datasets import utils

    from megatron_oases.training import dataset_helpers

    original = utils.compile_helpers
    patch = dataset_helpers.make_patch()
    patch.install()
    try:
        assert utils.compile_helpers is compile_dataset_helpers
        # a directory without a Makefile (the wheel's): returns instead of exiting
        utils.compile_helpers(str(tmp_path))
    finally:
        patch.uninstall()
    assert utils.compile_helpers is original
