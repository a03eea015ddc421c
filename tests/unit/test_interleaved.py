"""Megatron's interleaved pipeline (virtual stages) without process groups: the chunk's own
``vp_stage`` reaches ``get_batch``, and every schedule and a per-layer plan accept the flags
(the runs themselves: ``tests/e2e/test_interleaved_e2e.py``)."""

import pytest
from helpers import GPT, RECOMPUTE
from helpers.plans import write_plan

from megatron_oases.arguments import parse_args_and_config, with_defaults
from megatron_oases.validation import SCHEDULES


class _Chunk:
    """A model chunk as Megatron builds it (``vp_stage`` set on the model itself)."""

    def __init__(self, vp_stage):
        self.vp_stage = vp_stage

    def __call__(self, *args, **kwargs):
        return "output"


class _Wrapper:
    """DDP / ``Float16Module``: the chunk is ``.module``, no ``vp_stage`` of its own."""

    def __init__(self, module):
        self.module = module

    def __call__(self, *args, **kwargs):
        return self.module(*args, **kwargs)


def test_forward_step_reads_vp_stage_on_the_chunk_inside_its_wrappers(monkeypatch):
    """Issue 54: read on the wrapper it was None, and rank 0's middle chunk read data it has
    none of (a traceback in iteration 1, under ``--oases-schedule off`` too)."""
    from megatron_oases.training import gpt

    seen = []
    monkeypatch.setattr(gpt, "_restore_rng_before_data", lambda: None)
    monkeypatch.setattr(gpt, "get_batch", lambda it, vp_stage: seen.append(vp_stage) or (None,) * 5)
    for vp_stage in (0, 1):
        output, _ = gpt.forward_step(iter(()), _Wrapper(_Wrapper(_Chunk(vp_stage))))
        assert output == "output"
    assert seen == [0, 1]


VP = (
    GPT.format(layers=4) + "--tensor-model-parallel-size 2 --pipeline-model-parallel-size 2 "
    "--micro-batch-size 4 --global-batch-size 16 " + RECOMPUTE
)


@pytest.mark.parametrize(
    "flag",
    ["--num-layers-per-virtual-pipeline-stage 1", "--num-virtual-stages-per-pipeline-rank 2"],
)
def test_every_schedule_and_a_plan_take_virtual_stages(flag, tmp_path):
    """Refused under the split schedules and with a plan before (a rule that ran before Megatron
    derived the virtual stages missed them, then one that read what it derives refused them);
    each chunk is scheduled on its own now."""
    plan = write_plan(str(tmp_path / "plan.json"), 2, [1, 2, 1, 2])
    for extra in [f"--oases-schedule {s}" for s in SCHEDULES] + [f"--oases-plan {plan}"]:
        argv = with_defaults(f"{VP} {flag} {extra}".split(), demo=True)
        args, config = parse_args_and_config(argv, prog="test", world_size=4)
        assert args.virtual_pipeline_model_parallel_size == 2
        assert (config.plan is not None) == extra.startswith("--oases-plan")
