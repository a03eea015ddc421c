"""The ``oases-trace`` patch: record compute segments and TMP communication per rank.

Replaced symbols: ``torch.distributed.all_reduce``, ``all_gather_into_tensor`` and
``reduce_scatter_tensor`` and Megatron's tensor-parallel aliases of the latter two
(``dist_all_gather_func``/``dist_reduce_scatter_func``, sequence parallelism) — each records
issue / wait / completion, async ops return a work wrapper —, ``TransformerLayer.forward``
(labels stock Megatron's forward and
recompute communication with the layer, and its backward communication via gradient hooks on the
layer output/input; for stock Megatron it also records each layer's forward, recompute and backward
as one compute segment, block ``layer``, whose blocked communication the analysis subtracts), and
Megatron-LM's ``train_step`` (an iteration starts and ends there). The
schedule engine labels its own ops explicitly. The trace of the last iteration is written when the
patch is uninstalled (end of training).

Pass detection for stock Megatron: outside an autograd graph task a collective belongs to the
forward; inside one, to the recomputation if a ``TransformerLayer.forward`` is running
(``CheckpointFunction.backward`` re-running the layer), else to the backward.
"""

import importlib
import inspect

import torch
import torch.distributed as dist
from megatron.core.transformer.transformer_layer import TransformerLayer

from ..compat import MEGATRON_ALIASES, require_symbol
from ..patching import Patch
from ..testbed.link_model import WrappedWork
from .trace import Tracer, trace_path


class _TracedWork(WrappedWork):
    """Wraps an async work handle so the tracer sees when it is waited on and completes; a
    ``torch.distributed.Work`` (:class:`~megatron_oases.testbed.link_model.WrappedWork`), so
    callers that wait only on a ``Work`` (FSDP2's all-gather copy-out) wait on it."""

    def __init__(self, work, tracer, rec):
        super().__init__(work)
        self._tracer, self._rec, self._done = tracer, rec, False

    def wait(self, *args, **kwargs):
        if self._done:
            return True
        self._tracer.comm_wait(self._rec)
        out = self._work.wait(*args, **kwargs)
        self._tracer.comm_done(self._rec)
        self._done = True
        return out

    def is_completed(self):
        return self._work.is_completed()


#: Traced collectives: name -> (recorded op, the argument whose bytes are the transfer size).
TRACED = {
    "all_reduce": ("all_reduce", "tensor"),
    "all_gather_into_tensor": ("all_gather", "output_tensor"),
    "reduce_scatter_tensor": ("reduce_scatter", "input"),
}
ALIASES = {
    "dist_all_gather_func": "all_gather_into_tensor",
    "dist_reduce_scatter_func": "reduce_scatter_tensor",
}
#: Only the tensor-parallel modules' aliases: DDP's buffers communicate over data parallelism.
TP_MODULES = ("megatron.core.tensor_parallel.mappings", "megatron.core.tensor_parallel.layers")


def _stock_pass(tracer):
    if torch._C._current_graph_task_id() == -1:
        return "forward"
    # Inside backward: a layer's forward running again is Megatron's recomputation.
    return "recompute" if tracer.current["block"] == "layer" else "backward"


