"""The schedule under torch FSDP2 (``--use-torch-fsdp2``): the stage's sharded parameters gathered
around the engine's forward and backward.

Megatron's FSDP2 wrapper calls ``fully_shard`` on each ``TransformerLayer`` and on the embedding;
FSDP2 then gathers a module's parameters in hooks around its ``forward`` and registers their
gradients' reduce-scatter on its outputs. The engine never calls those forwards (it runs a
layer's attention and MLP halves and the embedding's submodules itself, and its own backward
programs), so the hooks do not fire. :class:`ShardedParams` does their work with FSDP2's public
``unshard()`` / ``reshard()`` on every wrapped module the engine runs:

- forward: all of them gathered before the first sub-batch's first op (all-gathers issued
  together, then waited on), resharded after the last one's (unless Megatron built them with
  ``--torch-fsdp2-no-reshard-after-forward``);
- backward: all gathered again before the first backward round, and left gathered: FSDP2's root
  post-backward callback (queued by the root module's own pre-backward hook on the model's output,
  which runs before the engine's backward) runs ``post_backward`` for every parameter group that
  its hooks did not finish, which reduce-scatters the gradients the engine accumulated into the
  gathered parameters and reshards them.

So during the engine's forward and during its backward a stage holds all its layers' gathered
parameters at once (stock FSDP2: one or two layers'; docs/megatron-lm.md, sharded data
parallelism), and the all-gathers are not hidden behind compute. The output layer and the final
norm are the root module's, gathered by its own hooks as stock.
"""

from torch.distributed.fsdp import FSDPModule


class ShardedParams:
    """The FSDP2-wrapped ones among ``modules`` (a stage's layers, the embedding); empty, and
    every call a no-op, without ``--use-torch-fsdp2``."""

    def __init__(self, modules):
        self.modules = [m for m in modules if isinstance(m, FSDPModule)]

    def gather(self):
        """All-gather every module's parameters (issued together, then waited on)."""
        handles = [m.unshard(async_op=True) for m in self.modules]
        for handle in handles:
            handle.wait()

    def reshard_after_forward(self):
        """Free the gathered parameters after forward, as FSDP2's post-forward hook would."""
        for m in self.modules:
            if _reshards_after_forward(m):
                m.reshard()


def _reshards_after_forward(module):
    """FSDP2's ``reshard_after_forward`` of ``module`` (Megatron: True unless
    ``--torch-fsdp2-no-reshard-after-forward``). FSDP2 has a setter but no getter: its parameter
    groups hold it (``_reshard_after_forward``); True where they do not say."""
    groups = getattr(module._get_fsdp_state(), "_fsdp_param_groups", None) or []
    return not groups or any(getattr(g, "_reshard_after_forward", True) for g in groups)
