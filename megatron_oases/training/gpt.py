"""What Megatron-LM's ``pretrain_gpt.py`` passes to ``pretrain()``, on the installed ``megatron.training``.

The megatron-core wheel (0.17+) ships Megatron-LM's loop (``megatron.training``) but not the
``pretrain_gpt.py`` script: this module supplies its four arguments — a model provider (Megatron's
own ``GPTModelBuilder`` with the local layer spec, through
:func:`megatron_oases.compat.build_gpt_model`), ``forward_step`` with the masked-mean-per-token
loss and Megatron's NaN/Inf checks, and a dataset provider (``MockGPTDataset`` for ``--mock-data``,
``GPTDataset`` for ``--data-path``) — plus the one Oases hook: :func:`model_provider` installs the
run's runtime on its first call (distributed state is up, no model built yet) and prepares each
built stage with it (:mod:`megatron_oases.prepare`).
"""

from functools import partial

import torch
from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig, MockGPTDataset
from megatron.core.rerun_state_machine import get_rerun_state_machine
from megatron.core.utils import get_attr_wrapped_model
from megatron.training import get_args, print_rank_0
from megatron.training.utils import get_blend_and_blend_per_split, is_first_or_last_pipeline_stage

from .. import prepare
from ..compat import build_gpt_model

BATCH_KEYS = ("tokens", "labels", "loss_mask", "attention_mask", "position_ids")


def model_provider(
    pre_process=True,
    post_process=True,
    vp_stage=None,
    config=None,
    pg_collection=None,
    *,
    args,
    runtime,
):
    """One pipeline stage of the GPT model (a ``HybridModel`` with ``--hybrid-layer-pattern``, as
    Megatron-LM's ``pretrain_hybrid.py`` builds): Megatron's builder, then the stage prepared with
    the run's runtime. ``args``: the parsed Megatron args; ``runtime``: a
    :class:`~megatron_oases.prepare.RuntimeOnce`, bound by :func:`bind_model_provider` (``config``
    is Megatron's own model config)."""
    run = runtime.get()  # installed on the first stage: after distributed init, before a model
    if pg_collection is None:
        from megatron.core.process_groups_config import ProcessGroupCollection

        pg_collection = ProcessGroupCollection.use_mpu_process_groups()
    build = build_gpt_model
    if getattr(args, "hybrid_layer_pattern", None):  # Megatron's HybridModel (pretrain_hybrid.py)
        from .hybrid import build_hybrid_model as build
    model = build(args, pg_collection, pre_process, post_process, vp_stage, config)
    return prepare.prepare_model(model, run)


def bind_model_provider(args, oases_config):
    """:func:`model_provider` with the run's parsed settings (its runtime installed on the first
    call), as Megatron's ``pretrain()`` calls it."""
    return partial(model_provider, args=args, runtime=prepare.RuntimeOnce(oases_config))


def get_batch(data_iterator, vp_stage=None):
    """This micro-batch on the stages that read data (first and last); Nones elsewhere.

    Every tensor-parallel rank of those stages reads the same samples from its own loader (the
    dataset is built on each of them), so no broadcast inside the TP group is needed.
    """
    if not is_first_or_last_pipeline_stage(vp_stage):
        return (None,) * len(BATCH_KEYS)
    batch = next(data_iterator)
    device = torch.cuda.current_device() if torch.cuda.is_available() else "cpu"
    return tuple(
        batch[k].to(device, non_blocking=True) if batch.get(k) is not None else None
        for k in BATCH_KEYS
    )