class TracePatch(Patch):
    """``oases-trace``: Megatron's collectives, layers and ``train_step`` recorded into ``tracer``
    (the run's, :func:`make_tracer`, which the schedule records into too)."""

    def __init__(self, config, tracer):
        self.path = config.trace
        self.schedule = str(config.schedule)
        self.tracer = tracer
        self._bwd_layer = -1
        orig_layer_forward = TransformerLayer.forward
        patch = self

        def traced(orig, name):
            op, size_arg = TRACED[name]
            signature = inspect.signature(orig)

            def collective(*args, **kwargs):
                tracer = patch.tracer
                if tracer is None:
                    return orig(*args, **kwargs)
                bound = signature.bind(*args, **kwargs)
                bound.apply_defaults()
                a = bound.arguments
                labels = {}
                if tracer.current["sub_batch"] < 0:  # stock code path: infer pass and layer
                    p = _stock_pass(tracer)
                    labels["pass"] = p
                    if p == "backward":
                        labels["layer"] = patch._bwd_layer
                tensor, async_op = a[size_arg], a["async_op"]
                with tracer.context(**labels):
                    rec = tracer.comm_issue(
                        op,
                        tensor.numel() * tensor.element_size(),
                        dist.get_world_size(a["group"]),
                        async_op,
                    )
                work = orig(*args, **kwargs)
                if async_op:
                    return _TracedWork(work, tracer, rec)
                tracer.comm_done(rec)
                return work

            collective.__name__ = getattr(orig, "__name__", name)
            collective.__wrapped__ = orig
            return collective

        collectives = [(dist, name, traced(getattr(dist, name), name)) for name in TRACED]
        for module, attrs in MEGATRON_ALIASES:
            if module in TP_MODULES:
                mod = importlib.import_module(module)
                for attr in attrs:
                    name = ALIASES[attr]
                    collectives.append((mod, attr, traced(getattr(mod, attr), name)))

        def layer_forward(self_layer, *args, **kwargs):
            tracer = patch.tracer
            if tracer is None:
                return orig_layer_forward(self_layer, *args, **kwargs)
            number = self_layer.layer_number - 1
            hidden = kwargs.get("hidden_states", args[0] if args else None)
            if tracer.current["sub_batch"] < 0:  # stock: the layer's forward is one segment
                p = "forward" if torch._C._current_graph_task_id() == -1 else "recompute"
                span = tracer.compute(**{"layer": number, "block": "layer", "pass": p})
            else:
                span = tracer.context(layer=number, block="layer")
            with span:
                out = orig_layer_forward(self_layer, *args, **kwargs)
            if torch.is_grad_enabled():
                patch._hook(out[0] if isinstance(out, tuple) else out, number)
                patch._hook(hidden, -1, ends=number)
            return out

        from megatron.training import training

        orig_train_step = require_symbol(training, "train_step", called_by=[training.train])

        def train_step(*args, **kwargs):
            tracer = patch.tracer
            if tracer is not None:
                tracer.start_iteration((kwargs.get("iteration") or 0) + 1)
            out = orig_train_step(*args, **kwargs)
            if tracer is not None:
                tracer.end_iteration()
            return out

        super().__init__(
            "oases-trace",
            replacements=collectives
            + [
                (TransformerLayer, "forward", layer_forward),
                (training, "train_step", train_step),
            ],
            on_install=self._start,
            on_uninstall=self._finish,
        )

    def _hook(self, tensor, layer, ends=None):
        """On ``tensor``'s gradient: backward communication belongs to ``layer`` from now on.
        For stock Megatron it also brackets the layer's backward as a compute segment: the
        gradient of its output starts it (``layer`` ≥ 0), that of its input (``ends``) ends it."""
        if isinstance(tensor, torch.Tensor) and tensor.requires_grad:

            def set_layer(grad):
                # The input of layer l+1 is the output of layer l, whose hook ran first (hooks run
                # in registration order): the input's hook ends layer l+1 only, and must not undo
                # the layer l just set.
                if ends is None or self._bwd_layer == ends:
                    self._bwd_layer = layer
                tracer = self.tracer
                if tracer is not None and tracer.current["sub_batch"] < 0:
                    if ends is not None:
                        tracer.close_compute(("backward", ends))
                    if layer >= 0:
                        labels = {"pass": "backward", "layer": layer, "block": "layer"}
                        tracer.open_compute(("backward", layer), **labels)

            tensor.register_hook(set_layer)

    def _start(self):
        rank = dist.get_rank() if dist.is_initialized() else 0
        world = dist.get_world_size() if dist.is_initialized() else 1
        self.tracer.rank, self.tracer.world_size = rank, world

    def _finish(self):
        if self.tracer.events:
            self.tracer.dump(trace_path(self.path, self.tracer.rank))
        self.tracer.events = []


def make_tracer(config):
    """The run's :class:`~.trace.Tracer` when ``--oases-trace`` is given, else None."""
    return Tracer(schedule=str(config.schedule)) if config.trace else None


def make_patch(config, tracer):
    """The ``oases-trace`` patch recording into ``tracer`` (:func:`make_tracer`), else None."""
    if not config.trace:
        return None
    return TracePatch(config, tracer)
