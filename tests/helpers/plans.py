"""Plan files for tests (``--oases-plan``)."""

import json

from megatron_oases.formats.plan import save_plan, uniform_plan


def write_plan(path, T, degrees):
    """A minimal plan: TMP ``T``, one degree per layer."""
    with open(path, "w") as f:
        json.dump({"version": 1, "tensor_model_parallel_size": T, "degrees": degrees}, f)
    return path


def compare_plan(tmp_path, degrees=(1, 2)):
    """``tmp_path/plan.json``: schedule oases, TMP 2, one degree per layer, for
    :data:`helpers.variants.COMPARE_PLANNER_TINY` (global batch 4)."""
    plan = uniform_plan(len(degrees), 2, 2, schedule="oases", global_batch_size=4)
    plan["degrees"] = list(degrees)
    path = tmp_path / "plan.json"
    save_plan(plan, str(path))
    return str(path)
