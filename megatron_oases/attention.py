"""The core-attention choice for the local layer spec: softmax(QKᵀ)V by a fused kernel.

Megatron's local spec builds its unfused ``DotProductAttention`` (scores materialised as
[b, np, s, s]) whatever ``--attention-backend`` says; only its TE spec honours the flag, and the TE
spec's linears would take their TP communication away from our schedule. So the choice is applied
from outside, like the per-layer plan: :func:`apply_core_attention` swaps the ``core_attention`` of
each built layer after the build (and after a plan rebuilt layers), before Megatron wraps the model;
the linears stay local. Mapping of Megatron's ``AttnBackend`` values (:func:`choose_core_attention`):

- ``unfused``, ``local``: Megatron's ``DotProductAttention`` (``local`` is Megatron's name for it,
  but its 0.19.2 argument check demands ``--spec local``, which its GPT builder cannot import).
- ``flash``, ``fused``: Transformer Engine's attention (``TEDotProductAttention``) when
  ``transformer_engine`` imports and CUDA is up: TE picks its flash or cuDNN fused kernel from the
  ``NVTE_*`` variables Megatron's model sets for these values. Otherwise :class:`SDPAttention`, on
  CUDA pinned to PyTorch's flash kernel (``flash``) or its cuDNN / memory-efficient kernels
  (``fused``), on CPU whatever kernel PyTorch has. A configuration they cannot compute as Megatron
  does is refused with one line (:func:`unsupported`).
- ``auto`` (Megatron's default): on CUDA the same without a pin (PyTorch or TE picks the kernel),
  quietly keeping the stock module where it would be refused; on CPU the stock module, which the
  parity tests, golden values and profiles of CPU runs are recorded against.
"""

import logging
import math
from contextlib import nullcontext

import torch
import torch.nn.functional as F
from megatron.core import tensor_parallel
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.enums import AttnBackend, AttnMaskType
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.utils import is_layer_window_attention
from megatron.core.utils import divide

from .errors import OasesConfigError

log = logging.getLogger(__name__)

STOCK, SDPA, TE = "stock", "sdpa", "te"
#: The score Megatron's ``attention_mask_func`` gives masked positions.
MASKED_SCORE = -10000.0


def _kernels(backend):
    """The SDPA kernels a CUDA run of ``backend`` is pinned to (None: PyTorch chooses)."""
    from torch.nn.attention import SDPBackend

    return {
        AttnBackend.flash: [SDPBackend.FLASH_ATTENTION],
        AttnBackend.fused: [SDPBackend.CUDNN_ATTENTION, SDPBackend.EFFICIENT_ATTENTION],
    }.get(backend)


def unsupported(config, layer_number=1, reset_attention_mask=False):
    """Why SDPA or TE cannot compute this layer's attention as Megatron's module does, or None."""
    if getattr(config, "softmax_type", "vanilla") != "vanilla":
        return f"--softmax-type {config.softmax_type} (a softmax offset) is not in SDPA"
    if is_layer_window_attention(config.window_size, config.window_attn_skip_freq, layer_number):
        return "sliding-window attention (--window-size) is not wired for SDPA"
    if reset_attention_mask:
        return (
            "--reset-attention-mask makes per-document masks, but a causal kernel applies the "
            "causal mask only (as Megatron's TE attention does)"
        )
    return None


def _te_attention():
    """TE's attention class for Megatron, or None when Transformer Engine is not importable."""
    try:
        import transformer_engine  # noqa: F401
        from megatron.core.extensions.transformer_engine import TEDotProductAttention
    except Exception:  # not installed, or installed without a usable CUDA build
        return None
    return TEDotProductAttention


def choose_core_attention(backend, cuda=None, te=None):
    """STOCK, SDPA or TE for an ``AttnBackend`` (see the module docstring for why)."""
    backend = AttnBackend[backend] if isinstance(backend, str) else backend
    cuda = torch.cuda.is_available() if cuda is None else cuda
    te = (_te_attention() is not None) if te is None else te
    if backend in (AttnBackend.unfused, AttnBackend.local):
        return STOCK
    if backend == AttnBackend.auto and not cuda:
        return STOCK
    return TE if te and cuda else SDPA


