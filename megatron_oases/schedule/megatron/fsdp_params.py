"""The split schedules under Megatron-FSDP (``--use-megatron-fsdp``): what its hooks do for the
layers the engine runs, done through its explicit calls, one layer at a time (the engine's
:class:`~..engine.fsdp.PerLayer` decides when; ``docs/schedules.md``, Megatron-FSDP).

Megatron-FSDP gathers an FSDP unit's (a ``TransformerLayer``'s, under ``optim_grads_params``)
parameters in hooks around the unit's ``forward``, which the engine never calls (it runs the
layer's blocks itself), and hands each parameter's gradient to its buffer from a per-parameter
post-accumulate-grad hook that *copies* it into the bucket: the engine's two sub-batches
accumulate into each parameter twice, and the first one's gradient would be overwritten, with no
error (``../shared/notes/megatron-fsdp-cpu.md`` §3.3: gradient norm off by 38-71 %). So:

- when a stage is prepared (:func:`mark`, before Megatron wraps it), every parameter the
  programs run (the layers', and the ends' where they join the programs) gets
  ``skip_backward_post_hook`` (its per-parameter hook then does nothing) and its module
  ``need_backward_dw``: Megatron-FSDP then gives each such parameter its delayed weight-gradient
  entry, ``post_wgrad_grad_acc_hook`` (the one Megatron's MoE layer calls after a deferred
  weight-gradient GEMM);
- per layer (:class:`MegatronFsdpLayers`): ``all_gather_and_wait_parameters_ready`` (issued,
  then waited on bucket by bucket), ``post_forward_release_module`` after its forward and
  ``post_backward_release_module`` after its backward (``optim_grads_params`` only: the other
  strategies keep parameters whole); after the layer's last sub-batch's backward each
  parameter's ``post_wgrad_grad_acc_hook()``, once: the summed gradient goes to the bucket, and
  the bucket is reduce-scattered when its last parameter arrives, as stock;
- the ends' parameters (embedding, final norm, output layer) after the engine's backward, once.

Whatever the engine did not hand over (a stock iteration) Megatron-FSDP's root post-backward
callback still hands over, once. A parameter that reaches Megatron-FSDP before its hand-over
(its own hook ran: the gradient would have been copied once per sub-batch) or after it fails
the run with one line. Parameter objects are never kept across calls: Megatron-FSDP swaps them
(raw for compute, DTensor for the optimizer) every iteration.
"""

from ...compat import require_call, require_symbol
from ..engine.fsdp import PerLayer, ShardedLayers

#: The per-parameter flag Megatron-FSDP's post-accumulate-grad hook reads (it then does nothing)
#: and the module method after which it attaches the delayed weight-gradient entry.
SKIP, NEEDS_DW, HOOK = "skip_backward_post_hook", "need_backward_dw", "post_wgrad_grad_acc_hook"


def _needs_dw():
    """``need_backward_dw`` of a marked module (Megatron-FSDP asks it once, when it wraps)."""
    return True


def megatron_fsdp_requested():
    """Whether the run's parsed Megatron arguments ask for Megatron-FSDP (read when a stage is
    prepared, before Megatron wraps it); False where Megatron has no arguments yet."""
    try:
        from megatron.training import get_args

        return bool(getattr(get_args(), "use_megatron_fsdp", False))
    except (AssertionError, ImportError):  # no parsed arguments (a bare model)
        return False


def check_megatron():
    """What the hand-over relies on is what this megatron-core's Megatron-FSDP does."""
    from megatron.core.distributed.fsdp.src.megatron_fsdp import megatron_fsdp as mfsdp

    setup = require_symbol(mfsdp, "setup_delayed_wgrad_acc_hook")
    require_call(setup, f'getattr(module, "{NEEDS_DW}"')
    require_call(setup, f"param.{HOOK} = partial(grad_acc_func, [param])")
    wrapper = require_symbol(mfsdp, "MegatronFSDP")
    hooks = wrapper._register_fsdp_hooks
    require_call(hooks, f"getattr(p, '{SKIP}', False)")
    require_call(hooks, "setup_delayed_wgrad_acc_hook(module, _process_post_backward_gradients)")
    require_call(hooks, "self._params_require_handle_grad.discard(param)")
    require_call(hooks, "self.post_forward_release_module = ")
    require_call(hooks, "self.post_backward_release_module = ")
    require_call(hooks, "self._root_pre_backward_hook_handle = create_custom_backward_hook(")
    require_symbol(
        wrapper, "all_gather_and_wait_parameters_ready", parameters=("wait_bucket_ready",)
    )


def mark(modules):
    """Before Megatron-FSDP wraps the stage: the parameters of ``modules`` (those the programs
    run) skip Megatron-FSDP's per-parameter hook and get its delayed weight-gradient entry."""
    check_megatron()
    for module in modules:
        setattr(module, NEEDS_DW, _needs_dw)
        for p in module.parameters():
            setattr(p, SKIP, True)


