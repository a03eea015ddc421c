"""``distopt-resume``: ``--use-distributed-optimizer`` resumes without Apex/TE and in fp32.

Two places where Megatron's ``DistributedOptimizer`` stops a ``--load`` (stock Megatron alike, a
bare error on every rank after the model is built). Each replacement keeps Megatron's own method
and changes nothing of the optimizer's math; each is installed only where the method still has
the gap.

* Without their fused Adam (every CPU machine, and GPU installs without either) it wraps
  ``torch.optim.Adam``, and ``state_dict()`` reads the iteration from the per-parameter ``step``
  of that optimizer's state (``assert len(steps) == 1``). A torch optimizer has no state before
  its first step, and a load builds the state dict to load into (``sharded_state_dict`` with
  ``is_loading``) right after the model is built: ``AssertionError``. Here, only while the
  wrapped optimizer has no state yet, the original reads the step a fresh ``torch.optim.Adam`` is
  at, 0 (``self.optimizer.state_dict()`` answers with it for that one call; the ``state`` entry
  it adds is not part of the result). The loaded checkpoint then sets the real step and every
  state tensor, as with Apex.
* ``load_parameter_state_from_dp_reshardable`` (the sharding Megatron-LM saves by default) copies
  the loaded values into the main parameters without ``torch.no_grad()`` (its sibling
  ``load_parameter_state_from_fs_model_space`` has it). In fp32 a main parameter is a view of the
  model's parameter, a leaf that requires grad: "a view of a leaf Variable that requires grad is
  being used in an in-place operation". Here it runs under ``torch.no_grad()``: the same copies.
"""

from ..compat import require_symbol
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
    load = require_symbol(
        cls, "load_parameter_state_from_dp_reshardable", called_by=(cls.load_state_dict,)
    )
    if not hasattr(load, "__wrapped__"):  # not under torch.no_grad() (a decorator wraps)
        out.append((cls, "load_parameter_state_from_dp_reshardable", make_no_grad(load)))
    return out


def make_patch(config, built=None):
    """The patch for ``--use-distributed-optimizer``, else None (or where nothing is left)."""
    if not config.distributed_optimizer:
        return None
    found = replacements()
    return Patch(PATCH_NAME, replacements=found) if found else None