class SDPAttention(MegatronModule):
    """Megatron's ``DotProductAttention`` (same constructor, forward and attributes) computed by
    ``torch.nn.functional.scaled_dot_product_attention``.

    Semantics kept: [s, b, np, hn] in, [s, b, hp] out; GQA by repeating K/V per group (as the stock
    module; works with every SDPA kernel); scale ``1/sqrt(hn)`` or ``softmax_scale``; dropout on
    the probabilities inside Megatron's model-parallel RNG fork (not under sequence parallelism),
    so each TP rank draws its own mask and recomputation redraws the same one. On CPU the masks are
    the stock module's bit for bit (same generator, same shape). Differences, on purpose:

    - ``causal``: the causal mask is the kernel's and a given ``attention_mask`` is ignored, as
      Megatron's TE attention does (a flash kernel takes no mask); per-document masks
      (``--reset-attention-mask``) are refused by :func:`apply_core_attention`.
    - other mask types: the boolean mask (True = masked) becomes an additive -10000 mask; a query
      whose keys are all masked (a padding query) then attends normally instead of uniformly.
    - ``apply_query_key_layer_scaling`` only guards fp16 scores in the unfused path; the kernels
      accumulate in fp32, so the net scale is applied once (``softmax_scale`` is that net scale).
    - no ``attention_bias``, packed sequences, softmax offsets or sliding windows (the stock module
      has none of the first two either): refused.
    """

    def __init__(
        self,
        config,
        layer_number,
        attn_mask_type,
        attention_type,
        attention_dropout=None,
        softmax_scale=None,
        cp_comm_type=None,
        pg_collection=None,
        backend=AttnBackend.auto,
    ):
        super().__init__(config=config)
        if config.context_parallel_size != 1:
            raise OasesConfigError("SDPA core attention has no context parallelism; use TE's")
        self.layer_number = max(1, layer_number)
        reason = unsupported(config, self.layer_number)
        if reason:
            raise OasesConfigError(f"{reason}; use --attention-backend unfused")
        self.attn_mask_type = attn_mask_type
        self.attention_type = attention_type
        self.backend = backend
        if pg_collection is None:
            pg_collection = ProcessGroupCollection.use_mpu_process_groups(required_pgs=["tp"])
        self.pg_collection = pg_collection
        self.tp_group = pg_collection.tp
        world_size = pg_collection.tp.size()
        projection_size = config.kv_channels * config.num_attention_heads
        self.hidden_size_per_partition = divide(projection_size, world_size)
        self.hidden_size_per_attention_head = divide(projection_size, config.num_attention_heads)
        self.num_attention_heads_per_partition = divide(config.num_attention_heads, world_size)
        self.num_query_groups_per_partition = divide(config.num_query_groups, world_size)
        self.softmax_scale = (
            1.0 / math.sqrt(self.hidden_size_per_attention_head)
            if softmax_scale is None
            else softmax_scale
        )
        self.attention_dropout = torch.nn.Dropout(
            config.attention_dropout if attention_dropout is None else attention_dropout
        )
        self.softmax_offset = None  # read by Megatron's attention (flash-decode path)

    @classmethod
    def from_stock(cls, stock, backend=AttnBackend.auto):
        """The SDPA twin of a built ``DotProductAttention`` (its config, groups, dropout)."""
        return cls(
            stock.config,
            stock.layer_number,
            stock.attn_mask_type,
            stock.attention_type,
            attention_dropout=stock.attention_dropout.p,
            softmax_scale=stock.config.softmax_scale,  # what Megatron's Attention passes
            pg_collection=stock.pg_collection,
            backend=backend,
        )

    def _mask(self, query, key, attention_mask, attn_mask_type):
        """(attn_mask, is_causal) for SDPA, for [b, np, sq, sk] scores."""
        sq, sk = query.size(0), key.size(0)
        if attn_mask_type == AttnMaskType.causal:
            if sq == sk:
                return None, sq > 1
            if sq == 1:  # one new token (KV cache): it sees every key, as in the stock module
                return None, False
            raise ValueError(f"causal SDPA attention needs sq == sk or sq == 1, got {sq}, {sk}")
        if attention_mask is None:
            return None, False
        if attention_mask.dtype != torch.bool:
            attention_mask = attention_mask.bool()
        additive = torch.zeros(attention_mask.shape, dtype=query.dtype, device=query.device)
        return additive.masked_fill_(attention_mask, MASKED_SCORE), False

    def forward(
        self,
        query,
        key,
        value,
        attention_mask,
        attn_mask_type=None,
        attention_bias=None,
        packed_seq_params=None,
    ):
        """[sq, b, np, hn] x [sk, b, ng, hn] x2 -> [sq, b, np*hn]."""
        if packed_seq_params is not None or attention_bias is not None:
            raise OasesConfigError(
                "SDPA core attention takes no packed sequences or attention bias; "
                "use --attention-backend unfused (or TE's attention for packed sequences)"
            )
        repeat = self.num_attention_heads_per_partition // self.num_query_groups_per_partition
        if repeat > 1:
            key = key.repeat_interleave(repeat, dim=2)
            value = value.repeat_interleave(repeat, dim=2)
        # The stock module ignores its forward's attn_mask_type too (the constructor's decides).
        attn_mask, is_causal = self._mask(query, key, attention_mask, self.attn_mask_type)
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))  # [b, np, s, hn]
        dropout_p = self.attention_dropout.p if self.training else 0.0
        kernels = _kernels(self.backend) if q.is_cuda else None
        if kernels is None:
            pin = nullcontext()
        else:
            from torch.nn.attention import sdpa_kernel

            pin = sdpa_kernel(kernels)
        rng = (
            nullcontext()
            if self.config.sequence_parallel
            else tensor_parallel.get_cuda_rng_tracker().fork()
        )
        with rng, pin:
            context = F.scaled_dot_product_attention(
                q,
                k,
                v,
                attn_mask=attn_mask,
                dropout_p=dropout_p,
                is_causal=is_causal,
                scale=self.softmax_scale,
            )
        # [b, np, sq, hn] -> [sq, b, np * hn]
        context = context.permute(2, 0, 1, 3).contiguous()
        return context.view(*context.shape[:2], self.hidden_size_per_partition)


