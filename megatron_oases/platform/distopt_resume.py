"""``distopt-resume``: ``--use-distributed-optimizer`` resumes without Apex/TE, in fp32, at the
right Adam step.

Three places where Megatron's ``DistributedOptimizer`` goes wrong on a ``--load`` without Apex/TE
(every CPU machine, and GPU installs without either: it then wraps ``torch.optim.Adam``). The
first two stop the load (stock Megatron alike, a bare error on every rank after the model is
built); the third trains on from a wrong Adam step, in silence. Each replacement calls
Megatron's own method and changes neither the checkpoint format nor Adam's update: with the
three, a resumed run trains bit for bit as the uninterrupted one. Each is installed only where
the method still has the gap.

* ``state_dict()`` reads the iteration from the per-parameter ``step`` of the torch optimizer's
  state (``assert len(steps) == 1``). A torch optimizer has no state before its first step, and a
  load builds the state dict to load into (``sharded_state_dict`` with ``is_loading``) right
  after the model is built: ``AssertionError``. Here, only while the wrapped optimizer has no
  state yet, the original reads the step a fresh ``torch.optim.Adam`` is at, 0
  (``self.optimizer.state_dict()`` answers with it for that one call; the ``state`` entry it adds
  is not part of the result). The loaded checkpoint then sets the real step and every state
  tensor, as with Apex.
* ``load_parameter_state_from_dp_reshardable`` (the sharding Megatron-LM saves by default) copies
  the loaded values into the main parameters without ``torch.no_grad()`` (its sibling
  ``load_parameter_state_from_fs_model_space`` has it). In fp32 a main parameter is a view of the
  model's parameter, a leaf that requires grad: "a view of a leaf Variable that requires grad is
  being used in an in-place operation". Here it runs under ``torch.no_grad()``: the same copies.
* ``load_state_dict`` makes one ``step`` tensor, at the step the checkpoint's param groups
  hold, and puts that same object into every parameter's state (``s["step"] = step``);
  ``torch.optim.Adam.load_state_dict`` keeps it (no copy for a float32 CPU step), so
  ``Adam.step()`` adds 1 to it in place once per parameter. Before that step, the load of the
  parameter state that follows in the same method (``dp_reshardable``, Megatron-LM's default:
  ``_set_main_param_and_optimizer_states`` copies every state key) copies into it the ``step``
  tensor that the state dict to load into captured as it was built (a non-persistent entry: the
  step of the optimizer as built, 0). A resumed run restarted Adam's bias correction at 0 and
  advanced it by the number of parameters per iteration (its checkpoint at iteration 4 stored
  ``step`` 36; the uninterrupted run's, 4): its losses parted from the uninterrupted run's from
  the second iteration after the load, in silence. Here, after Megatron's method, every
  parameter state gets its own ``step`` tensor at the checkpoint's step (the value Megatron's
  branch reads from the param groups); nothing else is touched.
"""

from ..compat import require_call, require_symbol
from ..patching import Patch

PATCH_NAME = "distopt-resume"


def make_state_dict(original):
    def state_dict(self):
        inner = self.optimizer
        if len(getattr(inner, "state", None) or {}) or "state_dict" in vars(inner):
            return original(self)
        import torch

        real = inner.state_dict

        def at_step_zero():
            out = real()
            out["state"] = {0: {"step": torch.tensor(0.0)}}  # a fresh torch Adam's step
            return out

        inner.state_dict = at_step_zero
        try:
            return original(self)
        finally:
            del inner.state_dict

    state_dict.__wrapped__ = original
    return state_dict


def make_no_grad(original):
    import torch

    def load(self, *args, **kwargs):
        with torch.no_grad():
            return original(self, *args, **kwargs)

    load.__wrapped__ = original
    return load


def make_own_steps(original):
    """Megatron's ``load_state_dict``, then every parameter state gets its own ``step`` tensor at
    the step the checkpoint's param groups hold (the third gap above): Megatron's one shared
    tensor, reset by its parameter-state load, is left to no one."""
    import torch

    def load_state_dict(self, state_dict, *args, **kwargs):
        out = original(self, state_dict, *args, **kwargs)
        groups = (state_dict.get("optimizer") or {}).get("param_groups") or ()
        steps = {g["step"] for g in groups if g.get("step") is not None}
        if len(steps) != 1:  # not a checkpoint of this branch (Megatron-FSDP's state dict)
            return out
        (step,) = steps
        for state in self.optimizer.state.values():
            old = state.get("step")
            if isinstance(old, torch.Tensor):  # its own tensor, at the checkpoint's step
                state["step"] = old.detach().clone().fill_(float(step))
        return out

    load_state_dict.__wrapped__ = original
    return load_state_dict


#: The statement of ``DistributedOptimizer.load_state_dict`` (its branch without Apex/TE) that puts
#: one ``step`` tensor into every parameter's state: what :func:`make_own_steps` corrects.
SHARED_STEP = 's["step"] = step'


def replacements():
    """``[(DistributedOptimizer, name, replacement)]`` for the gaps this Megatron still has."""
    from megatron.core.optimizer import distrib_optimizer

    cls = require_symbol(distrib_optimizer, "DistributedOptimizer")
    out = []
    state_dict = require_symbol(cls, "state_dict")
    if not require_symbol(distrib_optimizer, "HAVE_APEX_OR_TE") and (
        "HAVE_APEX_OR_TE" in state_dict.__code__.co_names
    ):
        out.append((cls, "state_dict", make_state_dict(state_dict)))
    load_state_dict = require_symbol(cls, "load_state_dict")
    if not require_symbol(distrib_optimizer, "HAVE_APEX_OR_TE") and (
        "HAVE_APEX_OR_TE" in load_state_dict.__code__.co_names
    ):
        require_call(load_state_dict, SHARED_STEP)  # the code the replacement corrects
        out.append((cls, "load_state_dict", make_own_steps(load_state_dict)))
    load = require_symbol(
        cls, "load_parameter_state_from_dp_reshardable", called_by=(load_state_dict,)
    )
    if not hasattr(load, "__wrapped__"):  # not under torch.no_grad() (a decorator wraps)
        out.append((cls, "load_parameter_state_from_dp_reshardable", make_no_grad(load)))
    return out


def make_patch(config):
    """The patch for ``--use-distributed-optimizer``, else None (or where nothing is left)."""
    if not config.distributed_optimizer:
        return None
    found = replacements()
    return Patch(PATCH_NAME, replacements=found) if found else None
