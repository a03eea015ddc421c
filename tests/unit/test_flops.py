"""Megatron's model-FLOP formula against hand-computed GEMM counts."""

import pytest

from megatron_oases.training.flops import num_floating_point_operations


def hand_count(b, s, L, h, f, n, g, V, swiglu):
    d = h // n
    hq, hkv = n * d, g * d
    per_token_layer = (
        2 * h * (hq + 2 * hkv)  # QKV
        + 2 * hq * h  # output projection
        + 2 * s * hq  # QK^T and AV, causal half of 2·2·s·hq
        + 2 * h * f * (3 if swiglu else 2)  # MLP GEMMs (SwiGLU: gate, up, down)
    )
    per_token = L * per_token_layer + 2 * h * V  # + logits
    return 3 * b * s * per_token  # fwd, dgrad, wgrad


@pytest.mark.parametrize(
    "cfg",
    [
        dict(b=8, s=1024, L=24, h=2048, f=8192, n=16, g=16, V=51200, swiglu=False),
        dict(b=4, s=512, L=4, h=1024, f=2816, n=16, g=4, V=32000, swiglu=True),
        dict(b=1, s=32, L=2, h=64, f=256, n=4, g=4, V=512, swiglu=False),
    ],
)
def test_flops_match_hand_count(cfg):
    got = num_floating_point_operations(
        cfg["b"],
        cfg["s"],
        cfg["L"],
        cfg["h"],
        cfg["f"],
        cfg["n"],
        cfg["g"],
        cfg["V"],
        swiglu=cfg["swiglu"],
    )
    assert got == pytest.approx(hand_count(**cfg), rel=1e-12)


def test_gpt3_like_value():
    # 12·b·s·L·h²·(1 + 1 + s/(2h) + 4 + V/(2Lh)) for h=2048, L=24, s=1024, V=51200, b=1
    h, L, s, V = 2048, 24, 1024, 51200
    expected = 12 * s * L * h * h * (2 + s / (2 * h) + 4 + V / (2 * L * h))
    assert num_floating_point_operations(1, s, L, h, 4 * h, 16, 16, V) == pytest.approx(expected)
