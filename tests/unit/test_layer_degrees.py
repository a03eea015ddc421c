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


def test_the_plans_degrees_are_recorded_for_the_checkpoint_hook():
    """A run's :class:`AttachedPlans` finds the degrees :func:`attach_plan` gave a decoder
    (recorded when ``prepare_model`` attaches the plan), nothing for another one or in another
    run's table; the spans of equal degree."""
    from megatron_oases.layer_degrees import runtime

    class Decoder:
        pass

    planned, other = Decoder(), Decoder()
    degrees = runtime.LayerDegrees(groups=None, degrees=[1, 1, 2, 2, 1])
    plans, another_run = runtime.AttachedPlans(), runtime.AttachedPlans()
    plans.attach(planned, degrees)
    assert plans.of(planned) is degrees
    assert plans.of(other) is None and plans.of(None) is None
    assert another_run.of(planned) is None
    assert degrees.spans() == [(1, [0, 1]), (2, [2, 3]), (1, [4])]
