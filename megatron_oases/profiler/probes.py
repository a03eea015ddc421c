"""What one rank measures: a layer's block times and saved bytes, its runtime peak, a collective.

Per block half (``_forward_attention`` / ``_forward_mlp``) of one Megatron-Core ``TransformerLayer``
(local spec, built by Megatron-LM's ``core_transformer_config_from_args``) and one sub-batch size,
we time, with the TP all-reduces switched off so that only computation is measured:

* forward (autograd recording on), recompute (= the same forward again), backward;

and take the median over ``repeats`` (after a warm-up), and the forward of the core attention alone
(what selective recomputation runs again in backward). Memory: the bytes each half saves for
backward, counted with ``torch.autograd.graph.saved_tensors_hooks`` (unique storages, parameters
excluded), the attention half's again with Megatron's selective recomputation of core attention
switched on (its checkpoint keeps Q, K, V instead of the softmax output and dropout tensors), and
the live-tensor peak of a forward + backward. The layer is built without sequence
parallelism (same GEMMs; SP's collectives are timed on their own). Communication: the median time
of one ``all_reduce``, ``all_gather_into_tensor`` or ``reduce_scatter_tensor`` of a given size (the
full, gathered tensor) on a given group.

These probes run on the calling rank only and know nothing about groups, sizes in play or profile
files: :mod:`.worker` decides what to probe on which group, :mod:`.measured` drives the ranks.
"""

import copy
import statistics
import time


class _NoComm:
    """Context: TP all-reduces become no-ops (compute-only timing)."""

    class _Done:
        def wait(self, *a, **k):
            return True

        def is_completed(self):
            return True

    def __enter__(self):
        import torch.distributed as dist

        self._orig = dist.all_reduce

        def all_reduce(tensor, op=None, group=None, async_op=False):
            return _NoComm._Done() if async_op else None

        dist.all_reduce = all_reduce
        return self

    def __exit__(self, *exc):
        import torch.distributed as dist

        dist.all_reduce = self._orig
        return False


def _median_time(fn, repeats, warmup=1):
    times = []
    for i in range(warmup + repeats):
        t0 = time.perf_counter()
        fn()
        dt = time.perf_counter() - t0
        if i >= warmup:
            times.append(dt)
    return statistics.median(times)


#: Settings of the profiled layer on this host: fp32, unfused kernels (as ``oases train`` on CPU).
CPU_LAYER_SETTINGS = {
    "use_cpu_initialization": True,
    "bias_gelu_fusion": False,
    "bias_swiglu_fusion": False,
    "masked_softmax_fusion": False,
    "bias_dropout_fusion": False,
    "apply_rope_fusion": False,
    "gradient_accumulation_fusion": False,
    "no_persist_layer_norm": True,
}


def build_layer(margs, degree, tp_group, single_group):
    """One TransformerLayer (local spec) at TP ``degree`` on ``tp_group``, configured from the
    model's Megatron args by Megatron-LM's own ``core_transformer_config_from_args``."""
    import torch
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.transformer.spec_utils import build_module
    from megatron.training.argument_utils import core_transformer_config_from_args

    a = copy.copy(margs)
    a.tensor_model_parallel_size = degree
    a.pipeline_model_parallel_size = 1
    a.num_layers = 1
    a.recompute_granularity = a.recompute_method = a.recompute_num_layers = None
    a.sequence_parallel = False  # compute only: SP's collectives are probed by comm_time
    if not torch.cuda.is_available():
        for key, value in CPU_LAYER_SETTINGS.items():
            setattr(a, key, value)
    config = core_transformer_config_from_args(a)
    pgc = ProcessGroupCollection()
    pgc.tp = tp_group
    pgc.pp = single_group
    pgc.cp = single_group
    pgc.tp_cp = tp_group
    spec = get_gpt_layer_local_spec(normalization=margs.normalization)
    torch.manual_seed(1234)
    layer = build_module(spec, config=config, layer_number=1, pg_collection=pgc)
    layer.train()
    return layer


def _saved_bytes(fn, exclude_ptrs):
    import torch

    seen = {}

    def pack(t):
        try:
            st = t.untyped_storage()
            ptr = st.data_ptr()
            if ptr not in exclude_ptrs:
                seen[ptr] = st.nbytes()
        except Exception:  # noqa: BLE001 - e.g. tensors without storage
            pass
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    return out, sum(seen.values())


