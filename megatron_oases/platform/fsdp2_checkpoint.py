"""``fsdp2-checkpoint``: ``--save``/``--load`` under ``--use-torch-fsdp2`` (``torch_dist``,
``torch_dcp``), bit for bit.

Three places where megatron-core 0.19.2 stops or corrupts a torch FSDP2 checkpoint, stock Megatron
alike (one per replacement below). Each replacement keeps Megatron's own code around it, changes
nothing of what is saved nor of Adam's update, and is installed only where the gap is still there
(each checked at install time against the code that Megatron calls).

* ``torch_dist`` save (and the load's request): the optimizer state is matched to the model's
  sharded tensors by ``id()`` (``dist_checkpointing/optimizer.py``,
  ``get_optim_param_to_id_map``). The model side holds the parameter's ``_local_tensor``
  (``make_sharded_tensor_for_checkpoint``), the optimizer side ``to_local_if_dtensor(param)``,
  i.e. ``DTensor.to_local()``, which for a ``Parameter`` DTensor returns a fresh ``view_as`` on
  every call since torch 2.14 (pytorch#184422; it keeps ``isinstance(.., Parameter)``), so no id
  matches: "Sharded parameters mapping is empty", then ``ValueError: Param id 0 does not match any
  model sharded param``. Here that module's ``to_local_if_dtensor`` returns a DTensor's
  ``_local_tensor``, what ``to_local()`` returned there before that change.
* ``torch_dist`` load: under FSDP2 Megatron loads in place (``skip_load_to_model_and_opt``), so
  ``optimizer.load_state_dict`` never runs, and the optimizer's ``common_step``, saved beside the
  state tensors, never goes back into each parameter's state (torch Adam: ``KeyError: 'step'`` at
  the first step after the load). Here ``load_checkpoint`` keeps what ``dist_checkpointing.load``
  returned for the optimizer and restores that step as ``FP32Optimizer.load_state_dict`` would.
* ``torch_dcp`` load: ``load_checkpoint`` calls ``optimizer.state_dict(is_loading=True)``, which
  ``ChainedOptimizer`` and ``FP32Optimizer`` do not take (``TypeError``). Taking and ignoring it
  is not enough: DCP loads only the keys the target dict holds, and a torch Adam before its first
  step holds none, so the run would resume with an empty optimizer state (its first iteration
  equal, the second not). Here ``FP32Optimizer`` with it first creates the state a checkpoint
  loads into (Megatron's ``init_state_fn``, as its ``sharded_state_dict(is_loading=True)`` does,
  plus the per-parameter ``step`` torch Adam keeps, which ``init_state_fn`` leaves to the first
  step), and ``ChainedOptimizer`` passes it on. ``Float16OptimizerWithFloat16Params``
  (``--bf16``) takes it, but its request too holds no Adam ``step`` (``KeyError: 'step'`` at the
  first step after the load): here it holds one.
"""

import copy
import inspect

from ..compat import require_call, require_symbol
from ..errors import OasesConfigError
from ..patching import Patch

PATCH_NAME = "fsdp2-checkpoint"

#: What Megatron's ``to_local_if_dtensor`` calls (a fresh view per call on torch >= 2.14).
TO_LOCAL = ".to_local()"
#: The torch_dcp load's call that Megatron's optimizers do not take.
DCP_REQUEST = "optimizer.state_dict(is_loading=True)"
#: What ``Float16OptimizerWithFloat16Params.state_dict(is_loading=True)`` runs: the state, no step.
INIT_STATE = "self.init_state_fn(self.optimizer, self.config)"
#: ``load_checkpoint``'s condition that skips ``optimizer.load_state_dict`` under an in-place load.
SKIPPED_LOAD = "not skip_load_to_model_and_opt"


def keep_local_tensor(original):
    """``to_local_if_dtensor`` returning a DTensor's own ``_local_tensor`` (no fresh view)."""
    from torch.distributed.tensor import DTensor

    def to_local_if_dtensor(tensor):
        if isinstance(tensor, DTensor):
            return tensor._local_tensor
        return original(tensor)

    to_local_if_dtensor.__wrapped__ = original
    return to_local_if_dtensor


