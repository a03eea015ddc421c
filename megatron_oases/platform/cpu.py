"""CPU/gloo platform shims: run unmodified Megatron-Core (0.19) and Megatron-LM's loop on CPU torch.

Megatron-Core assumes CUDA in a handful of places. On a machine without CUDA we install the shims
below (and only then: :func:`install` is a no-op when ``torch.cuda.is_available()``). Each shim is
listed with the Megatron / torch symbol it replaces. They form one :class:`Patch` (``cpu-shims``) in
the process's patch registry, so ``patches.uninstall_all()`` at the end of a job restores every
original with the rest.

==========================================  =====================================================
Replaced symbol                             Why / what the shim does
==========================================  =====================================================
``torch.cuda.current_device``               ``GlobalMemoryBuffer.get_tensor`` (``core/utils.py``),
                                            p2p_communication, DDP buffers and the optimizer pass it
                                            as ``device=``; returns ``torch.device("cpu")``.
``torch.cuda.synchronize``                  p2p_communication, DDP, Megatron-FSDP's streams and
``torch.cuda.Stream`` / ``stream`` /        events, timers: :mod:`.cpu_streams` (the host thread
``current_stream`` / ``default_stream``     is the default stream; inert unless the link emulator
``torch.cuda.Event``                        defers a collective's completion to a side stream;
                                            ``elapsed_time`` 0).
``torch.cuda.empty_cache`` and memory stats no-ops / zeros.
``torch.zeros/ones/empty/full/tensor/...``  ``device="cuda"`` literals in ``schedules.py``
  (the factories in ``_FACTORIES``)         (``total_num_tokens``), ``optimizer.py``
                                            (``FP32Optimizer._scale``), ``clip_grads.py``,
                                            ``param_and_grad_buffer.py``,
                                            ``transformer/utils.get_default_causal_mask``: a wrapper
                                            maps ``device=<cuda>`` to CPU. (Not a TorchFunctionMode:
                                            a mode is popped while it handles
                                            ``torch.autograd.backward``, so recomputation inside
                                            backward would run without it.)
``Tensor.cuda`` / ``Tensor.to``             ``.cuda()`` is the identity; ``.to(<cuda>)`` goes to CPU.
``Tensor.type`` (no arguments)              ``clip_grads.clip_grad_by_total_norm_fp32`` asserts
                                            ``'torch.cuda.FloatTensor'``: CPU tensors report their
                                            CUDA type name.
``tensor_parallel.random._get_cuda_rng_state``  CheckpointFunction saves/restores the "CUDA" RNG:
``tensor_parallel.random._set_cuda_rng_state``  here the CPU default generator, which CPU dropout uses.
``tensor_parallel.random.CudaRNGStatesTracker``  :class:`CpuRNGStatesTracker`: same ``add/fork/
  (instances made by ``initialize_rng_tracker``)  get_states/set_states`` API on CPU generator states,
                                            so model-parallel dropout and recompute stay RNG-exact.
``torch.cuda.device_count`` / ``set_device`` ``initialize_megatron`` builds model-parallel groups and
                                            seeds the TP RNG tracker only when ``device_count() > 0``:
                                            one (virtual) device; ``set_device`` is a no-op.
``megatron.training.arguments.``            ``validate_args`` queries ``cuda:0`` when TP > 1:
  ``get_device_arch_version``               reports 0 (pre-Blackwell rules, i.e. it keeps asking for
                                            ``CUDA_DEVICE_MAX_CONNECTIONS=1``, which we set).
``megatron.training.training.``             ``pretrain`` calls it without ``allow_no_cuda``: the same
  ``initialize_megatron``                   function with ``allow_no_cuda=True``.
``megatron.core.distributed.``              ``--use-torch-fsdp2`` builds its device mesh with
  ``torch_fully_sharded_data_parallel.``    ``DeviceMesh.from_group(group, "cuda")``, and torch's
  ``DeviceMesh``                            ``fully_shard`` then asks ``torch.cuda`` for the
                                            device index: a mesh of the same group on ``cpu``
                                            (FSDP2's own CPU path; sharding and collectives as
                                            on GPUs).
``megatron.core.distributed.``              after Megatron's ``fully_shard`` calls: the all-gathers
  ``TorchFullyShardedDataParallel.``        in the GPU's issue order (:func:`gpu_issue_order`):
  ``__init__``                              each gather async, the next layer's issued before the
                                            current one computes. On CUDA that overlap comes from
                                            the host running ahead; CPU ranks compute on the
                                            issuing thread and would gather each layer only when
                                            it starts. Same values, same memory bound.
``megatron.training.training.``             its JIT warm-up draws ``torch.rand`` tensors shaped by
  ``set_jit_fusion_options``                ``--micro-batch-size`` (and dropout masks) from the
                                            "CUDA" generator, here the CPU one that then initialises
                                            the weights: run with the CPU RNG state restored, so
                                            the initial weights do not depend on the micro-batch.
==========================================  =====================================================
"""

