"""vLLM's CPU attention backend on opmux: cache layout, KV write and paged attention.

:func:`install` points ``AttentionBackendEnum.CPU_ATTN`` at :class:`OpmuxCPUAttentionBackend`
through vLLM's backend registry. The backend subclasses vLLM's ``CPUAttentionBackend`` (so
vLLM's selection, block sizes, head sizes and dtypes stay as they are) and owns what is
inside a cache block: vLLM allocates each layer's cache as ``[blocks, Hkv, block_size,
2 * D]`` and only ever touches whole blocks (it zeroes freshly allocated ones); opmux lays a
block out as ``[2, block_size, Hkv, D]`` -- the keys of the block's tokens, then their values
-- so the key and value caches of the catalog (``[blocks, block_size, Hkv, D]``, heads
contiguous) are two views with a block stride of ``2 * block_size * Hkv * D``. When the
winning ``paged_attention`` provider prefers the head-major ``hnd`` format
(:func:`opmux.kv_cache_format`), a block is laid out as ``[2, Hkv, block_size, D]`` instead
and both ops get ``kv_cache_format="hnd"``. Other formats (tile-packed ones) are not views of
a dense block of vLLM's allocation in either order, so the backend keeps ``canonical`` for
them (the provider's ``supports_args`` declines, or it reads canonical too). The KV write
is ``opmux::reshape_and_cache`` and attention ``opmux::paged_attention`` (ragged prefill +
decode, GQA, sliding window, soft cap), so the winning provider of each runs. Both are
called through :attr:`opmux.Op.eager`: the forward runs outside vLLM's compiled graph (inside
its attention op), where the torch dispatcher's trip would only box the arguments twice.

Refused when the engine builds the layer (:class:`OpmuxAttentionUnsupported`), never run
wrongly: attention types other than decoder self-attention, ALiBi, attention sinks, a
quantized (fp8) KV cache. A non-causal batch is refused when its metadata is built.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor
from vllm.v1.attention.backend import AttentionType, CommonAttentionMetadata
from vllm.v1.attention.backends.cpu_attn import (
    CPUAttentionBackend,
    CPUAttentionBackendImpl,
    CPUAttentionMetadataBuilder,
)

from opmux.core.errors import OpmuxError
from opmux.ops.attention import paged_attention
from opmux.ops.cache import reshape_and_cache
from opmux.ops.kv_formats import kv_cache_format

__all__ = ["OpmuxAttentionUnsupported", "OpmuxCPUAttentionBackend", "OpmuxCPUAttentionImpl",
           "OpmuxCPUAttentionMetadata", "OpmuxCPUAttentionMetadataBuilder", "install",
           "split_kv_cache", "vllm_kv_cache_format", "VLLM_FORMATS"]


class OpmuxAttentionUnsupported(OpmuxError, NotImplementedError):
    """A layer asks the opmux CPU attention backend for a feature it does not implement."""


def _refuse(feature: str, fix: str) -> OpmuxAttentionUnsupported:
    return OpmuxAttentionUnsupported(
        f"opmux attention backend (vLLM CPU_ATTN replaced by opmux.integrations.vllm): "
        f"{feature} is not supported; {fix}, or run without the replacement "
        f"(OPMUX_VLLM_LAYERS without 'attention', or OPMUX_VLLM=0)")


VLLM_FORMATS: tuple[str, ...] = ("canonical", "hnd")
"""KV-cache formats the backend lays inside vLLM's ``[blocks, Hkv, block_size, 2 * D]``
allocation (as views of each dense block)."""


def split_kv_cache(kv_cache: Tensor, kv_cache_format: str = "canonical"
                   ) -> tuple[Tensor, Tensor]:
    """The ``(key_cache, value_cache)`` of a vLLM CPU layer cache ``[blocks, Hkv, block_size,
    2 * D]`` in opmux's block layout: ``[blocks, block_size, Hkv, D]`` views (``canonical``),
    or ``[blocks, Hkv, block_size, D]`` views (``hnd``).

    :raises OpmuxAttentionUnsupported: a cache whose blocks are not each one dense run of
        memory (the layout vLLM's CPU backend asks for always is), or a format other than
        :data:`VLLM_FORMATS`.
    """
    blocks, heads, block_size, width = kv_cache.shape
    try:
        per_block = kv_cache.view(blocks, heads * block_size * width)
    except RuntimeError:
        raise _refuse(f"a KV cache whose blocks are not dense (shape {tuple(kv_cache.shape)}, "
                      f"strides {kv_cache.stride()})",
                      "use the default KV cache layout (unset VLLM_KV_CACHE_LAYOUT)") from None
    if kv_cache_format == "hnd":
        kv = per_block.view(blocks, 2, heads, block_size, width // 2)
    elif kv_cache_format == "canonical":
        kv = per_block.view(blocks, 2, block_size, heads, width // 2)
    else:
        raise _refuse(f"KV-cache format {kv_cache_format!r} inside vLLM's allocation",
                      f"use one of {', '.join(VLLM_FORMATS)}")
    return kv[:, 0], kv[:, 1]


def vllm_kv_cache_format(kv_cache: Tensor) -> str:
    """The format the backend uses for ``kv_cache``: :func:`opmux.kv_cache_format`'s answer
    when it is one of :data:`VLLM_FORMATS`, else ``canonical``."""
    _, heads, block_size, width = kv_cache.shape
    name = kv_cache_format(kv_cache.device, kv_cache.dtype, width // 2, heads,
                           block_size).name
    return name if name in VLLM_FORMATS else "canonical"


@dataclass
class OpmuxCPUAttentionMetadata:
    """The batch layout of one step, as ``opmux::paged_attention`` reads it (int32 tables)."""

    num_actual_tokens: int
    max_query_len: int
    query_start_loc: Tensor
    max_seq_len: int
    seq_lens: Tensor
    block_table: Tensor
    slot_mapping: Tensor
    causal: bool = True


class OpmuxCPUAttentionMetadataBuilder(CPUAttentionMetadataBuilder):  # type: ignore[misc]
    """vLLM's CPU builder without its kernel's scheduler metadata (opmux schedules itself)."""

    def build(self, common_prefix_len: int, common_attn_metadata: CommonAttentionMetadata,
              fast_build: bool = False) -> OpmuxCPUAttentionMetadata:  # type: ignore[override]
        causal = common_attn_metadata.causal
        if self.is_cross_attention or isinstance(causal, Tensor) or not causal:
            raise _refuse("non-causal or cross attention batches",
                          "use a decoder-only model")
        return OpmuxCPUAttentionMetadata(
            num_actual_tokens=common_attn_metadata.num_actual_tokens,
            max_query_len=common_attn_metadata.max_query_len,
            query_start_loc=_int32(common_attn_metadata.query_start_loc),
            max_seq_len=common_attn_metadata.max_seq_len,
            seq_lens=_int32(common_attn_metadata.seq_lens),
            block_table=_int32(common_attn_metadata.block_table_tensor),
            slot_mapping=common_attn_metadata.slot_mapping,
        )


def _int32(t: Tensor) -> Tensor:
    if t.dtype != torch.int32:
        t = t.to(torch.int32)
    return t if t.is_contiguous() else t.contiguous()


class OpmuxCPUAttentionImpl(CPUAttentionBackendImpl):  # type: ignore[misc]
    """Decoder self-attention over opmux's cache layout (see the module docstring)."""

    def __init__(self, num_heads: int, head_size: int, scale: float, num_kv_heads: int,
                 alibi_slopes: list[float] | None, sliding_window: int | None,
                 kv_cache_dtype: str, logits_soft_cap: float | None = None,
                 attn_type: str = AttentionType.DECODER,
                 kv_sharing_target_layer_name: str | None = None,
                 sinks: Tensor | None = None) -> None:
        if attn_type != AttentionType.DECODER:
            raise _refuse(f"attention type {attn_type!r} (only 'decoder')",
                          "use a decoder-only model")
        if alibi_slopes is not None:
            raise _refuse("ALiBi slopes", "use a model with rotary or no position bias")
        if sinks is not None:
            raise _refuse("attention sinks", "use a model without sinks")
        if kv_cache_dtype not in ("auto", "float32", "float16", "bfloat16"):
            raise _refuse(f"kv_cache_dtype={kv_cache_dtype!r} (only the model's dtype)",
                          "leave kv_cache_dtype at 'auto'")
        super().__init__(num_heads, head_size, scale, num_kv_heads, alibi_slopes,
                         sliding_window, kv_cache_dtype, logits_soft_cap, attn_type,
                         kv_sharing_target_layer_name, sinks)
        #: the catalog's arguments: None for "no window" / "no cap"
        self.opmux_window: int | None = sliding_window if sliding_window else None
        self.opmux_soft_cap: float | None = float(logits_soft_cap) if logits_soft_cap else None
        self._views: tuple[Tensor, Tensor, Tensor, str] | None = None

    def _caches(self, kv_cache: Tensor) -> tuple[Tensor, Tensor, str]:
        views = self._views
        if views is None or views[0] is not kv_cache:
            fmt = vllm_kv_cache_format(kv_cache)
            key_cache, value_cache = split_kv_cache(kv_cache, fmt)
            views = self._views = (kv_cache, key_cache, value_cache, fmt)
        return views[1], views[2], views[3]

    def forward(self, layer: Any, query: Tensor, key: Tensor, value: Tensor, kv_cache: Tensor,
                attn_metadata: Any, output: Tensor, output_scale: Tensor | None = None,
                output_block_scale: Tensor | None = None) -> Tensor:
        if output_scale is not None or output_block_scale is not None:
            raise _refuse("fused output quantization", "disable the quantization fusion pass")
        if attn_metadata is None:  # profiling / warm-up run
            return output
        n = attn_metadata.num_actual_tokens
        key_cache, value_cache, fmt = self._caches(kv_cache)
        out = paged_attention.eager(_rows(query, n), key_cache, value_cache,
                                    attn_metadata.block_table, attn_metadata.seq_lens,
                                    attn_metadata.query_start_loc, self.scale, self.opmux_window,
                                    self.opmux_soft_cap, fmt)
        dst = _rows(output, n)
        dst.copy_(out.view(dst.shape))
        return output

    def do_kv_cache_update(self, layer: torch.nn.Module, key: Tensor, value: Tensor,
                           kv_cache: Tensor, slot_mapping: Tensor) -> None:
        key_cache, value_cache, fmt = self._caches(kv_cache)
        n = slot_mapping.shape[0]
        reshape_and_cache.eager(_rows(key, n), _rows(value, n), key_cache, value_cache,
                                slot_mapping, fmt)


def _rows(t: Tensor, n: int) -> Tensor:
    """The first ``n`` rows of ``t``: ``t`` itself when it has ``n`` (no view to make: this
    runs twice per layer and step; ``benchmarks/vllm_cpu.py``)."""
    return t if t.shape[0] == n else t.narrow(0, 0, n)


class OpmuxCPUAttentionBackend(CPUAttentionBackend):  # type: ignore[misc]
    """vLLM's ``CPU_ATTN`` backend with opmux's impl and builder (same name, so vLLM's
    selection and configuration apply unchanged)."""

    @staticmethod
    def get_impl_cls() -> type[OpmuxCPUAttentionImpl]:
        return OpmuxCPUAttentionImpl

    @staticmethod
    def get_builder_cls() -> type[OpmuxCPUAttentionMetadataBuilder]:
        return OpmuxCPUAttentionMetadataBuilder


def install() -> bool:
    """Point vLLM's ``CPU_ATTN`` at :class:`OpmuxCPUAttentionBackend` (idempotent).

    :returns: whether opmux's backend is the one registered now (``False`` when another
        plugin replaced ``CPU_ATTN`` first: that one is left in place, with a warning).
    """
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

    path = f"{OpmuxCPUAttentionBackend.__module__}.{OpmuxCPUAttentionBackend.__qualname__}"
    current = AttentionBackendEnum.CPU_ATTN.get_path()
    if current == path:
        return True
    if AttentionBackendEnum.CPU_ATTN.is_overridden():
        logging.getLogger("opmux.integrations.vllm").warning(
            "opmux: vLLM's CPU_ATTN backend is already replaced by %s; leaving it", current)
        return False
    register_backend(AttentionBackendEnum.CPU_ATTN, path)
    return True
