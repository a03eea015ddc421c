"""Per-layer TMP degrees: invalid plans are refused (one line), a plan is bound to one decoder
instance, and the replicas' gradient views. The plans against uniform TP=T on ranks: ``tests/e2e/test_layer_degrees_e2e.py``.
"""

import pytest
from helpers.plans import write_plan
from helpers.runs import parse
from helpers.variants import LAYER_DEGREES_BASE as BASE

from megatron_oases.errors import OasesConfigError


@pytest.mark.parametrize(
    "degrees,T,flags,match",
    [
        ([1, 2], 2, "", "degrees has 2 entries but the model has 4 layers"),
        ([1, 2, 3, 2], 2, "", "degree 3 is not a power of two"),
        ([1, 2, 4, 2], 2, "", "degree 4 exceeds tensor_model_parallel_size 2"),
        ([1, 2, 1, 2], 4, "", "plan is for a TMP domain of 4"),
        ([1, 1, 1, 1], 2, "--micro-batch-size 3 --global-batch-size 6", "not divisible by 2"),
        (
            [1, 1, 1, 1],
            2,
            "--micro-batch-size 2 --global-batch-size 4 --oases-schedule overlap",
            "cannot be split into two sub-batches",
        ),
    ],
)
def test_invalid_plans_are_rejected(tmp_path, degrees, T, flags, match):
    path = write_plan(str(tmp_path / "p.json"), T, degrees)
    argv = (
        BASE + "--num-layers 4 --tensor-model-parallel-size 2 --micro-batch-size 4 "
        f"--global-batch-size 8 {flags} --oases-plan {path}"
    )
    with pytest.raises(OasesConfigError, match=match):
        parse(argv, world_size=2)


def test_replica_grad_runs_are_in_place_views():
    """The replica gradient sync reduces views of the gradient buffer, never a flattened copy."""
    import torch

    from megatron_oases.layer_degrees.model import _contiguous_runs

    buf = torch.arange(12.0)
    grads = [buf[3:5].view(1, 2), buf[0:3], buf[6:10].view(2, 2), buf[10:12]]
    runs = _contiguous_runs(grads)
    assert [(r.storage_offset(), r.numel()) for r in runs] == [(0, 5), (6, 6)]
    assert all(r.untyped_storage().data_ptr() == buf.untyped_storage().data_ptr() for r in runs)
    runs[1].mul_(2)
    assert buf[6:12].tolist() == [12.0, 14.0, 16.0, 18.0, 20.0, 22.0] and buf[5] == 5
    other = torch.zeros(4)[::2]  # not contiguous: reduced on its own
    assert _contiguous_runs([other])[0] is other


class _Block:
    """A decoder whose class forward stands in for the ``oases-schedule`` patch's."""

    def forward(self, x, *, layer_degrees=None):
        return x, layer_degrees

    forward.takes_layer_degrees = True

    def __call__(self, *args, **kwargs):
        return self.forward(*args, **kwargs)


def test_a_plan_binds_to_one_decoder_instance():
    """The degrees reach the bound decoder's forward as its argument; another instance of the
    same class stays as it was, and the checkpoint's accessor finds them on the bound one only."""
    from megatron_oases.layer_degrees.runtime import (
        LayerDegrees,
        bind_block_forward,
        layer_degrees_of,
    )

    planned, other = _Block(), _Block()
    degrees = LayerDegrees(groups=None, degrees=[1, 1, 2, 2, 1])
    bind_block_forward(planned, degrees)
    assert planned("h") == ("h", degrees)
    assert other("h") == ("h", None)
    assert layer_degrees_of(planned) is degrees
    assert layer_degrees_of(other) is None and layer_degrees_of(None) is None
    assert degrees.spans() == [(1, [0, 1]), (2, [2, 3]), (1, [4])]


def test_binding_needs_the_schedule_patch():
    """A decoder whose class forward is not the patch's (patches not installed): refused."""
    from megatron_oases.layer_degrees.runtime import LayerDegrees, bind_block_forward

    class Stock:
        def forward(self, x):
            return x

    with pytest.raises(RuntimeError, match="oases-schedule patch installed"):
        bind_block_forward(Stock(), LayerDegrees(groups=None, degrees=[1]))
