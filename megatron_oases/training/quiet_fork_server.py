"""Imported first by :func:`megatron_oases.launch.run_distributed`'s fork server: the warning
filters of the entry point that started it (:data:`.quiet.ENV`), before the server imports
Megatron-Core, whose import-time fallback warnings would otherwise print in the middle of, say,
``oases compare``'s host and memory passes. Nothing where no entry point asked for them (a test
calling ``run_distributed`` directly); no CUDA call (the server forks ranks after it)."""

import os

from . import quiet

if os.environ.get(quiet.ENV) in ("cpu", "gpu"):
    quiet.install(cuda=os.environ[quiet.ENV] == "gpu")
