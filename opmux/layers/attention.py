"""Attention layers of vLLM 0.32's CustomOp table: ``mm_encoder_attn`` and
``multi_head_latent_attention``.

:class:`MMEncoderAttention` is vLLM's vision-encoder attention (no cache, non-causal, packed
sequences through ``cu_seqlens``); its platform paths call ``opmux::encoder_attention``.
vLLM forces this layer on (its ``enabled()`` is always true); opmux lets ``set_custom_ops``
switch it like every other row (``"all,-mm_encoder_attn"`` runs ``forward_native``).

:class:`MultiHeadLatentAttentionWrapper` is vLLM's outer MLA layer (projections, norms, rope,
``o_proj``) over a paged latent cache. How it receives the cache and the batch layout:

- the cache is the layer's ``kv_cache`` attribute (``None`` until an engine binds a
  ``[num_blocks, block_size, kv_lora_rank + qk_rope_head_dim]`` tensor, as vLLM binds
  ``Attention.kv_cache``); the layer writes each token's latent into it (in place);
- the batch layout is an :class:`MLAAttentionMetadata`, passed as the keyword
  ``attn_metadata`` or, when omitted, taken from the :func:`opmux.core.forward_context`
  that the engine sets around the forward pass (its ``metadata``; either the metadata
  object itself or a mapping from the layer's ``prefix`` to one). Pass it explicitly
  inside ``torch.compile`` regions: Dynamo reads the context at trace time only.

Its platform paths run ``opmux::concat_and_cache_mla`` and ``opmux::mla_attention``;
``forward_native`` computes the same in plain PyTorch. Sparse MLA (an indexer), decode
context parallelism (``dcp``) and the fused q/kv norm kernel are not supported and are
refused at construction with a clear error.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from opmux.layers.custom_op import CustomOp, _OpLayer
from opmux.ops import attention as ops

__all__ = [
    "MLAAttentionMetadata",
    "MLAModules",
    "MMEncoderAttention",
    "MultiHeadLatentAttentionWrapper",
]


# -------------------------------------------------------------------------- encoder attention
@CustomOp.register("mm_encoder_attn")
class MMEncoderAttention(_OpLayer):
    """Multi-head attention without a cache, for multimodal encoders (vLLM 0.32).

    ``forward(query, key, value, cu_seqlens=None, max_seqlen=None, sequence_lengths=None)``:
    ``query`` ``[B, q_len, H*D]`` (or ``[B, q_len, H, D]``), ``key``/``value`` with
    ``num_kv_heads`` heads; with ``cu_seqlens`` each batch row is cut along the sequence
    dimension into independent sequences. Returns ``[B, q_len, H*D]`` (or the 4-d shape).
    ``max_seqlen`` (vLLM: a tensor for flash-attention backends) is passed to the op only
    when it is a Python int; ``sequence_lengths`` (vLLM's FlashInfer input) is ignored.
    """

    def __init__(self, num_heads: int, head_size: int, scale: float | None = None,
                 num_kv_heads: int | None = None, prefix: str = "") -> None:
        super().__init__()
        self.num_heads = num_heads
        self.head_size = head_size
        self.scale = 1.0 / (head_size ** 0.5) if scale is None else scale
        self.num_kv_heads = num_heads if num_kv_heads is None else num_kv_heads
        self.layer_name = prefix
        if self.num_kv_heads <= 0 or self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads ({self.num_heads}) is not divisible by num_kv_heads "
                             f"({self.num_kv_heads})")
        self.num_queries_per_kv = self.num_heads // self.num_kv_heads
        self.dtype = torch.get_default_dtype()

    def _views(self, query: Tensor, key: Tensor, value: Tensor
               ) -> tuple[Tensor, Tensor, Tensor]:
        bsz, q_len = query.shape[:2]
        kv_len = key.shape[1]
        return (query.view(bsz, q_len, self.num_heads, self.head_size),
                key.view(bsz, kv_len, self.num_kv_heads, self.head_size),
                value.view(bsz, kv_len, self.num_kv_heads, self.head_size))

    def forward_native(self, query: Tensor, key: Tensor, value: Tensor,
                       cu_seqlens: Tensor | None = None, max_seqlen: Any = None,
                       sequence_lengths: Tensor | None = None) -> Tensor:
        bsz, q_len = query.shape[:2]
        reshaped = query.dim() != 4
        q, k, v = (t.transpose(1, 2) for t in self._views(query, key, value))  # [B, H, s, D]
        gqa = self.num_heads > self.num_kv_heads
        if cu_seqlens is None:
            out = F.scaled_dot_product_attention(q, k, v, scale=self.scale, enable_gqa=gqa)
        else:
            lens = (cu_seqlens[1:] - cu_seqlens[:-1]).tolist()
            out = torch.cat([F.scaled_dot_product_attention(qi, ki, vi, scale=self.scale,
                                                            enable_gqa=gqa)
                             for qi, ki, vi in zip(q.split(lens, 2), k.split(lens, 2),
                                                   v.split(lens, 2), strict=True)], dim=2)
        out = out.transpose(1, 2)
        return out.reshape(bsz, q_len, -1) if reshaped else out.contiguous()

    def forward_op(self, query: Tensor, key: Tensor, value: Tensor,
                   cu_seqlens: Tensor | None = None, max_seqlen: Any = None,
                   sequence_lengths: Tensor | None = None) -> Tensor:
        """The platform path: ``opmux::encoder_attention`` over the packed batch."""
        bsz, q_len = query.shape[:2]
        if key.shape[1] != q_len:   # cross-length attention is not a packed self-attention
            return self.forward_native(query, key, value, cu_seqlens, max_seqlen)
        q, k, v = (t.reshape(bsz * q_len, t.shape[2], self.head_size)
                   for t in self._views(query, key, value))
        hint = max_seqlen if isinstance(max_seqlen, int) else None
        if cu_seqlens is None:
            cu = torch.arange(0, (bsz + 1) * q_len, q_len, dtype=torch.int32,
                              device=query.device)
            hint = q_len
        elif bsz == 1:
            cu = cu_seqlens.to(torch.int32)
        else:   # every batch row is cut the same way
            starts = torch.arange(bsz, device=query.device, dtype=torch.int32) * q_len
            inner = cu_seqlens[:-1].to(torch.int32).unsqueeze(0) + starts.unsqueeze(1)
            cu = torch.cat([inner.flatten(), starts.new_full((1,), bsz * q_len)])
        out: Tensor = ops.encoder_attention(q, k, v, cu, hint, self.scale)
        if query.dim() != 4:
            return out.view(bsz, q_len, -1)
        return out.view(bsz, q_len, self.num_heads, self.head_size)

    def extra_repr(self) -> str:
        return (f"num_heads={self.num_heads}, head_size={self.head_size}, "
                f"num_kv_heads={self.num_kv_heads}, scale={self.scale}")


# ------------------------------------------------------------------------------------- MLA
@dataclass
class MLAModules:
    """The sub-modules of an MLA layer (vLLM 0.32's ``MLAModules``; same field names)."""

    kv_a_layernorm: nn.Module
    kv_b_proj: nn.Module
    rotary_emb: nn.Module | None
    o_proj: nn.Module
    fused_qkv_a_proj: nn.Module | None
    kv_a_proj_with_mqa: nn.Module | None
    q_a_layernorm: nn.Module | None
    q_b_proj: nn.Module | None
    q_proj: nn.Module | None
    indexer: nn.Module | None = None
    is_sparse: bool = False
    topk_indices_buffer: Tensor | None = None
    indexer_rotary_emb: nn.Module | None = None
    g_proj: nn.Module | None = None
    index_group_builder: Any = None


@dataclass
class MLAAttentionMetadata:
    """Batch layout of one forward pass over the latent cache.

    :ivar slot_mapping: ``[T]`` int64 cache slot of each token (``-1``: padding, not written).
    :ivar block_tables: ``[S, max_blocks]`` int32 block ids per sequence.
    :ivar seq_lens: ``[S]`` int32 tokens per sequence after this step (cached + new).
    :ivar query_start_loc: ``[S + 1]`` int32 offsets of each sequence's new tokens.
    """

    slot_mapping: Tensor
    block_tables: Tensor
    seq_lens: Tensor
    query_start_loc: Tensor


def _first(out: Any) -> Tensor:
    """vLLM's linear layers return ``(output, bias)``; plain modules return the output."""
    result: Tensor = out[0] if isinstance(out, tuple) else out
    return result


@CustomOp.register("multi_head_latent_attention")
class MultiHeadLatentAttentionWrapper(_OpLayer):
    """Multi-head latent attention with its projections (vLLM 0.32's outer MLA layer).

    ``forward(positions, hidden_states, llama_4_scaling=None, attn_metadata=None)`` returns
    ``o_proj``'s output ``[T, hidden_size]``. See the module docstring for the cache and the
    metadata.
    """

    def __init__(self, hidden_size: int, num_heads: int, scale: float, qk_nope_head_dim: int,
                 qk_rope_head_dim: int, v_head_dim: int, q_lora_rank: int | None,
                 kv_lora_rank: int, mla_modules: MLAModules, cache_config: Any = None,
                 quant_config: Any = None, prefix: str = "", skip_topk: bool = False,
                 non_causal_multi_token_decode: bool = False,
                 allow_short_prefill_indexer_scoring_skip: bool = False,
                 fuse_qkv_rmsnorm: bool = False) -> None:
        super().__init__()
        if mla_modules.is_sparse or mla_modules.indexer is not None:
            raise NotImplementedError("MultiHeadLatentAttentionWrapper: sparse MLA (an "
                                      "indexer) is not supported by opmux")
        if fuse_qkv_rmsnorm or non_causal_multi_token_decode:
            raise NotImplementedError("MultiHeadLatentAttentionWrapper: fuse_qkv_rmsnorm and "
                                      "non_causal_multi_token_decode are not supported")
        if q_lora_rank is not None and (mla_modules.fused_qkv_a_proj is None
                                        or mla_modules.q_a_layernorm is None
                                        or mla_modules.q_b_proj is None):
            raise ValueError("q_lora_rank is set: fused_qkv_a_proj, q_a_layernorm and q_b_proj "
                             "are required")
        if q_lora_rank is None and (mla_modules.kv_a_proj_with_mqa is None
                                    or mla_modules.q_proj is None):
            raise ValueError("q_lora_rank is None: kv_a_proj_with_mqa and q_proj are required")
        self.hidden_size = hidden_size
        self.qk_nope_head_dim = qk_nope_head_dim
        self.qk_rope_head_dim = qk_rope_head_dim
        self.qk_head_dim = qk_nope_head_dim + qk_rope_head_dim
        self.v_head_dim = v_head_dim
        self.q_lora_rank = q_lora_rank
        self.kv_lora_rank = kv_lora_rank
        self.num_heads = num_heads
        self.scale = scale
        self.fused_qkv_a_proj = mla_modules.fused_qkv_a_proj
        self.kv_a_proj_with_mqa = mla_modules.kv_a_proj_with_mqa
        self.q_a_layernorm = mla_modules.q_a_layernorm
        self.q_b_proj = mla_modules.q_b_proj
        self.q_proj = mla_modules.q_proj
        self.kv_a_layernorm = mla_modules.kv_a_layernorm
        self.kv_b_proj = mla_modules.kv_b_proj
        self.rotary_emb = mla_modules.rotary_emb
        self.o_proj = mla_modules.o_proj
        self.g_proj = mla_modules.g_proj
        self.skip_topk = skip_topk
        self.prefix = prefix
        #: the paged latent cache, bound by the engine (``None`` until then)
        self.kv_cache: Tensor | None = None

    # ------------------------------------------------------------------ shared preprocessing
    def _project(self, positions: Tensor, hidden_states: Tensor,
                 llama_4_scaling: Tensor | None) -> tuple[Tensor, Tensor, Tensor]:
        """``(q [T, H, qk_head_dim], kv_c_normed [T, L], k_pe [T, R])`` as vLLM computes
        them before its attention call."""
        if self.q_lora_rank is not None:
            assert self.fused_qkv_a_proj is not None and self.q_a_layernorm is not None
            q_c, kv_lora = _first(self.fused_qkv_a_proj(hidden_states)).split(
                [self.q_lora_rank, self.kv_lora_rank + self.qk_rope_head_dim], dim=-1)
            q_in = self.q_a_layernorm(q_c)
            q_layer = self.q_b_proj
        else:
            assert self.kv_a_proj_with_mqa is not None
            kv_lora = _first(self.kv_a_proj_with_mqa(hidden_states))
            q_in = hidden_states
            q_layer = self.q_proj
        assert q_layer is not None
        kv_c, k_pe = kv_lora.split([self.kv_lora_rank, self.qk_rope_head_dim], dim=-1)
        kv_c_normed = self.kv_a_layernorm(kv_c)
        k_pe = k_pe.unsqueeze(1)
        q = _first(q_layer(q_in)).view(-1, self.num_heads, self.qk_head_dim)
        if self.rotary_emb is not None:
            q[..., self.qk_nope_head_dim:], k_pe = self.rotary_emb(
                positions, q[..., self.qk_nope_head_dim:], k_pe)
        if llama_4_scaling is not None:
            q = q * llama_4_scaling
        return q, kv_c_normed, k_pe.reshape(-1, self.qk_rope_head_dim)

    def _cache_and_metadata(self, attn_metadata: MLAAttentionMetadata | None
                            ) -> tuple[Tensor, MLAAttentionMetadata]:
        if attn_metadata is None:
            from opmux.core.errors import OpmuxError
            from opmux.core.forward_context import get_forward_context

            try:
                found = get_forward_context().metadata
            except OpmuxError:   # no context is active
                found = None
            if isinstance(found, Mapping):
                found = found.get(self.prefix)
            if not isinstance(found, MLAAttentionMetadata):
                raise ValueError(f"MultiHeadLatentAttentionWrapper {self.prefix!r}: no "
                                 "MLAAttentionMetadata given (attn_metadata=) nor in the "
                                 f"forward context (found {type(found).__name__})")
            attn_metadata = found
        if self.kv_cache is None:
            raise ValueError(f"MultiHeadLatentAttentionWrapper {self.prefix!r}: kv_cache is "
                             "not bound; set layer.kv_cache to a [num_blocks, block_size, "
                             f"{self.kv_lora_rank + self.qk_rope_head_dim}] tensor")
        return self.kv_cache, attn_metadata

    def _output(self, attn_out: Tensor, hidden_states: Tensor) -> Tensor:
        attn_out = attn_out.reshape(hidden_states.shape[0], self.num_heads * self.v_head_dim)
        if self.g_proj is not None:
            attn_out = attn_out * _first(self.g_proj(hidden_states)).sigmoid()
        return _first(self.o_proj(attn_out))

    # ------------------------------------------------------------------------------ forwards
    def forward_native(self, positions: Tensor, hidden_states: Tensor,
                       llama_4_scaling: Tensor | None = None,
                       attn_metadata: MLAAttentionMetadata | None = None) -> Tensor:
        cache, md = self._cache_and_metadata(attn_metadata)
        q, kv_c, k_pe = self._project(positions, hidden_states, llama_4_scaling)
        ops.concat_and_cache_mla.native(kv_c, k_pe, cache, md.slot_mapping)
        out = ops.mla_attention.native(q, cache, self.kv_b_proj.weight, md.block_tables,
                                       md.seq_lens, md.query_start_loc, self.scale,
                                       self.qk_nope_head_dim)
        return self._output(out, hidden_states)

    def forward_op(self, positions: Tensor, hidden_states: Tensor,
                   llama_4_scaling: Tensor | None = None,
                   attn_metadata: MLAAttentionMetadata | None = None) -> Tensor:
        """The platform path: ``opmux::concat_and_cache_mla`` then ``opmux::mla_attention``."""
        cache, md = self._cache_and_metadata(attn_metadata)
        q, kv_c, k_pe = self._project(positions, hidden_states, llama_4_scaling)
        ops.concat_and_cache_mla(kv_c, k_pe, cache, md.slot_mapping)
        out = ops.mla_attention(q, cache, self.kv_b_proj.weight, md.block_tables, md.seq_lens,
                                md.query_start_loc, self.scale, self.qk_nope_head_dim)
        return self._output(out, hidden_states)

    def extra_repr(self) -> str:
        return (f"num_heads={self.num_heads}, qk_nope_head_dim={self.qk_nope_head_dim}, "
                f"qk_rope_head_dim={self.qk_rope_head_dim}, v_head_dim={self.v_head_dim}, "
                f"q_lora_rank={self.q_lora_rank}, kv_lora_rank={self.kv_lora_rank}")
