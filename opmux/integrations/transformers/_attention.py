"""The ``opmux`` attention, mask and experts functions transformers dispatches to by name.

``attention_forward`` is registered in transformers' ``AttentionInterface`` under
:data:`~opmux.integrations.transformers.ATTN_IMPLEMENTATION` and under the continuous-batching
name :data:`~opmux.integrations.transformers.PAGED_ATTN_IMPLEMENTATION`; ``mask_interface`` in
``AttentionMaskInterface`` under the first; ``experts_forward`` in ``ExpertsInterface``.

The attention runs ``opmux.ops.paged_attention`` (and, on continuous batching's paged cache,
``opmux.ops.reshape_and_cache``). Its causal rule (query row ``j`` of a sequence with
``q_len`` queries and ``kv_len`` keys sees keys ``t <= kv_len - q_len + j``, within the window)
is exactly the mask transformers builds for an unpadded sequence whose keys are the last
``kv_len`` tokens, which is what ``DynamicCache`` (sliding layers included) hands the attention.
The mask function returns ``None`` only in that case; any other mask (padding, packed
sequences, a static cache, custom overlays, bidirectional attention) is built by the model's
fallback implementation and the attention then runs that implementation.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor
from transformers.generation.continuous_batching.cache import PagedAttentionCache
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, causal_mask_function
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

import opmux.ops as ops
from opmux.core.errors import OpmuxError

__all__ = ["attention_forward", "experts_forward", "forget_config", "mask_interface",
           "paged_attention_forward", "remember_config"]

#: id(config) -> (weak reference to it, the implementation its fallbacks use)
_CONFIGS: dict[int, tuple[weakref.ref[Any], str]] = {}
#: id(experts module class) -> the experts implementation it falls back to, per config
_EXPERTS_FALLBACK: dict[int, tuple[weakref.ref[Any], str]] = {}
#: attention module class -> the modeling module's own eager attention function
EAGER_FUNCTIONS: dict[type, Callable[..., Any]] = {}


def remember_config(config: Any, attn_fallback: str, experts_fallback: str | None) -> None:
    """Mark ``config`` as enabled: its masks may be skipped and its fallbacks use these."""
    ref = weakref.ref(config)
    _CONFIGS[id(config)] = (ref, attn_fallback)
    if experts_fallback is not None:
        _EXPERTS_FALLBACK[id(config)] = (ref, experts_fallback)


def forget_config(config: Any) -> None:
    """Undo :func:`remember_config`."""
    _CONFIGS.pop(id(config), None)
    _EXPERTS_FALLBACK.pop(id(config), None)


def _lookup(table: dict[int, tuple[weakref.ref[Any], str]], config: Any) -> str | None:
    entry = table.get(id(config))
    if entry is None or entry[0]() is not config:
        return None
    return entry[1]


# ------------------------------------------------------------------------------------ masks
def _is_plain(q_length: int, kv_length: int, q_offset: Any, kv_offset: Any,
              mask_function: Any, attention_mask: Tensor | None, local_size: int | None,
              config: Any) -> bool:
    """Whether the mask is exactly paged_attention's causal (windowed) rule."""
    if mask_function is not causal_mask_function and not (
            local_size is not None and local_size == getattr(config, "sliding_window", None)):
        return False
    if not isinstance(q_offset, int) or not isinstance(kv_offset, int):
        return False  # a static cache's tensor offsets: its keys include empty slots
    if q_offset + q_length != kv_offset + kv_length or torch.compiler.is_compiling():
        return False
    if attention_mask is None:
        return True
    if attention_mask.shape[-1] < kv_offset + kv_length:
        return False  # transformers pads it with "masked"
    return bool(attention_mask.all())


