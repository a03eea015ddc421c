"""``--attention-backend``'s core attention for the local spec (:mod:`megatron_oases.attention`).

Unit parity of :class:`SDPAttention` against Megatron's ``DotProductAttention`` (fp32, GQA 8 heads /
4 groups: causal with and without the dataloader's mask, layer-scaled, padding mask, dropout on
CPU), the backend mapping and refusals, and one 2-rank training run: losses and every gradient of
the SDPA attention against the stock one, with the stock loop and with the Oases schedule, TP=2.
"""

import os

import pytest
import torch
from helpers import LLAMA, NO_DROP, RECOMPUTE
from helpers.runs import max_rel_diff

from megatron_oases import prepare
from megatron_oases.config import OasesConfig
from megatron_oases.errors import OasesConfigError
from megatron_oases.launch import run_distributed

S, B, HEADS, GROUPS, HN = 16, 3, 8, 4, 8


def _pair(mask_type="causal", layer_number=1, dropout=0.0, **config):
    """(stock DotProductAttention, its SDPAttention twin) for one layer."""
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.transformer_config import TransformerConfig

    from megatron_oases.attention import SDPAttention

    cfg = TransformerConfig(
        num_layers=4,
        hidden_size=HEADS * HN,
        num_attention_heads=HEADS,
        num_query_groups=GROUPS,
        attention_dropout=dropout,
        hidden_dropout=0.0,
        **config,
    )
    stock = DotProductAttention(cfg, layer_number, AttnMaskType[mask_type], "self")
    return stock, SDPAttention.from_stock(stock)


def _run(module, qkv, mask, seed=1234):
    from megatron.core import tensor_parallel

    tensor_parallel.model_parallel_cuda_manual_seed(seed)
    q, k, v = (t.detach().clone().requires_grad_() for t in qkv)
    out = module(q, k, v, mask)
    out.backward(torch.linspace(-1, 1, out.numel()).view_as(out))
    return out.detach(), [t.grad for t in (q, k, v)]


def _qkv():
    g = torch.Generator().manual_seed(0)
    q = torch.randn(S, B, HEADS, HN, generator=g)
    return q, torch.randn(S, B, GROUPS, HN, generator=g), torch.randn(S, B, GROUPS, HN, generator=g)


def _causal_mask():
    return torch.triu(torch.ones(S, S, dtype=torch.bool), 1).expand(B, 1, S, S)


def _padding_mask():
    mask = torch.zeros(B, 1, 1, S, dtype=torch.bool)
    mask[1, ..., -5:] = True  # the last keys of one sample are padding; every query sees a key
    mask[2, ..., :3] = True
    return mask


CASES = {
    "causal": (dict(), None, None),
    "causal-dataloader-mask": (dict(), _causal_mask, None),
    "causal-layer-scaling": (dict(layer_number=3, apply_query_key_layer_scaling=True), None, None),
    "padding": (dict(mask_type="padding"), _padding_mask, None),
    "causal-dropout": (dict(dropout=0.3), None, 1234),
}


@pytest.mark.parametrize("case", list(CASES))
def test_sdpa_matches_dot_product_attention(model_parallel_1, case):
    """Forward and q/k/v gradients within 1e-5 of the stock module (dropout: same CPU masks)."""
    kw, mask, dropout_seed = CASES[case]
    seed = dropout_seed or 1234
    stock, sdpa = _pair(**kw)
    mask = mask() if mask else None
    qkv = _qkv()
    ref_out, ref_grads = _run(stock, qkv, mask, seed)
    out, grads = _run(sdpa, qkv, mask, seed)
    assert out.shape == (S, B, HEADS * HN)
    errs = [max_rel_diff(out, ref_out)] + [max_rel_diff(g, r) for g, r in zip(grads, ref_grads)]
    assert max(errs) < 1e-5, (case, errs)
    if dropout_seed:  # dropout really dropped
        clean, _ = _run(_pair()[1], qkv, None)
        assert max_rel_diff(out, clean) > 1e-2


def test_apply_swaps_or_refuses(model_parallel_1, monkeypatch):
    """flash/fused swap every stock module (once); what SDPA cannot do is refused in one line,
    or, under auto, left to the stock module."""
    from megatron_oases.attention import SDPAttention, apply_core_attention

    def model():
        stage = torch.nn.ModuleList([torch.nn.Module(), torch.nn.Module()])
        for layer in stage:
            layer.core_attention = _pair()[0]
        return stage

    def args(backend, reset=False):
        return OasesConfig(attention_backend=backend, reset_attention_mask=reset)

    stage = model()
    assert apply_core_attention(stage, args("fused")) == 2
    assert all(type(m.core_attention) is SDPAttention for m in stage)
    assert apply_core_attention(stage, args("fused")) == 0
    assert apply_core_attention(model(), args("unfused")) == 0
    assert apply_core_attention(model(), args("auto")) == 0  # CPU: stock
    with pytest.raises(OasesConfigError, match="--reset-attention-mask.*use --attention-backend "):
        apply_core_attention(model(), args("flash", reset=True))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr("megatron_oases.attention._te_attention", lambda: None)
    assert apply_core_attention(model(), args("auto", reset=True)) == 0
    assert apply_core_attention(model(), args("auto")) == 2
    with pytest.raises(OasesConfigError, match="flash kernel has no fp32; add --bf16"):
        apply_core_attention(model(), args("flash"))


