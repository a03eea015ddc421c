"""``oases-pretrain-gpt`` and ``oases train``: Megatron-LM's ``pretrain_gpt.py`` with the Oases flags.

Order of events, as in Megatron-LM: defaults for the flags a CPU run needs (:func:`with_defaults`)
→ CPU/gloo platform shims when there is no CUDA → Megatron's parse + validate (+ ours) → Megatron's
``pretrain()`` (distributed init, model via :func:`.gpt.model_provider`, which installs the patches
before building the first model; Megatron's optimizer, 1F1B schedule, logging, checkpointing) → the
patches are reverted.

Launch like ``pretrain_gpt.py``: ``torchrun --nproc_per_node N $(which oases-pretrain-gpt) ...``
or ``torchrun ... -m megatron_oases train ...``.
"""

import contextlib
import gc
import sys
import time

from ..errors import TrainingStopped

_PROGRAM_START = time.time()

PROG = "oases-pretrain-gpt"


def pretrain_gpt(args, config):
    """Megatron-LM's ``pretrain()`` with our ``pretrain_gpt`` pieces, on parsed ``args`` (Megatron's
    globals set) and ``config`` (the checked :class:`~megatron_oases.config.OasesConfig`); a
    ``--load`` of another model is refused before anything starts."""
    from megatron.core.enums import ModelType
    from megatron.training import pretrain
    from megatron.training.argument_utils import pretrain_cfg_container_from_args

    from ..compat import pretrain_kwargs
    from . import gpt
    from .preflight import check_before_training

    check_before_training(args, config)
    pretrain(
        **pretrain_kwargs(
            pretrain_cfg_container_from_args(args),
            gpt.train_valid_test_datasets_provider,
            ModelType.encoder_or_decoder,
            gpt.forward_step,
            gpt.bind_model_provider(args, config),
        )
    )