def profile_block_times(layer, margs, n, repeats):
    """{block: {phase: seconds}} and {block: saved bytes} for one layer at sub-batch ``n``."""
    import torch

    s, h = margs.seq_length, margs.hidden_size
    params = {p.untyped_storage().data_ptr() for p in layer.parameters()}
    x = torch.randn(s, n, h, requires_grad=True)

    def attn():
        out, _ = layer._forward_attention(hidden_states=x, attention_mask=None)
        return out

    y = attn().detach().requires_grad_(True)

    def mlp():
        out = layer._forward_mlp(y)
        return out[0] if isinstance(out, (tuple, list)) else out

    times, saved = {}, {}
    with _NoComm():
        core_s = _core_attention_time(layer, attn, repeats)
        for block, fn in (("attention", attn), ("mlp", mlp)):
            fwd = _median_time(fn, repeats)
            rec = _median_time(fn, repeats)
            grad = torch.randn(s, n, h)

            def bwd_once():
                out = fn()
                t0 = time.perf_counter()
                out.backward(grad)
                return time.perf_counter() - t0

            bwd_once()  # warm-up
            bwd = statistics.median(bwd_once() for _ in range(repeats))
            layer.zero_grad(set_to_none=True)
            _, nbytes = _saved_bytes(fn, params)
            times[block] = {"forward_s": fwd, "recompute_s": rec, "backward_s": bwd}
            saved[block] = nbytes
        times["attention"]["core_attention_forward_s"] = core_s
        saved["attention_selective"] = _selective_saved_bytes(layer, attn, params)
        saved["runtime_peak"] = _runtime_peak(layer, x, grad)
        for block in ("attention", "mlp"):
            saved[f"runtime_peak_{block}"] = _runtime_peak(layer, x, grad, blocks=(block,))
    return times, saved


def _core_attention_time(layer, attn, repeats):
    """Median seconds of the layer's core attention forward (autograd recording on) on the
    query, key and value one attention forward gives it."""
    core = layer.self_attention.core_attention
    calls = []

    def capture(*args, **kwargs):
        calls.append((args, kwargs))
        return type(core).forward(core, *args, **kwargs)

    core.forward = capture
    try:
        attn()
    finally:
        del core.forward
    args, kwargs = calls[0]
    return _median_time(lambda: core(*args, **kwargs), repeats)


def _selective_saved_bytes(layer, attn, params):
    """Bytes the attention half saves for backward under Megatron's selective recomputation of
    core attention (``--recompute-granularity selective --recompute-modules core_attn``): the
    layer's own switch, set for this measurement only."""
    sa = layer.self_attention
    before = sa.checkpoint_core_attention
    sa.checkpoint_core_attention = True
    try:
        return _saved_bytes(attn, params)[1]
    finally:
        sa.checkpoint_core_attention = before


def _runtime_peak(layer, x, grad, blocks=("attention", "mlp")):
    """Peak live bytes of a forward + backward of ``blocks`` of one layer (activations,
    temporaries, each weight gradient until it is accumulated; not parameters or gradient buffers),
    with the schedule package's allocator-independent meter. The whole layer's peak is what a
    layer-granular recomputation holds; a single block's is what ``oases``' block-wise
    recomputation holds."""
    from ..instrument.memory import LiveTensorMeter

    xin = x.detach().requires_grad_(True)

    def drop_grad(p):  # as Megatron's DDP: add into the pre-allocated main_grad, free param.grad
        p.grad = None

    hooks = [p.register_post_accumulate_grad_hook(drop_grad) for p in layer.parameters()]
    meter = LiveTensorMeter()
    try:
        with meter:
            out = xin
            if "attention" in blocks:
                out, _ = layer._forward_attention(hidden_states=out, attention_mask=None)
            if "mlp" in blocks:
                out = layer._forward_mlp(out)
                out = out[0] if isinstance(out, (tuple, list)) else out
            out.backward(grad)
    finally:
        for h in hooks:
            h.remove()
    layer.zero_grad(set_to_none=True)
    return meter.peak_bytes


def comm_time(op, group, nbytes, repeats):
    import torch
    import torch.distributed as dist

    numel = max(1, int(nbytes // 4))
    size = dist.get_world_size(group)
    if op == "all_reduce":
        buf = torch.zeros(numel)

        def run():
            dist.all_reduce(buf, group=group)

    elif op == "all_gather":
        per = max(1, numel // size)
        inp, out = torch.zeros(per), torch.zeros(per * size)

        def run():
            dist.all_gather_into_tensor(out, inp, group=group)

    else:  # reduce_scatter
        per = max(1, numel // size)
        inp, out = torch.zeros(per * size), torch.zeros(per)

        def run():
            dist.reduce_scatter_tensor(out, inp, group=group)

    dist.barrier()
    return _median_time(run, repeats)