import contextlib
import functools
import importlib
import logging

import torch

from ..patching import REGISTRY, Patch
from .cpu_streams import CpuEvent, CpuStream, current_stream, default_stream, stream, synchronize

logger = logging.getLogger(__name__)


def _is_cuda_device(device):
    if isinstance(device, torch.device):
        return device.type == "cuda"
    if isinstance(device, str):
        return device.startswith("cuda")
    return isinstance(device, int) and not isinstance(device, bool)


_FACTORIES = (
    "empty",
    "zeros",
    "ones",
    "full",
    "tensor",
    "as_tensor",
    "arange",
    "rand",
    "randn",
    "randint",
    "empty_strided",
    "eye",
    "linspace",
    "empty_like",
    "zeros_like",
    "ones_like",
    "full_like",
)


def _cpu_device_factory(fn):
    """Wrap a torch factory so ``device=<cuda>`` means CPU."""

    def factory(*args, **kwargs):
        if "device" in kwargs and _is_cuda_device(kwargs["device"]):
            kwargs["device"] = "cpu"
        return fn(*args, **kwargs)

    factory.__wrapped__ = fn
    factory.__name__ = getattr(fn, "__name__", "factory")
    return factory


def _make_tensor_methods(orig_to, orig_type):
    def cuda(self, *args, **kwargs):
        return self

    def to(self, *args, **kwargs):
        if args and _is_cuda_device(args[0]):
            args = ("cpu",) + tuple(args[1:])
        if "device" in kwargs and _is_cuda_device(kwargs["device"]):
            kwargs["device"] = "cpu"
        return orig_to(self, *args, **kwargs)

    def type_(self, *args, **kwargs):
        name = orig_type(self, *args, **kwargs)
        if not args and not kwargs and self.device.type == "cpu":
            # clip_grads / Float16OptimizerWithFloat16Params assert 'torch.cuda.FloatTensor'.
            return name.replace("torch.", "torch.cuda.", 1)
        return name

    return {"cuda": cuda, "to": to, "type": type_}


def _cpu_get_rng_state(device="cuda", clone=False, graph_safe=False):
    return torch.get_rng_state()


def _cpu_set_rng_state(new_state, device=-1, graph_safe=False):
    torch.set_rng_state(new_state)


def _make_cpu_tracker_class():
    from megatron.core.tensor_parallel import random as mrandom

    class CpuRNGStatesTracker(mrandom.CudaRNGStatesTracker):
        """Megatron's RNG tracker on the CPU default generator.

        ``fork(name)`` swaps the named state into the CPU generator and back out, exactly as the
        CUDA tracker does with the device generator, so dropout in tensor-parallel regions and its
        recomputation draw identical masks. Megatron's CPU-RNG-changed warning does not apply: on
        CPU the forked generator *is* the CPU generator.
        """

        def add(self, name, seed):
            self._is_initialized = True
            if seed in self.seeds_:
                raise Exception('seed {} already exists'.format(seed))
            self.seeds_.add(seed)
            if name in self.states_:
                raise Exception('rng state {} already exists'.format(name))
            orig = torch.get_rng_state()
            torch.manual_seed(seed)
            self.states_[name] = torch.get_rng_state()
            torch.set_rng_state(orig)

        @contextlib.contextmanager
        def fork(self, name=mrandom._MODEL_PARALLEL_RNG_TRACKER_NAME):
            if name not in self.states_:
                raise Exception('rng state {} is not added'.format(name))
            orig_state = torch.get_rng_state()
            orig_name = self._current_state_name
            if orig_name != "default-rng":
                self.states_[orig_name] = orig_state
            torch.set_rng_state(self.states_[name])
            self._current_state_name = name
            try:
                yield
            finally:
                self.states_[name] = torch.get_rng_state()
                if orig_name != "default-rng":
                    orig_state = self.states_[orig_name]
                torch.set_rng_state(orig_state)
                self._current_state_name = orig_name

    return CpuRNGStatesTracker