@contextlib.contextmanager
def collector_paused():
    """Python's cyclic garbage collector paused while torch and Megatron import (about a million
    objects that live as long as the process: the full collections the imports trigger walked
    them again and again, ~15 % of a small job's CPU), then what was imported frozen out of later
    collections (``gc.freeze``; it also keeps forked data-loader workers from copying it)."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        gc.freeze()
        if enabled:
            gc.enable()


def run(argv, demo=False, prog=PROG):
    """Parse ``argv`` (program name excluded) and train; returns the exit status."""
    from .. import patches, platform
    from ..arguments import parse_args_and_config, with_defaults
    from ..compat import check_megatron_core

    with collector_paused():
        check_megatron_core()  # imports Megatron-Core; an unsupported one is one line
        import megatron.training.training  # noqa: F401  the training loop's imports, at once
    from ..launch import die_with_launcher

    die_with_launcher()  # a launcher killed with SIGKILL leaves no orphan ranks
    argv = with_defaults(argv, demo=demo)
    platform.install_cpu_shims()  # a no-op with CUDA
    try:
        args, config = parse_args_and_config(argv, prog=prog, set_globals=True)
        from megatron.training.training import set_startup_timestamps

        set_startup_timestamps(program_start=_PROGRAM_START, main_entry=time.time())
        try:
            pretrain_gpt(args, config)
        except RuntimeError as exc:  # Megatron's NaN/Inf checks: one line, not a traceback
            if "found NaN" in str(exc) or "found Inf" in str(exc):
                raise TrainingStopped(
                    f"training stopped: {str(exc).strip().splitlines()[-1]}; lower --lr or "
                    "check the data, then resume from the last checkpoint (--load)"
                ) from exc
            raise
    finally:
        patches.uninstall_all()
    return 0


def run_in_process(argv, demo=True, extra_patches=()):
    """One Megatron job in a process whose default process group is already up (spawned test or
    measurement ranks): parse ``argv``, train, then tear down Megatron's globals and every patch so
    that the next job in the same process starts fresh. ``extra_patches`` (:class:`Patch` objects,
    e.g. a meter around ``train_step``) are installed for the run only.
    Returns ``{'exit_code': code of an --exit-interval exit or None, 'installed': the names of the
    patches the job's flags installed (the CPU shims and the console fix aside)}``."""
    import shlex

    import torch.distributed as dist
    from megatron.training.training import destroy_global_state

    from .. import patches, platform
    from ..arguments import parse_args_and_config, with_defaults
    from . import console_log, dataset_helpers

    argv = shlex.split(argv) if isinstance(argv, str) else list(argv)
    if "--num-workers" not in argv:  # no data-loader processes inside spawned ranks
        argv += ["--num-workers", "0"]
    platform.install_cpu_shims()
    args, config = parse_args_and_config(
        with_defaults(argv, demo=demo),
        prog="oases",
        world_size=dist.get_world_size(),
        set_globals=True,
    )
    out = {"exit_code": None, "installed": []}
    for patch in extra_patches:
        patch.install()
    try:
        try:
            pretrain_gpt(args, config)
        except SystemExit as exc:  # --exit-interval & co. end the job with sys.exit
            out["exit_code"] = exc.code
            if exc.code not in (0, None):
                raise
        always = (
            platform.cpu.PATCH_NAME,
            console_log.PATCH_NAME,
            dataset_helpers.PATCH_NAME,
        )  # every job's, any flags
        out["installed"] = [n for n in patches.installed() if n not in always]
    finally:
        destroy_global_state()
        patches.uninstall_all()  # the CPU shims last
        # after the job's patches, which were installed after them: a job's patch wrapping the
        # same symbol (``--log-json``'s train_step) would otherwise put an extra one back
        for patch in reversed(extra_patches):
            patch.uninstall()
    return out


def main(argv=None):
    """``oases run`` / ``oases-pretrain-gpt``: exactly the given flags (plus CPU necessities)."""
    return run(list(sys.argv[1:] if argv is None else argv))


def train_main(argv=None):
    """``oases train``: the same, with a tiny demo model and mock data where flags are absent."""
    return run(list(sys.argv[1:] if argv is None else argv), demo=True, prog="oases train")


def console_main(argv=None):
    """Entry of the ``oases-pretrain-gpt`` console script: a user error is one line once per job
    (exit 2), a stopped run one line (exit 1), Ctrl-C or SIGTERM one line (exit 130, 143; SIGTERM
    as torchrun's ranks keep it: :mod:`megatron_oases.interrupts`); Megatron's CPU fallback
    warnings are filtered."""
    from .. import interrupts
    from ..errors import exit_status
    from . import quiet

    quiet.install()  # before Megatron is imported
    with interrupts.handled():
        try:
            return main(argv) or 0
        except KeyboardInterrupt as exc:
            return interrupts.exit_status(exc, PROG)
        except Exception as exc:  # ours: one line once per job; anything else: raised again
            return exit_status(exc, PROG, stopped=(TrainingStopped,))


HYBRID_PROG = "oases-pretrain-hybrid"


def hybrid_console_main(argv=None):
    """Entry of ``oases-pretrain-hybrid`` (Megatron-LM's ``pretrain_hybrid.py``): the same loop on
    a ``HybridModel``, which ``--hybrid-layer-pattern`` describes."""
    from .. import interrupts
    from ..errors import OasesConfigError, exit_status
    from . import quiet

    argv = list(sys.argv[1:] if argv is None else argv)
    quiet.install()
    with interrupts.handled():
        try:
            if not any(a.split("=")[0] in ("--hybrid-layer-pattern", "--hybrid-override-pattern")
                       for a in argv):  # fmt: skip
                raise OasesConfigError(
                    f"{HYBRID_PROG} builds a HybridModel: add --hybrid-layer-pattern (e.g. '*-*-' "
                    "for a GPT-like stack of attention and MLP layers)"
                )
            return run(argv, prog=HYBRID_PROG) or 0
        except KeyboardInterrupt as exc:  # Ctrl-C or SIGTERM: one line, exit 130 or 143
            return interrupts.exit_status(exc, HYBRID_PROG)
        except Exception as exc:  # ours: one line once per job; anything else: raised again
            return exit_status(exc, HYBRID_PROG, stopped=(TrainingStopped,))


if __name__ == "__main__":
    sys.exit(console_main())