def mask_interface(batch_size: int, q_length: int, kv_length: int, q_offset: Any = 0,
                  kv_offset: Any = 0, mask_function: Callable[..., Any] = causal_mask_function,
                  attention_mask: Tensor | None = None, local_size: int | None = None,
                  allow_is_causal_skip: bool = True, config: Any = None,
                  **kwargs: Any) -> Tensor | None:
    """``None`` when :func:`attention_forward` can run the causal rule itself, else the
    mask of the model's fallback implementation (``sdpa``'s or ``eager``'s)."""
    fallback = _lookup(_CONFIGS, config)
    if fallback is None:  # a model opmux did not enable: behave as sdpa
        fallback = "sdpa"
    elif allow_is_causal_skip and _is_plain(q_length, kv_length, q_offset, kv_offset,
                                            mask_function, attention_mask, local_size, config):
        return None
    else:
        allow_is_causal_skip = False  # None would mean "causal" to attention_forward
    build = ALL_MASK_ATTENTION_FUNCTIONS[fallback]
    return build(batch_size=batch_size, q_length=q_length, kv_length=kv_length,  # type: ignore[no-any-return]
                 q_offset=q_offset, kv_offset=kv_offset, mask_function=mask_function,
                 attention_mask=attention_mask, local_size=local_size,
                 allow_is_causal_skip=allow_is_causal_skip, config=config, **kwargs)


# -------------------------------------------------------------------------------- attention
def _fallback(module: Any, name: str, query: Tensor, key: Tensor, value: Tensor,
              attention_mask: Tensor | None, scaling: float | None, dropout: float,
              sliding_window: int | None, softcap: float | None, plain: bool,
              **kwargs: Any) -> tuple[Tensor, Tensor | None]:
    """Run the model's fallback implementation ``name``. ``plain``: ``attention_mask`` is
    None because the mask function found the causal rule, which that implementation must
    now be given as a real mask (sdpa's ``None`` means upper-left causal)."""
    eager = EAGER_FUNCTIONS.get(type(module))
    if eager is None:
        eager = ALL_ATTENTION_FUNCTIONS["sdpa"]
    if plain and attention_mask is None:
        q_len, kv_len = query.shape[2], key.shape[2]
        attention_mask = ALL_MASK_ATTENTION_FUNCTIONS[name](
            batch_size=query.shape[0], q_length=q_len, kv_length=kv_len,
            q_offset=kv_len - q_len, kv_offset=0, mask_function=_causal(sliding_window),
            attention_mask=None, local_size=sliding_window, allow_is_causal_skip=True,
            dtype=query.dtype, config=module.config, device=query.device)
    extra: dict[str, Any] = {} if sliding_window is None else {"sliding_window": sliding_window}
    if softcap is not None:
        extra["softcap"] = softcap
    fn = ALL_ATTENTION_FUNCTIONS.get_interface(name, eager)
    return fn(module, query, key, value, attention_mask, scaling=scaling,  # type: ignore[no-any-return]
              dropout=dropout, **extra, **kwargs)


def _causal(sliding_window: int | None) -> Callable[..., Any]:
    if sliding_window is None:
        return causal_mask_function
    from transformers.masking_utils import sliding_window_causal_mask_function

    return sliding_window_causal_mask_function(sliding_window)  # type: ignore[no-any-return]


def _opmux_can_run(module: Any, query: Tensor, key: Tensor, value: Tensor, dropout: float,
                   kwargs: dict[str, Any]) -> bool:
    if dropout != 0.0 or kwargs.get("output_attentions") or hasattr(module, "sinks"):
        return False
    if not kwargs.get("is_causal", getattr(module, "is_causal", True)):
        return False
    if torch.is_grad_enabled() and (query.requires_grad or key.requires_grad
                                    or value.requires_grad):
        return False  # the ops have no backward: training stays on transformers' code
    q, k = query.shape, key.shape
    return (len(q) == 4 and len(k) == 4 and k == value.shape and key.dtype == query.dtype
            and value.dtype == query.dtype and q[0] == k[0] and q[3] == k[3]
            and q[1] % k[1] == 0 and k[2] >= q[2] > 0)