def _rng_neutral(fn):
    """``fn`` with the CPU generator's state restored afterwards."""

    @functools.wraps(fn)
    def run(*args, **kwargs):
        with torch.random.fork_rng(devices=[]):
            return fn(*args, **kwargs)

    return run


def _training_shims():
    """``{(module, attr): replacement}`` for Megatron-LM's loop (``megatron.training``, 0.17+)."""
    try:
        from megatron.training import arguments, training
    except ImportError:  # megatron-core without megatron.training: nothing to shim
        return {}
    shims = {
        ("megatron.training.arguments", "get_device_arch_version"): lambda *a, **k: 0,
        ("megatron.training.training", "initialize_megatron"): functools.partial(
            training.initialize_megatron, allow_no_cuda=True
        ),
        ("megatron.training.training", "set_jit_fusion_options"): _rng_neutral(
            training.set_jit_fusion_options
        ),
    }
    for (module, name), _ in shims.items():
        if not hasattr(importlib.import_module(module), name):
            raise RuntimeError(
                f"megatron_oases CPU shim: {module}.{name} no longer exists in this Megatron; "
                "this version is not supported on CPU"
            )
    del arguments
    return shims


class _CpuDeviceMesh:
    """Megatron's FSDP2 wrapper builds a ``"cuda"`` mesh of its data-parallel group; the same
    group's mesh on the CPU instead (the one call it makes, ``from_group``)."""

    @staticmethod
    def from_group(group, device_type, *args, **kwargs):
        from torch.distributed import DeviceMesh

        device_type = "cpu" if device_type == "cuda" else device_type
        return DeviceMesh.from_group(group, device_type, *args, **kwargs)


def gpu_issue_order(root, recompute_granularity):
    """FSDP2's all-gathers on CPU ranks in the order a GPU issues them, on ``root`` (Megatron's
    model after its ``fully_shard`` calls).

    On CUDA, FSDP2 hides a layer's all-gather behind the layer before: the host runs ahead of the
    device and reaches layer i+1's pre-forward (which issues its all-gather on FSDP2's all-gather
    stream) while layer i still computes; in backward, layer i's pre-backward prefetches layer
    i-1's all-gather (FSDP2's default backward prefetch). On CPU ranks the compute runs on the
    issuing thread and a gather without ``async_op`` blocks it: each layer's all-gather would be
    issued when the layer starts and waited on at once. So every unshard is made ``async_op``
    (FSDP2's ``_set_unshard_async_op``; its copy-out waits on the ``Work``, gloo progresses on its
    own thread) and each fully_shard-ed layer prefetches the next in forward order
    (``set_modules_to_forward_prefetch``: issued after its own copy-out, before it computes: one
    layer ahead, as the GPU's implicit prefetch). The gathered values and the number of layers
    held gathered are FSDP2's either way.

    Not with ``--recompute-granularity full``: the recomputation in backward runs each layer's
    forward again, whose prefetch would gather the next layer's pre-step shards for the next
    iteration (Megatron sets its own backward prefetch there)."""
    from torch.distributed.fsdp import FSDPModule

    root._set_unshard_async_op(True)
    if recompute_granularity == "full":
        return
    chain = [
        m
        for m in root.modules()
        if m is not root and isinstance(m, FSDPModule) and next(m.parameters(), None) is not None
    ]
    for module, following in zip(chain, chain[1:]):
        module.set_modules_to_forward_prefetch([following])


