"""The package data: cluster profiles, model configs and the comparison matrix
(``megatron_oases/configs/``), found through :mod:`importlib.resources` so that an installed wheel
finds them as well as a checkout does. The one place that knows where they live; callers still take
a user's own YAML path first.
"""

import atexit
import contextlib
import pathlib
from importlib import resources

_extracted = contextlib.ExitStack()  # files a zipped install had to copy out; removed at exit
atexit.register(_extracted.close)


def data_path(*parts):
    """Filesystem path of ``configs/<parts...>`` inside the package (it need not exist)."""
    ref = resources.files("megatron_oases").joinpath("configs", *parts)
    if isinstance(ref, pathlib.Path):  # any unpacked install (wheel, editable, checkout)
        return str(ref)
    return str(_extracted.enter_context(resources.as_file(ref)))


def _available(kind):
    ref = resources.files("megatron_oases").joinpath("configs", kind)
    if not ref.is_dir():
        return []
    return sorted(f.name[:-5] for f in ref.iterdir() if f.name.endswith(".yaml"))


def _named(kind, name):
    if name not in _available(kind):
        return None
    return data_path(kind, f"{name}.yaml")


def available_clusters():
    """Names of the packaged cluster profiles (``rtx3090-pcie``, ...)."""
    return _available("clusters")


def available_models():
    """Names of the packaged model configs (``tiny-cpu``, ``gpt-18.4b``, ...)."""
    return _available("models")


def cluster_profile(name):
    """Path of the packaged cluster profile ``name``, or None when there is none."""
    return _named("clusters", name)


def model_config(name):
    """Path of the packaged model config ``name``, or None when there is none."""
    return _named("models", name)


def compare_matrix():
    """Path of the packaged comparison matrix (stock Megatron vs Oases, for ``launch_scripts/``)."""
    return data_path("compare_matrix.yaml")