def stage_params(layers, embedding=None, output=None):
    """The engine's ``sharded`` argument for a stage's ``layers`` (and its ends, the adapter's
    :mod:`.stage_ends` or None) under Megatron-FSDP: a :class:`~..engine.fsdp.PerLayer` over
    :class:`MegatronFsdpLayers`; None otherwise."""
    first = next((p for layer in layers for p in layer.parameters()), None)
    fsdp = getattr(first, "_megatron_fsdp_model", None)
    if fsdp is None:
        return None
    ends = []
    if embedding is not None:
        ends.append(embedding.module)
    if output is not None:
        if output.final_layernorm is not None:
            ends.append(output.final_layernorm)
        ends.append(output.model.output_layer)
    return PerLayer(MegatronFsdpLayers(fsdp, layers, ends))


def drop_stray_root_hook(fsdp, modules):
    """Remove Megatron-FSDP's second registration of its root pre-backward hook where it landed
    on one of ``modules`` (those the engine runs).

    megatron-core 0.19.2 registers that hook (a forward hook returning each output as
    ``view_as`` of itself, to hang a gradient hook on) on the modules holding all the root's
    parameters, then once more on the loop's leaked variable: the last module ``named_modules()``
    gave. On a pipeline stage without the output layer that is the last layer's MLP output
    linear, whose bias output then becomes a view; made under ``no_grad`` (a forward the engine
    recomputes) a view is a leaf of its own, and the bias's gradient never reaches the parameter
    (silently: measured at PP=2, the first stage's last ``linear_fc2.bias`` gradient zero). The
    hooks on the root modules stay; so does this one elsewhere (stock runs)."""
    handle = getattr(fsdp, "_root_pre_backward_hook_handle", None)
    hooks = handle.hooks_dict_ref() if handle is not None else None
    if hooks is None or handle.id not in hooks:
        return
    for module in modules:
        for sub in module.modules():
            if sub._forward_hooks is hooks:
                handle.remove()
                return


class MegatronFsdpLayers(ShardedLayers):
    """A stage's ``layers`` (and ``ends``: modules whose parameters join the programs) under
    ``fsdp``, Megatron-FSDP's ``MegatronFSDP``, for one micro-batch (module docstring)."""

    def __init__(self, fsdp, layers, ends=()):
        self.fsdp, self.layers, self.ends = fsdp, list(layers), list(ends)
        drop_stray_root_hook(fsdp, self.layers + self.ends)
        self.sharded = fsdp.data_parallel_sharding_strategy == "optim_grads_params"
        self.handed = []  # this backward's hand-overs, checked and dropped by finish()

    def gather(self, i, backward):
        if self.sharded:
            self.fsdp.all_gather_and_wait_parameters_ready(
                list(self.layers[i].parameters()),
                prefetch=False,
                wait_bucket_ready=False,
                bwd=backward,
            )

    def wait(self, i, backward):
        if not self.sharded:
            return
        group_of = self.fsdp.param_and_grad_buffer.param_to_param_group
        pipeline = self.fsdp.all_gather_pipeline
        for bucket in sorted({group_of[p] for p in self.layers[i].parameters()}):
            pipeline.wait_bucket_ready(bucket, backward)

    def release(self, i, backward):
        if not self.sharded:
            return
        if backward:
            self.fsdp.post_backward_release_module(self.layers[i])
        else:
            self.fsdp.post_forward_release_module(self.layers[i])

    def hand_over(self, i):
        self._hand_over(self.layers[i].parameters())

    def finish(self, backward):
        if not backward:
            return
        seen = {id(p) for p in self.handed}
        ends = [p for m in self.ends for p in m.parameters() if id(p) not in seen]
        self._hand_over(dict.fromkeys(ends))  # a tied weight once
        handed, self.handed = self.handed, []
        late = [p for p in handed if p.grad is not None]
        if late:
            raise RuntimeError(
                f"oases: the gradient of {self._name(late[0])} arrived after the schedule handed "
                "it to Megatron-FSDP (it would be lost); run with --oases-schedule off and "
                "report it"
            )

    def _hand_over(self, params):
        """Each parameter's accumulated gradient to Megatron-FSDP, once per backward."""
        pending = self.fsdp._params_require_handle_grad
        for p in params:
            if not p.requires_grad or getattr(p, "_is_shared", False):
                continue  # no gradient; a tied weight's second name: the root callback's
            if p not in pending:  # its own hook ran (once per sub-batch), or a hand-over did
                raise RuntimeError(
                    f"oases: the gradient of {self._name(p)} reached Megatron-FSDP before the "
                    "schedule's one hand-over of its layer (each sub-batch's copy would overwrite "
                    "the last); run with --oases-schedule off and report it"
                )
            hook = getattr(p, HOOK, None)
            if not getattr(p, SKIP, False) or hook is None:
                raise RuntimeError(
                    f"oases: {self._name(p)} was not prepared for the split schedule under "
                    "--use-megatron-fsdp (no delayed weight-gradient entry); run with "
                    "--oases-schedule off and report it"
                )
            hook()
            self.handed.append(p)

    def _name(self, p):
        return self.fsdp.param_to_name.get(p, f"a parameter of shape {tuple(p.shape)}")