def _step_like_torch(group, p, value=None):
    """A ``step`` as torch's Adam keeps it (``Adam._init_group``, and ``load_state_dict``'s
    ``_process_value_according_to_param_policy``): float32 on the parameter's device under
    ``capturable``/``fused``, else a CPU scalar of the default scalar dtype; ``value``: a saved
    step (None: 0, a placeholder for one to be loaded)."""
    import torch
    from torch.optim.optimizer import _get_scalar_dtype

    if value is None:
        value = torch.tensor(0.0, dtype=_get_scalar_dtype())
    if group.get("capturable") or group.get("fused"):
        return value.to(dtype=torch.float32, device=p.device)
    return value


def _stepless_adam_states(optimizer):
    """``(group, param, state)`` of a torch Adam/AdamW's parameters whose state has no ``step``
    (made by ``init_state_fn``, not by a step); none for other optimizers."""
    import torch

    if not isinstance(optimizer, (torch.optim.Adam, torch.optim.AdamW)):
        return
    for group in optimizer.param_groups:
        for p in group["params"]:
            state = optimizer.state.get(p)
            if state and "step" not in state:
                yield group, p, state


def _placeholder_steps(optimizer):
    """A ``step`` (0) in every torch Adam state that has none, for DCP to load the saved one into
    (it loads only the keys the target dict holds)."""
    for group, p, state in _stepless_adam_states(optimizer):
        state["step"] = _step_like_torch(group, p)


def fp32_state_dict(original):
    def state_dict(self, is_loading=False):
        if is_loading and self.init_state_fn is not None:
            self.init_state_fn(self.optimizer, self.config)
            _placeholder_steps(self.optimizer)
        return original(self)

    state_dict.__wrapped__ = original
    return state_dict


def float16_state_dict(original):
    """``Float16OptimizerWithFloat16Params.state_dict`` (``--bf16``, ``--fp16``): its
    ``is_loading`` request runs ``init_state_fn``, which leaves torch Adam's ``step`` to the first
    step (``KeyError: 'step'`` after a torch_dcp load); here it holds one."""

    def state_dict(self, is_loading=False):
        if is_loading and self.init_state_fn is not None:
            self.init_state_fn(self.optimizer, self.config)
            _placeholder_steps(self.optimizer)
        return original(self, is_loading=is_loading)

    state_dict.__wrapped__ = original
    state_dict.placeholder_steps = True
    return state_dict


def chained_state_dict(original):
    def state_dict(self, is_loading=False):
        if is_loading:
            for opt in self.chained_optimizers:
                if takes_is_loading(opt.state_dict):
                    opt.state_dict(is_loading=True)  # creates the state to load into
        return original(self)

    state_dict.__wrapped__ = original
    return state_dict


def takes_is_loading(fn):
    """Whether ``fn`` takes ``is_loading``. Not through ``__wrapped__`` (``inspect.signature``'s
    default): a replacement here takes it, the original it wraps does not."""
    return "is_loading" in inspect.signature(fn, follow_wrapped=False).parameters


def restore_steps(optimizer, loaded):
    """What the skipped ``optimizer.load_state_dict`` puts back besides the state tensors (loaded
    in place): each wrapped torch Adam's ``common_step``. ``loaded``: what
    ``dist_checkpointing.load`` returned under ``optimizer`` (a ``ChainedOptimizer`` of several:
    one entry per optimizer, by index)."""
    if not isinstance(loaded, dict):
        return
    chained = getattr(optimizer, "chained_optimizers", None) or [optimizer]
    per_opt = [loaded] if len(chained) == 1 else [loaded.get(i) for i in range(len(chained))]
    for opt, sd in zip(chained, per_opt):
        if isinstance(sd, dict) and "optimizer" in sd:  # Float16Optimizer's nests torch's
            sd = sd["optimizer"]
        step = ((sd or {}).get("state") or {}).get("common_step")
        inner = getattr(opt, "optimizer", None)
        if step is None or inner is None:
            continue
        for group, p, state in _stepless_adam_states(inner):
            state["step"] = _step_like_torch(group, p, copy.deepcopy(step))


