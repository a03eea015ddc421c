"""``--attention-backend``'s choice of core attention for the local spec
(:mod:`megatron_oases.attention`): the backend mapping. SDPA against Megatron's attention, the
swap and its refusals, and a 2-rank training run: ``tests/e2e/test_attention_e2e.py``."""


def test_backend_mapping():
    from megatron_oases.attention import SDPA, STOCK, TE, choose_core_attention

    for backend in ("unfused", "local"):
        assert {choose_core_attention(backend, c, t) for c in (0, 1) for t in (0, 1)} == {STOCK}
    for backend in ("flash", "fused"):
        assert choose_core_attention(backend, cuda=False, te=False) == SDPA
        assert choose_core_attention(backend, cuda=True, te=False) == SDPA
        assert choose_core_attention(backend, cuda=True, te=True) == TE
    assert choose_core_attention("auto", cuda=False, te=True) == STOCK
    assert choose_core_attention("auto", cuda=True, te=False) == SDPA
    assert choose_core_attention("auto", cuda=True, te=True) == TE
