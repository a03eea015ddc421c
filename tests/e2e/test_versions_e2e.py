"""megatron-core versions, on one gloo rank: the model :func:`compat.local_gpt_model` builds (for
0.18) is the model Megatron's own builder builds, and the JIT warm-up leaves the weights' RNG alone.
The version checks and the patched symbols, without a process group:
``tests/unit/test_versions.py``.
"""

from helpers.runs import parse
from helpers.variants import VERSIONS_TINY as TINY

from megatron_oases import compat

#: GPTModel attributes set from its constructor's arguments (beyond the parameters).
MODEL_SETTINGS = (
    "vocab_size",
    "max_sequence_length",
    "pre_process",
    "post_process",
    "fp16_lm_cross_entropy",
    "parallel_output",
    "share_embeddings_and_output_weights",
    "position_embedding_type",
    "rotary_percent",
    "rotary_base",
    "rope_scaling",
    "mtp_process",
    "vp_stage",
)


def test_local_gpt_model_is_the_builders_model(model_parallel_1):
    """0.18 builds the model with :func:`compat.local_gpt_model`; it must stay the model that
    Megatron's own builder (0.19+) builds: same parameters, same initial values."""
    import torch
    from megatron.core.process_groups_config import ProcessGroupCollection

    args = parse(
        TINY.replace("--tensor-model-parallel-size 2", "--tensor-model-parallel-size 1")
        + "--swiglu --normalization RMSNorm --position-embedding-type rope "
        "--untie-embeddings-and-output-weights",
        world_size=1,
    )
    pgs = ProcessGroupCollection.use_mpu_process_groups()
    built, settings = [], []
    for build in (compat.build_gpt_model, compat.local_gpt_model):
        torch.manual_seed(1)
        model = build(args, pgs)
        built.append({k: v for k, v in model.state_dict().items() if torch.is_tensor(v)})
        settings.append(
            {name: getattr(model, name, None) for name in MODEL_SETTINGS}
            | {"inv_freq": model.rotary_pos_emb.inv_freq.tolist()}
        )
    assert settings[0] == settings[1]
    builder, local = built
    assert list(builder) == list(local)
    for name, value in builder.items():
        assert value.shape == local[name].shape, name
        assert torch.equal(value, local[name]), name


def test_jit_warmup_leaves_the_weights_rng_alone(model_parallel_1, monkeypatch):
    """Megatron's JIT warm-up draws micro-batch-shaped random tensors before the model is built;
    on CPU they would come from the generator that then initialises the weights, so micro-batch/2
    (compare's ``*-halfmb`` variants) would start from other weights. The CPU shim restores it."""
    import torch
    from megatron.training import initialize, training

    args = parse(
        TINY.replace("--tensor-model-parallel-size 2", "--tensor-model-parallel-size 1"),
        world_size=1,
    )
    monkeypatch.setattr(initialize, "get_args", lambda: args)
    state = torch.get_rng_state()
    training.set_jit_fusion_options(tp_size=1)
    assert torch.equal(torch.get_rng_state(), state)