def in_place_load_replacements(training, checkpointing):
    """``[(owner, name, replacement)]`` restoring the optimizer's step after an in-place
    ``torch_dist`` load: ``dist_checkpointing.load`` keeps the optimizer's part of what it loaded
    while ``load_checkpoint`` runs with ``skip_load_to_model_and_opt``, which then restores it."""
    import megatron.core.dist_checkpointing as dist_ckpt

    context = {}
    original_load = require_symbol(
        dist_ckpt, "load", called_by=[checkpointing._load_global_dist_base_checkpoint]
    )

    def load(*args, **kwargs):
        loaded = original_load(*args, **kwargs)
        if "optimizer" in context:
            state = loaded[0] if isinstance(loaded, tuple) else loaded
            context["loaded"] = state.get("optimizer") if isinstance(state, dict) else None
        return loaded

    load.__wrapped__ = original_load
    # Megatron-LM's loop calls the name it imported into megatron.training.training.
    original_load_ckpt = require_symbol(
        training,
        "load_checkpoint",
        called_by=[training.setup_model_and_optimizer],
        parameters=("skip_load_to_model_and_opt",),
    )

    def load_checkpoint(model, optimizer, *args, **kwargs):
        if not kwargs.get("skip_load_to_model_and_opt") or optimizer is None:
            return original_load_ckpt(model, optimizer, *args, **kwargs)
        context["optimizer"] = optimizer
        try:
            result = original_load_ckpt(model, optimizer, *args, **kwargs)
            restore_steps(optimizer, context.get("loaded"))
            return result
        finally:
            context.clear()

    load_checkpoint.__wrapped__ = original_load_ckpt
    return [(dist_ckpt, "load", load), (training, "load_checkpoint", load_checkpoint)]


def replacements():
    """``[(owner, name, replacement)]`` for the gaps this Megatron still has; each checked against
    the code Megatron calls (one line, :class:`~megatron_oases.errors.OasesConfigError`, where a
    symbol moved)."""
    from megatron.core.dist_checkpointing import optimizer as dist_optim
    from megatron.core.optimizer import optimizer as optim
    from megatron.training import checkpointing, training

    out = []
    to_local = require_symbol(
        dist_optim, "to_local_if_dtensor", called_by=[dist_optim.get_optim_param_to_id_map]
    )
    if TO_LOCAL in _source(to_local):  # torch_dist save: matched by id() of a fresh view
        out.append((dist_optim, "to_local_if_dtensor", keep_local_tensor(to_local)))
    for cls, make in (
        (optim.FP32Optimizer, fp32_state_dict),
        (optim.ChainedOptimizer, chained_state_dict),
    ):
        original = require_symbol(cls, "state_dict")
        if not takes_is_loading(original):  # torch_dcp load: a request they do not take
            require_call(checkpointing.load_checkpoint, DCP_REQUEST)
            out.append((cls, "state_dict", make(original)))
    # torch_dcp load under --bf16/--fp16: a request without torch Adam's step
    float16 = require_symbol(optim, "Float16OptimizerWithFloat16Params")
    original = require_symbol(float16, "state_dict")
    if takes_is_loading(original) and not getattr(original, "placeholder_steps", False):
        require_call(original, INIT_STATE)
        require_call(checkpointing.load_checkpoint, DCP_REQUEST)
        out.append((float16, "state_dict", float16_state_dict(original)))
    in_place = "skip_load_to_model_and_opt" in _source(training.setup_model_and_optimizer)
    if in_place and SKIPPED_LOAD in _source(checkpointing.load_checkpoint):
        # torch_dist load: in place, without optimizer.load_state_dict (nor its step)
        out.extend(in_place_load_replacements(training, checkpointing))
    return out


def _source(fn):
    """``fn``'s source, unwrapped ("" where Python has none)."""
    try:
        return inspect.getsource(inspect.unwrap(fn))
    except (OSError, TypeError):
        return ""


def gap():
    """Why this Megatron cannot save and resume a ``--use-torch-fsdp2`` run (None: it can): a
    symbol the patch replaces moved or changed (such a run stops at install time with that line;
    ``oases plan`` notes it beside a layout that runs FSDP2)."""
    try:
        replacements()
    except OasesConfigError as exc:
        return f"megatron-core cannot save and resume --use-torch-fsdp2 runs here: {exc}"
    return None


def make_patch(config, built=None):
    """The patch for ``--use-torch-fsdp2`` with ``--save`` or ``--load``, else None (or where this
    Megatron has none of the gaps)."""
    if not getattr(config, "fsdp2_checkpoints", False):
        return None
    found = replacements()
    return Patch(PATCH_NAME, replacements=found) if found else None