def loss_func(loss_mask, output_tensor):
    """Sum of token losses and the token count (Megatron divides globally); NaN/Inf stop the run."""
    args = get_args()
    losses = output_tensor.view(-1).float()
    loss_mask = loss_mask.view(-1).float()
    loss = torch.sum(losses * loss_mask)
    num_tokens = loss_mask.sum().clone().detach().to(torch.int)
    if args.check_for_nan_in_loss_and_grad:
        rerun = get_rerun_state_machine()
        for reject, what in ((torch.isnan, "NaN"), (torch.isinf, "Inf")):
            rerun.validate_result(
                result=loss,
                rejection_func=reject,
                message=f"found {what} in local forward loss calculation",
                tolerance=0.0,
                fatal=True,
            )
    report = {"lm loss": torch.cat([loss.clone().detach().view(1), num_tokens.view(1)])}
    return loss, num_tokens, report


#: Without CUDA: the default generator's state when the datasets were requested, put back at the
#: first forward (``(id(args), state)``). On CPU, dropout draws from the default generator, which
#: Megatron's DataLoader also draws its base seed from when its iterator is created — after a
#: checkpoint's RNG state was restored — so a resumed run's dropout masks would differ from those
#: of the uninterrupted run. On CUDA, dropout uses the CUDA generator and nothing is needed.
_RNG_BEFORE_DATA = None


def _mark_rng_before_data():
    global _RNG_BEFORE_DATA
    if not torch.cuda.is_available():
        _RNG_BEFORE_DATA = (id(get_args()), torch.get_rng_state())


def _restore_rng_before_data():
    global _RNG_BEFORE_DATA
    if _RNG_BEFORE_DATA is not None:
        owner, state = _RNG_BEFORE_DATA
        _RNG_BEFORE_DATA = None
        if owner == id(get_args()):
            torch.set_rng_state(state)


def forward_step(data_iterator, model):
    """One micro-batch through one model chunk. ``model`` arrives wrapped (DDP, ``Float16Module``):
    the chunk's ``vp_stage`` is read on the chunk inside, as Megatron-LM's ``pretrain_gpt.py``
    does; read on the wrapper it is None, and under the interleaved schedule a middle chunk of
    the first or last rank would take itself for a stage that reads data."""
    _restore_rng_before_data()  # once per run, before its first forward (a no-op on CUDA)
    tokens, labels, loss_mask, attention_mask, position_ids = get_batch(
        data_iterator, get_attr_wrapped_model(model, "vp_stage")
    )
    output = model(tokens, position_ids, attention_mask, labels=labels, loss_mask=loss_mask)
    return output, partial(loss_func, loss_mask)


def _dataset_config(args):
    from megatron.core.tokenizers.utils.build_tokenizer import build_tokenizer

    blend, blend_per_split = get_blend_and_blend_per_split(args)
    return GPTDatasetConfig(
        random_seed=args.seed,
        sequence_length=args.seq_length,
        blend=blend,
        blend_per_split=blend_per_split,
        split=args.split,
        num_dataset_builder_threads=args.num_dataset_builder_threads,
        path_to_cache=args.data_cache_path,
        mmap_bin_files=args.mmap_bin_files,
        tokenizer=build_tokenizer(args),
        reset_position_ids=args.reset_position_ids,
        reset_attention_mask=args.reset_attention_mask,
        eod_mask_loss=args.eod_mask_loss,
        create_attention_mask=args.create_attention_mask_in_dataloader,
    )


def train_valid_test_datasets_provider(train_val_test_num_samples, vp_stage=None):
    """Megatron's GPT datasets, built on every rank of the stages that read data."""
    args = get_args()
    _mark_rng_before_data()
    dataset_type = MockGPTDataset if args.mock_data else GPTDataset
    print_rank_0("> building train, validation, and test datasets for GPT ...")
    datasets = BlendedMegatronDatasetBuilder(
        dataset_type,
        train_val_test_num_samples,
        lambda: is_first_or_last_pipeline_stage(vp_stage),
        _dataset_config(args),
    ).build()
    print_rank_0("> finished creating GPT datasets ...")
    return datasets


# Megatron calls the provider on every rank; it decides per rank what to build.
train_valid_test_datasets_provider.is_distributed = True
