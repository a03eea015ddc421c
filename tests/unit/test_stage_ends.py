"""The stage ends in the schedule (:mod:`megatron_oases.schedule.megatron.stage_ends`) without a process group:
only Megatron's unfused loss runs in steps, and a placeholder never passes as data. The ops against
autograd and Megatron's cross entropy on ranks: ``tests/e2e/test_stage_ends_e2e.py``."""

import types

import pytest
import torch


def test_only_megatrons_unfused_loss_runs_in_steps():
    """The steps reproduce ``vocab_parallel_cross_entropy`` only: a fused cross-entropy, a
    model's own ``compute_language_model_loss`` or a single rank keep Megatron's loss in one op."""
    from megatron.core.models.common.language_module.language_module import LanguageModule

    from megatron_oases.schedule.megatron.loss import qualifies

    class Model:
        compute_language_model_loss = LanguageModule.compute_language_model_loss

        def __init__(self, fusion):
            self.config = types.SimpleNamespace(cross_entropy_loss_fusion=fusion)

    class OwnLoss(Model):
        def compute_language_model_loss(self, labels, logits):
            return logits

    two, one = types.SimpleNamespace(size=lambda: 2), types.SimpleNamespace(size=lambda: 1)
    assert qualifies(Model(False), two)
    assert not qualifies(Model(True), two)
    assert not qualifies(OwnLoss(False), two)
    assert not qualifies(Model(False), one)


def test_a_placeholder_never_passes_as_data():
    """The embedding's placeholder is data for nothing but the schedule: one changed on its way,
    or never taken, is an error, never a silent wrong result."""
    from megatron_oases.schedule.megatron.gpt_model import StageCall

    model = types.SimpleNamespace(decoder=None)
    placeholder = torch.zeros(2)
    call = StageCall(model, None, None, embedding=object(), stand_in=placeholder)
    with pytest.raises(RuntimeError, match="never reached the schedule"):
        call.check_taken()
    with pytest.raises(RuntimeError, match="changed before the transformer layers"):
        call.take(block=None, hidden=placeholder + 0)
    assert call.resolve(torch.ones(2)).sum() == 2  # other tensors pass through
    embedding, output = call.take(block=None, hidden=placeholder)
    assert embedding is not None and output is None
    call.check_taken()  # taken: no error
    assert call.resolve(placeholder) is placeholder  # nothing left to resolve