def attention_forward(module: Any, query: Tensor, key: Tensor, value: Tensor,
                      attention_mask: Tensor | None, scaling: float | None = None,
                      dropout: float = 0.0, sliding_window: int | None = None,
                      softcap: float | None = None, **kwargs: Any
                      ) -> tuple[Tensor, Tensor | None]:
    """transformers' attention signature on ``opmux.ops.paged_attention``.

    ``query [B, H, Sq, D]``, ``key``/``value [B, Hkv, Skv, D]`` (the cache's whole content);
    returns ``([B, Sq, H, D], None)``. Anything the op does not express runs the fallback.
    """
    cache = kwargs.get("cache")
    if isinstance(cache, PagedAttentionCache):
        return paged_attention_forward(module, query, key, value, attention_mask, scaling,
                                       dropout, sliding_window, softcap, **kwargs)
    fallback = _lookup(_CONFIGS, getattr(module, "config", None))
    if (fallback is None or attention_mask is not None
            or not _opmux_can_run(module, query, key, value, dropout, kwargs)):
        name = fallback or "sdpa"
        return _fallback(module, name, query, key, value, attention_mask, scaling, dropout,
                         sliding_window, softcap, fallback is not None, **kwargs)
    if scaling is None:
        scaling = module.head_dim ** -0.5
    return _dense_attention(query, key, value, float(scaling), sliding_window, softcap), None


_META: dict[tuple[int, int, int, torch.device], tuple[Tensor, Tensor, Tensor]] = {}


def _meta(seqs: int, q_len: int, kv_len: int,
          device: torch.device) -> tuple[Tensor, Tensor, Tensor]:
    """Block tables (sequence ``i`` owns block ``i``), seq_lens and query_start_loc for
    ``seqs`` equal sequences; memoised (every layer of a step asks the same)."""
    key = (seqs, q_len, kv_len, device)
    meta = _META.get(key)
    if meta is None:
        if len(_META) > 64:
            _META.clear()
        i32 = torch.int32
        meta = (torch.arange(seqs, dtype=i32, device=device).view(-1, 1),
                torch.full((seqs,), kv_len, dtype=i32, device=device),
                torch.arange(0, seqs * q_len + 1, q_len, dtype=i32, device=device))
        _META[key] = meta
    return meta


def _dense_attention(query: Tensor, key: Tensor, value: Tensor, scale: float,
                     sliding_window: int | None, softcap: float | None) -> Tensor:
    """Attention over ``key``/``value [B, Hkv, Skv, D]`` as a paged cache with no copy.

    A cache tensor whose heads hold their tokens densely (``DynamicCache``'s
    ``[B, Hkv, Skv, D]``) becomes ``B * Hkv`` one-head blocks of ``Skv`` tokens; keys laid
    out ``[B, Skv, Hkv, D]`` (a forward without cache) become ``B`` blocks of ``Skv`` tokens.
    Few tensor views on purpose: each costs more than the arithmetic of a small decode step.
    """
    batch, heads, q_len, dim = query.shape
    _, kv_heads, kv_len, _ = key.shape
    group = heads // kv_heads
    k_stride = key.stride()
    if k_stride[3] == 1 and k_stride[2] == kv_heads * dim and k_stride[1] == dim \
            and value.stride() == k_stride:
        rows = query.transpose(1, 2).reshape(batch * q_len, heads, dim)
        tables, lens, starts = _meta(batch, q_len, kv_len, query.device)
        out = ops.paged_attention.eager(rows, key.transpose(1, 2), value.transpose(1, 2),
                                        tables, lens, starts, scale, sliding_window, softcap)
        return out.view(batch, q_len, heads, dim)  # type: ignore[no-any-return]
    key_blocks = _head_blocks(key)
    value_blocks = _head_blocks(value)
    if key_blocks.stride() != value_blocks.stride():
        key_blocks, value_blocks = key_blocks.contiguous(), value_blocks.contiguous()
    tables, lens, starts = _meta(batch * kv_heads, q_len, kv_len, query.device)
    if q_len == 1:  # decode: [B, H, 1, D] rows are (b, kv head) sequences of one query
        out = ops.paged_attention.eager(query.reshape(batch * kv_heads, group, dim),
                                        key_blocks, value_blocks, tables, lens, starts, scale,
                                        sliding_window, softcap)
        return out.view(batch, 1, heads, dim)  # type: ignore[no-any-return]
    rows = (query.view(batch, kv_heads, group, q_len, dim).transpose(2, 3)
            .reshape(batch * kv_heads * q_len, group, dim))
    out = ops.paged_attention.eager(rows, key_blocks, value_blocks, tables, lens, starts,
                                    scale, sliding_window, softcap)
    return (out.view(batch, kv_heads, q_len, group, dim).transpose(1, 2)  # type: ignore[no-any-return]
            .reshape(batch, q_len, heads, dim))