def _prefetching_init(init):
    """Megatron's FSDP2 wrapper ``__init__``, then :func:`gpu_issue_order` on its model."""

    @functools.wraps(init)
    def __init__(self, *args, **kwargs):
        init(self, *args, **kwargs)
        gpu_issue_order(self.module, self.config.recompute_granularity)

    return __init__


def _fsdp2_shims():
    """``[(owner, attr, replacement)]`` for ``--use-torch-fsdp2`` (torch's ``fully_shard``)."""
    module = "megatron.core.distributed.torch_fully_sharded_data_parallel"
    try:
        fsdp2 = importlib.import_module(module)
    except ImportError:
        return []
    if not getattr(fsdp2, "HAVE_FSDP", False):  # a torch without FSDP2: Megatron refuses it
        return []
    from torch.distributed.fsdp import FSDPModule

    from ..compat import require_call

    wrapper = fsdp2.TorchFullyShardedDataParallel
    require_call(wrapper.__init__, "DeviceMesh.from_group(")
    require_call(wrapper.__init__, "fully_shard(self.module")
    for name in ("_set_unshard_async_op", "set_modules_to_forward_prefetch"):
        if not hasattr(FSDPModule, name):
            raise RuntimeError(
                f"megatron_oases CPU shim: torch's FSDPModule.{name} no longer exists in this "
                "torch; --use-torch-fsdp2 is not supported on CPU with it"
            )
    return [
        (fsdp2, "DeviceMesh", _CpuDeviceMesh),
        (wrapper, "__init__", _prefetching_init(wrapper.__dict__["__init__"])),
    ]


#: The registry name of the CPU shim patch.
PATCH_NAME = "cpu-shims"


def make_patch():
    """The CPU shims as one :class:`Patch` (every replacement listed in the module docstring)."""
    from megatron.core.tensor_parallel import random as mrandom

    cuda = torch.cuda
    replacements = [
        (cuda, "current_device", lambda: torch.device("cpu")),
        (cuda, "synchronize", synchronize),
        (cuda, "Stream", CpuStream),
        (cuda, "Event", CpuEvent),
        (cuda, "stream", stream),
        (cuda, "current_stream", current_stream),
        (cuda, "default_stream", default_stream),
        (cuda, "empty_cache", lambda: None),
        (cuda, "memory_allocated", lambda *a, **k: 0),
        (cuda, "max_memory_allocated", lambda *a, **k: 0),
        (cuda, "reset_peak_memory_stats", lambda *a, **k: None),
        (cuda, "manual_seed", lambda seed: None),
        (cuda, "get_rng_state", lambda *a, **k: torch.get_rng_state()),
        (cuda, "set_rng_state", lambda s, *a, **k: torch.set_rng_state(s)),
        (cuda, "device_count", lambda: 1),
        (cuda, "set_device", lambda *a, **k: None),
        (mrandom, "_get_cuda_rng_state", _cpu_get_rng_state),
        (mrandom, "_set_cuda_rng_state", _cpu_set_rng_state),
        (mrandom, "CudaRNGStatesTracker", _make_cpu_tracker_class()),
    ]
    for (module, name), new in _training_shims().items():
        replacements.append((importlib.import_module(module), name, new))
    replacements += _fsdp2_shims()
    for name in _FACTORIES:
        replacements.append((torch, name, _cpu_device_factory(getattr(torch, name))))
    for name, method in _make_tensor_methods(torch.Tensor.to, torch.Tensor.type).items():
        replacements.append((torch.Tensor, name, method))

    def reset_tracker():  # a tracker made before (or during) the shims has the wrong class
        mrandom.initialize_rng_tracker(force_reset=True)

    return Patch(PATCH_NAME, replacements, on_install=reset_tracker, after_uninstall=reset_tracker)


def is_active():
    return REGISTRY.get(PATCH_NAME) is not None


def install(force=False):
    """Install the shims if CUDA is unavailable (or ``force``); True if installed now."""
    if is_active() or (torch.cuda.is_available() and not force):
        return False
    REGISTRY.install(make_patch())
    logger.info("megatron_oases: CPU platform shims installed (no CUDA)")
    return True


def uninstall():
    """Restore every replaced symbol; True if they were installed."""
    return REGISTRY.uninstall(PATCH_NAME) is not None
