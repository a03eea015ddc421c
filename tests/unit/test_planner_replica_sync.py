"""The cost model pays the per-layer TMP runtime's replica gradient all-reduce (degree < T)."""

from helpers.variants import h2048_profile

from megatron_oases.formats.profile import tp_ranks
from megatron_oases.planner.prediction import predict
from megatron_oases.planner.settings import PlanSettings


def test_replica_sync_is_in_the_iteration_time():
    prof = h2048_profile("rtx3090-pcie")
    T = prof.data["tensor_model_parallel_size"]
    uniform = predict(prof, [T] * 24, PlanSettings(schedule="oases", global_batch_size=128))
    half = predict(prof, [T // 2] * 24, PlanSettings(schedule="oases", global_batch_size=128))
    assert uniform["replica_sync_s"] == 0.0
    per_layer = prof.all_reduce_time(
        tp_ranks(2), prof.mem("params_per_layer", T // 2) * prof.dtype_bytes
    )
    assert per_layer > 0
    assert abs(half["replica_sync_s"] - 24 * per_layer) < 1e-9
    body = half["forward_s"] + half["backward_s"] + half["edges_s"]
    assert abs(half["iteration_time_s"] - (body + half["replica_sync_s"])) < 1e-9