def _head_blocks(states: Tensor) -> Tensor:
    """``[B, Hkv, S, D]`` as ``[B * Hkv, S, 1, D]`` one-head blocks (a view when the tokens of
    each head are dense and the heads evenly spaced, else a copy)."""
    batch, kv_heads, length, dim = states.shape
    stride = states.stride()
    if not (stride[3] == 1 and stride[2] == dim
            and (batch == 1 or stride[0] == kv_heads * stride[1])):
        states = states.contiguous()
        stride = states.stride()
    return states.as_strided((batch * kv_heads, length, 1, dim), (stride[1], dim, dim, 1),
                             states.storage_offset())


# ----------------------------------------------------------------- continuous batching
def paged_attention_forward(module: Any, query: Tensor, key: Tensor, value: Tensor,
                            attention_mask: Any, scaling: float | None = None,
                            dropout: float = 0.0, sliding_window: int | None = None,
                            softcap: float | None = None, **kwargs: Any
                            ) -> tuple[Tensor, Tensor | None]:
    """Continuous batching's attention (``generate_batch``) on transformers' paged cache.

    Full-attention layers: the new keys and values go into the cache's pages with
    ``opmux.ops.reshape_and_cache`` and ``opmux.ops.paged_attention`` reads the pages in
    place through block tables taken from the batch's read indices. Sliding-window layers
    keep a ring buffer whose pages are not in token order: transformers' own update gathers
    their window, which ``paged_attention`` reads as one-token blocks.
    """
    cache = kwargs.pop("cache", None)
    if not isinstance(cache, PagedAttentionCache):
        raise _PagedMisuseError(
            f"attention implementation {module.config._attn_implementation!r} serves "
            "continuous batching (generate_batch) only; set 'opmux' for other forwards "
            "(opmux.integrations.transformers.enable(model) does)")
    if not _opmux_can_run(module, query, key, value, dropout, {}) or query.shape[0] != 1:
        raise _PagedMisuseError(
            "continuous batching with opmux attention needs inference mode (no grad, no "
            "dropout) and packed [1, H, T, D] queries; call disable(model) to use "
            "transformers' own attention")
    if scaling is None:
        scaling = module.head_dim ** -0.5
    allocator = cache.layer_to_allocator[module.layer_idx]
    rows = query[0].transpose(0, 1)                      # [T, H, D]
    starts = kwargs["cu_seq_lens_q"]
    if allocator.supports_block_table:
        k_pages, v_pages = allocator.get_cache_for_block_table(module.layer_idx)
        write = kwargs["write_index"][allocator.index]
        ops.reshape_and_cache.eager(key[0].transpose(0, 1), value[0].transpose(0, 1),
                                    k_pages, v_pages, write)
        read = kwargs["read_index"][allocator.index]
        cu_k = kwargs["cu_seq_lens_k"][allocator.layer_type]
        tables, lens = _page_tables(read if read.numel() else write, cu_k,
                                    allocator.tokens_per_page)
        out = ops.paged_attention.eager(rows, k_pages, v_pages, tables, lens, starts,
                                        float(scaling), sliding_window, softcap)
    else:
        key, value = cache.update(key_states=key, value_states=value,
                                  layer_idx=module.layer_idx, kwargs=kwargs)
        keys = key[0].transpose(0, 1).contiguous().unsqueeze(1)      # [K, 1, Hkv, D]
        values = value[0].transpose(0, 1).contiguous().unsqueeze(1)
        tables, lens = _token_tables(kwargs["cu_seq_lens_k"])
        out = ops.paged_attention.eager(rows, keys, values, tables, lens, starts,
                                        float(scaling), sliding_window, softcap)
    return out.unsqueeze(0), None


