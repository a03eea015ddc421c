"""The schedule is applied to one model instance (``prepare_model`` →
:func:`megatron_oases.schedule.megatron.binding.bind_schedule`), not to Megatron's classes: on one gloo rank,
a prepared model and a second model built in the same process, from the same weights."""

import functools

import pytest
import torch
from helpers.runs import parse
from helpers.variants import VERSIONS_TINY as TINY

from megatron_oases import compat, patches, prepare
from megatron_oases.config import OasesConfig
from megatron_oases.validation import Schedule


@pytest.mark.timeout(120)
def test_the_schedule_binds_to_one_model_and_another_stays_stock(model_parallel_1):
    """The prepared model's forwards and TP linears are the schedule's; another model in the
    process keeps Megatron's classes and forwards, and both give the same loss and gradients
    in training."""
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.tensor_parallel.layers import (
        ColumnParallelLinear,
        RowParallelLinear,
        VocabParallelEmbedding,
    )

    from megatron_oases.schedule.megatron.linears import (
        DeferringColumnLinear,
        DeferringEmbedding,
        DeferringRowLinear,
    )

    args = parse(
        TINY.replace("--tensor-model-parallel-size 2", "--tensor-model-parallel-size 1")
        + "--oases-schedule overlap --hidden-dropout 0 --attention-dropout 0",
        world_size=1,
    )
    config = OasesConfig.from_args(args)
    pgs = ProcessGroupCollection.use_mpu_process_groups()
    runtime = prepare.install(config)
    try:
        torch.manual_seed(1)
        ours = prepare.prepare_model(compat.build_gpt_model(args, pgs), runtime)
        stock = compat.build_gpt_model(args, pgs)
        stock.load_state_dict(ours.state_dict())
        for model in (ours, stock):
            model.train()

        assert isinstance(vars(ours)["forward"], functools.partial)
        assert isinstance(vars(ours)["_postprocess"], functools.partial)
        assert isinstance(vars(ours.decoder)["forward"], functools.partial)
        for model in (stock, stock.decoder):
            assert "forward" not in vars(model) and "_postprocess" not in vars(model)
        mixins = {
            ColumnParallelLinear: DeferringColumnLinear,
            RowParallelLinear: DeferringRowLinear,
            VocabParallelEmbedding: DeferringEmbedding,
        }
        for megatron_class, mixin in mixins.items():
            mine = [m for m in ours.modules() if isinstance(m, megatron_class)]
            theirs = [m for m in stock.modules() if isinstance(m, megatron_class)]
            assert mine and len(mine) == len(theirs), megatron_class
            assert all(isinstance(m, mixin) for m in mine), megatron_class
            assert all(type(m) is megatron_class for m in theirs), megatron_class

        b, s = args.micro_batch_size, args.seq_length
        tokens = torch.randint(0, ours.vocab_size, (b, s))
        labels = torch.randint(0, ours.vocab_size, (b, s))
        position_ids = torch.arange(s).unsqueeze(0).expand(b, s)
        mask = torch.tril(torch.ones(1, 1, s, s)) < 0.5
        losses = []
        for model in (ours, stock):
            loss = model(tokens, position_ids, mask, labels=labels)
            loss.sum().backward()
            losses.append(loss.detach())
        torch.testing.assert_close(losses[0], losses[1])
        grads = [{n: p.grad for n, p in m.named_parameters()} for m in (ours, stock)]
        assert grads[0].keys() == grads[1].keys()
        for name, g in grads[0].items():
            torch.testing.assert_close(g, grads[1][name], msg=name)
    finally:
        patches.uninstall_all()


def _loss_and_grads(model, args):
    torch.manual_seed(2)
    b, s = args.micro_batch_size, args.seq_length
    tokens = torch.randint(0, model.vocab_size, (b, s))
    labels = torch.randint(0, model.vocab_size, (b, s))
    position_ids = torch.arange(s).unsqueeze(0).expand(b, s)
    mask = torch.tril(torch.ones(1, 1, s, s)) < 0.5
    model.zero_grad()
    loss = model(tokens, position_ids, mask, labels=labels)
    loss.sum().backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.timeout(120)
def test_two_runtimes_prepare_two_models_that_share_nothing(model_parallel_1):
    """Issue 59.2: ``prepare_model(model, runtime)`` takes the run's runtime as an argument, made
    without installing anything process-wide; two runtimes prepare two models, each bound to its
    own schedule selection: one switched to stock leaves the other split, both train as stock
    does, and a stage is prepared once."""
    from megatron.core.process_groups_config import ProcessGroupCollection

    args = parse(
        TINY.replace("--tensor-model-parallel-size 2", "--tensor-model-parallel-size 1")
        + "--oases-schedule overlap --hidden-dropout 0 --attention-dropout 0",
        world_size=1,
    )
    pgs = ProcessGroupCollection.use_mpu_process_groups()
    before = patches.installed()
    first = patches.make_runtime(OasesConfig.from_args(args))
    second = patches.make_runtime(OasesConfig.from_args(args))
    assert patches.installed() == before  # making a runtime installs nothing
    assert first.selection is not second.selection

    torch.manual_seed(1)
    stock = compat.build_gpt_model(args, pgs)
    models = []
    for runtime in (first, second):
        model = compat.build_gpt_model(args, pgs)
        model.load_state_dict(stock.state_dict())
        models.append(prepare.prepare_model(model, runtime))
    a, b = models
    stage_of = lambda m: vars(m.decoder)["forward"].args[1]  # noqa: E731 (its StageSchedule)
    assert stage_of(a).layer_schedule is first.selection
    assert stage_of(b).layer_schedule is second.selection
    assert stage_of(a).deferral is not stage_of(b).deferral
    assert a in first.prepared and a not in second.prepared and b in second.prepared
    with pytest.raises(RuntimeError, match="prepared already"):
        prepare.prepare_model(a, first)

    first.selection.select(Schedule.OFF)  # as auto's tuner does between iterations
    assert second.selection.schedule == Schedule.OVERLAP
    from megatron_oases.schedule.megatron import entry

    split_calls = []  # which model runs the engine

    real = entry.run_scheduled
    entry.run_scheduled = lambda scheduled, hidden: split_calls.append(scheduled) or real(
        scheduled, hidden
    )
    try:
        reference = _loss_and_grads(stock, args)
        for model in models:
            loss, grads = _loss_and_grads(model, args)
            torch.testing.assert_close(loss, reference[0])
            for name, g in grads.items():
                torch.testing.assert_close(g, reference[1][name], msg=name)
    finally:
        entry.run_scheduled = real
    assert len(split_calls) == 1  # the second model only: the first runs stock now
