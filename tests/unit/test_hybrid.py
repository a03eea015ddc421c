"""HybridModel rules (``validation.check_hybrid``) and the block table of a hybrid stage."""

import types

import pytest
from megatron.core.transformer.identity_op import IdentityOp

from megatron_oases.errors import OasesConfigError
from megatron_oases.schedule.megatron.blocks import LayerBlocks, halves
from megatron_oases.validation import check_hybrid


def _args(pattern, **kw):
    base = dict(hybrid_layer_pattern=pattern, transformer_impl="local", spec=None)
    return types.SimpleNamespace(**{**base, **kw})


def test_gpt_runs_are_not_hybrid_runs():
    check_hybrid("oases", types.SimpleNamespace())
    check_hybrid("oases", _args(None))


@pytest.mark.parametrize("pattern", ["*-*-", "*--*", "*-|*-", "-*"])
def test_attention_and_mlp_patterns_run_every_schedule(pattern):
    for mode in ("off", "overlap", "cross-pass", "oases"):
        check_hybrid(mode, _args(pattern))


def test_te_only_layers_are_refused_without_te_even_stock():
    with pytest.raises(OasesConfigError, match="'EM' layers need Transformer Engine") as err:
        check_hybrid("off", _args("*M-E"))
    assert "\n" not in str(err.value)
    check_hybrid("off", _args("*M-E", transformer_impl="transformer_engine"))  # stock with TE


def test_the_schedules_refuse_what_they_do_not_split():
    te = dict(transformer_impl="transformer_engine")
    with pytest.raises(OasesConfigError, match="also has 'M': use --oases-schedule off"):
        check_hybrid("oases", _args("*M*-", **te))
    with pytest.raises(OasesConfigError, match="--oases-plan supports GPTModel only"):
        check_hybrid("off", _args("*-*-", oases_plan="plan.yaml"))
    with pytest.raises(OasesConfigError, match="--oases-split batch"):
        check_hybrid("overlap", _args("*-*-", oases_split="sequence"))


class _Layer:
    """A layer with one or both halves (Megatron's IdentityOp for the missing one)."""

    def __init__(self, attention, mlp, number):
        self.self_attention = object() if attention else IdentityOp()
        self.mlp = object() if mlp else IdentityOp()
        self.layer_number = number


def _blocks(layers):
    blocks = LayerBlocks.__new__(LayerBlocks)  # the table only (no Megatron layer checks)
    blocks.layers = layers
    blocks.table = [(l, k, i) for i, l in enumerate(layers) for k in halves(l)]
    return blocks


def test_block_table_of_gpt_and_hybrid_stages():
    gpt = _blocks([_Layer(True, True, 1), _Layer(True, True, 2)])
    assert [gpt.kind(j) for j in range(gpt.num_blocks)] == ["attention", "mlp"] * 2
    assert [gpt.layer_index(j) for j in range(4)] == [0, 0, 1, 1]  # j // 2, as before
    assert [gpt.first_block(i) for i in range(3)] == [0, 2, 4]
    assert [gpt.starts_layer(j) for j in range(4)] == [True, False, True, False]
    hybrid = _blocks(
        [
            _Layer(True, False, 1),
            _Layer(False, True, 2),
            _Layer(False, True, 3),
            _Layer(True, False, 4),
        ]
    )  # fmt: skip  ('*--*')
    assert [hybrid.kind(j) for j in range(4)] == ["attention", "mlp", "mlp", "attention"]
    assert [hybrid.first_block(i) for i in range(5)] == [0, 1, 2, 3, 4]
    assert all(hybrid.starts_layer(j) for j in range(4))
    assert hybrid.layer_blocks(2) == [2] and gpt.layer_blocks(1) == [2, 3]
    with pytest.raises(OasesConfigError, match="neither self-attention nor an MLP"):
        halves(_Layer(False, False, 1))