class _PagedMisuseError(OpmuxError, RuntimeError):
    __module__ = "opmux.integrations.transformers"


#: (tokens tensor, cu tensor, page size) -> (block tables, seq_lens) of the last batch
_PAGE_MEMO: list[tuple[Tensor, Tensor, int, Tensor, Tensor]] = []


def _page_tables(tokens: Tensor, cu_k: Tensor, page: int) -> tuple[Tensor, Tensor]:
    """Block tables in page units from the physical token indices of each sequence
    (``tokens[cu_k[i]:cu_k[i+1]]``, token ``t`` of a sequence in its ``t // page``-th page)."""
    for memo in _PAGE_MEMO:
        if memo[0] is tokens and memo[1] is cu_k and memo[2] == page:
            return memo[3], memo[4]
    lens = (cu_k[1:] - cu_k[:-1]).to(torch.int32)
    blocks = (lens.long() + page - 1) // page
    width = max(int(blocks.max()), 1) if blocks.numel() else 1
    column = torch.arange(width, device=tokens.device)
    first = cu_k[:-1].long().unsqueeze(1) + column * page
    used = column < blocks.unsqueeze(1)
    picked = tokens[first.clamp(max=max(tokens.numel() - 1, 0))] if tokens.numel() \
        else torch.zeros_like(first)
    tables = torch.where(used, picked // page, 0).to(torch.int32).contiguous()
    if len(_PAGE_MEMO) >= 2:
        _PAGE_MEMO.pop(0)
    _PAGE_MEMO.append((tokens, cu_k, page, tables, lens))
    return tables, lens


def _token_tables(cu_k: Tensor) -> tuple[Tensor, Tensor]:
    """One-token blocks: sequence ``i``'s keys are rows ``cu_k[i]:cu_k[i+1]`` of the gather."""
    lens = (cu_k[1:] - cu_k[:-1]).to(torch.int32)
    width = max(int(lens.max()), 1) if lens.numel() else 1
    column = torch.arange(width, device=cu_k.device)
    rows = cu_k[:-1].long().unsqueeze(1) + column
    tables = torch.where(column < lens.unsqueeze(1), rows, 0).to(torch.int32).contiguous()
    return tables, lens


# ---------------------------------------------------------------------------------- experts
def experts_forward(module: Any, hidden_states: Tensor, top_k_index: Tensor,
                    top_k_weights: Tensor) -> Tensor:
    """A transformers experts module (``gate_up_proj [E, 2I, d]`` gate rows first,
    ``down_proj [E, d, I]``, SiLU) on ``opmux.ops.fused_moe``; other layouts fall back."""
    fallback = _lookup(_EXPERTS_FALLBACK, getattr(module, "config", None))
    w1 = getattr(module, "gate_up_proj", None)
    w2 = getattr(module, "down_proj", None)
    if (fallback is None or not _plain_experts(module) or not isinstance(w1, Tensor)
            or not isinstance(w2, Tensor) or w1.dtype != hidden_states.dtype
            or (torch.is_grad_enabled() and (hidden_states.requires_grad or w1.requires_grad))):
        from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

        original = type(module).forward.__wrapped__
        fn = ALL_EXPERTS_FUNCTIONS.get_interface(fallback or "eager", original)
        return fn(module, hidden_states, top_k_index, top_k_weights)  # type: ignore[no-any-return]
    return ops.fused_moe.eager(hidden_states, w1, w2,  # type: ignore[no-any-return]
                               top_k_weights, top_k_index)


def _plain_experts(module: Any) -> bool:
    from transformers.activations import SiLUActivation

    return (getattr(module, "is_concatenated", False) and getattr(module, "has_gate", False)
            and not getattr(module, "has_bias", True) and not getattr(module, "is_transposed", True)
            and not getattr(module, "has_post_expert_norm", True)
            and type(module.act_fn) in (SiLUActivation, torch.nn.SiLU))