def _make(stock, choice, backend):
    if choice == SDPA:
        return SDPAttention.from_stock(stock, backend)
    return _te_attention()(
        config=stock.config,
        layer_number=stock.layer_number,
        attn_mask_type=stock.attn_mask_type,
        attention_type=stock.attention_type,
        attention_dropout=stock.attention_dropout.p,
        softmax_scale=stock.config.softmax_scale,
        pg_collection=stock.pg_collection,
    )


def apply_core_attention(model, config):
    """Swap every stock ``core_attention`` in one built model stage for the one ``config`` (an
    :class:`~megatron_oases.config.OasesConfig`: ``--attention-backend``) chooses.

    Returns how many were swapped. Idempotent (swapped modules are no longer stock). For
    ``flash``/``fused`` a layer the kernel cannot compute exactly is an :class:`OasesConfigError`
    naming the fix; for ``auto`` it keeps the stock module.
    """
    backend = AttnBackend[config.attention_backend]
    choice = choose_core_attention(backend)
    if choice == STOCK:
        return 0
    half = config.half_precision
    if choice == SDPA and backend == AttnBackend.flash and torch.cuda.is_available() and not half:
        raise OasesConfigError(
            "--attention-backend flash: PyTorch's flash kernel has no fp32; add --bf16 (or "
            "--fp16), or use --attention-backend fused or auto"
        )
    swapped = 0
    for owner in list(model.modules()):
        stock = getattr(owner, "core_attention", None)
        if type(stock) is not DotProductAttention:
            continue
        reason = unsupported(stock.config, stock.layer_number, config.reset_attention_mask)
        if reason and backend == AttnBackend.auto:
            continue
        if reason:
            raise OasesConfigError(
                f"--attention-backend {backend.name}: {reason}; use --attention-backend unfused"
            )
        owner.core_attention = _make(stock, choice, backend)
        swapped += 1
    if swapped:
        log.info("core attention: %s (%s) in %d layers", choice, backend.name, swapped)
    return swapped