NVTE = ("NVTE_FLASH_ATTN", "NVTE_FUSED_ATTN", "NVTE_UNFUSED_ATTN")


def _attention_worker(base, variants):
    """Each variant through ``pretrain()``, counting SDPAttention calls (proof of the swap)."""
    from helpers.runs import pretrain_and_capture

    from megatron_oases import attention

    forward, out = attention.SDPAttention.forward, {}
    for name, extra in variants:
        calls = []

        def counting(self, *a, **k):
            calls.append(1)
            return forward(self, *a, **k)

        for var in NVTE:  # Megatron's model sets them per backend and refuses a changed one
            os.environ.pop(var, None)
        attention.SDPAttention.forward = counting
        try:
            out[name] = pretrain_and_capture(f"{base} {extra}", grads=True)
        finally:
            attention.SDPAttention.forward = forward
        out[name]["sdpa_calls"] = len(calls)
    return out


VARIANTS = [
    ("stock-off", "--oases-schedule off --attention-backend unfused"),
    ("sdpa-off", "--oases-schedule off --attention-backend flash"),
    ("stock-oases", "--oases-schedule oases --attention-backend unfused"),
    ("sdpa-oases", "--oases-schedule oases --attention-backend flash"),
]


@pytest.mark.timeout(600)
def test_training_with_sdpa_matches_stock_attention():
    """LLaMA-style (GQA, RoPE), TP=2, 2 iterations: SDPA vs stock attention, stock loop and
    Oases schedule; losses and every gradient < 1e-5."""
    base = (
        LLAMA.format(layers=2)
        + "--tensor-model-parallel-size 2 --micro-batch-size 2 --global-batch-size 4 "
        + "--train-iters 2 "
        + NO_DROP
        + RECOMPUTE
    )
    worst = 0.0
    for rank, res in enumerate(run_distributed(_attention_worker, 2, base, VARIANTS, timeout=560)):
        assert res["stock-off"]["sdpa_calls"] == res["stock-oases"]["sdpa_calls"] == 0
        for sdpa, stock in (("sdpa-off", "stock-off"), ("sdpa-oases", "stock-oases")):
            got, ref = res[sdpa], res[stock]
            assert got["sdpa_calls"] > 0, sdpa
            assert len(got["losses"]) == len(ref["losses"]) == 2
            err = max_rel_diff(got["losses"], ref["losses"])
            assert err < 1e-5, (sdpa, rank, got["losses"], ref["losses"])
            worst = max(worst, err)
            assert set(got["grads"]) == set(ref["grads"]) and ref["grads"]
            for pname, g in ref["grads"].items():
                err = max_rel_diff(got["grads"][pname], g)
                assert err < 1e-5, f"{sdpa} rank {rank} {pname}: rel err {err:.2e}"
                worst = max(worst, err)
    print(f"worst relative difference SDPA vs stock attention: {worst:.2e}")


def test_megatron_lm_hook_applies_the_choice(model_parallel_1):
    """Megatron-LM's script path: the model-setup hook's per-stage step swaps too (no plan)."""
    import types

    from megatron_oases.attention import SDPAttention
    from megatron_oases.megatron_lm import hooks

    def args(backend):
        return OasesConfig(attention_backend=backend)

    assert not prepare.changes_model(args("auto"))  # CPU
    assert prepare.changes_model(args("flash"))
    training = types.SimpleNamespace(
        __name__="training",
        setup_model_and_optimizer=lambda model_type, provider=None, *a, **k: k,
        pretrain=lambda setup_model_and_optimizer: setup_model_and_optimizer("model_type"),
    )
    hook = hooks.model_setup_hook(types.SimpleNamespace(), args("flash"), training)
    hook.install()
    try:
        model_cfg = types.SimpleNamespace(pre_wrap_hooks=[])
        training.setup_model_and_optimizer(
            "type", cfg_container=types.SimpleNamespace(model=model_cfg)
        )
    finally:
        hook.uninstall()
    (prepare_stages,) = model_cfg.pre_wrap_hooks
    stage = torch.nn.Module()
    stage.core_attention = _pair()[0]
    assert prepare_stages([stage]) == [stage]
    assert type(stage.core_attention) is SDPAttention
