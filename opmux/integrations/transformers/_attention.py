"""The attention and experts functions of an enabled model, and the ones transformers
dispatches to by name.

An enabled model keeps its config's ``attn_implementation`` (``sdpa``, ``eager``, ...): its
attention modules call :func:`module_attention`, which runs ``opmux.ops.paged_attention``
with the mask transformers built for that implementation and otherwise calls the
implementation itself, so every fallback is exactly transformers' code. ``paged_attention``
expresses a mask two ways:

* no mask (``sdpa``'s "causal" ``None``): its own causal rule -- query row ``j`` of a sequence
  with ``q_len`` queries and ``kv_len`` keys sees keys ``t <= kv_len - q_len + j``, within the
  window -- which is transformers' mask of an unpadded sequence whose keys are the last
  ``kv_len`` tokens, what ``DynamicCache`` hands the attention;
* a boolean mask (``sdpa``'s) or an additive one of zeros and the dtype's minimum
  (``eager``'s), such as a padded batch's: every query row becomes a sequence of one query
  whose block table lists the keys it sees, as one-token blocks of the cache (a view).

:func:`attention_forward` is registered in transformers' ``AttentionInterface`` as
:data:`~opmux.integrations.transformers.ATTN_IMPLEMENTATION` (with ``sdpa``'s mask function),
so ``attn_implementation="opmux"`` also works on a model that is not enabled;
:func:`paged_attention_forward` serves continuous batching; :func:`experts_forward` is the
``ExpertsInterface`` entry.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor
from torch._subclasses import FakeTensor
from transformers.generation.continuous_batching.cache import PagedAttentionCache
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, causal_mask_function
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

import opmux.ops as ops
from opmux.core.errors import OpmuxError

__all__ = ["EAGER_FUNCTIONS", "PAGED_NAME", "attention_forward", "experts_forward",
           "fused_moe_applies", "module_attention", "paged_attention_forward", "traced"]

#: attention module class -> the modeling module's own eager attention function
EAGER_FUNCTIONS: dict[type, Callable[..., Any]] = {}
#: the continuous-batching implementation name (set by the package)
PAGED_NAME: list[str] = [""]
#: implementations whose masks opmux reads (None, boolean, or 0 / dtype-minimum additive)
_READABLE = ("sdpa", "eager")


def traced(t: Tensor) -> bool:
    """``t`` carries no data (torch.compile tracing, the meta device, a FakeTensorMode):
    the data-dependent steps of the opmux paths (a mask's content, the rotary table check,
    the memos of index tensors) cannot run, and transformers' code does."""
    return torch.compiler.is_compiling() or t.is_meta or isinstance(t, FakeTensor)


# -------------------------------------------------------------------------------- attention
def attention_forward(module: Any, query: Tensor, key: Tensor, value: Tensor,
                      attention_mask: Tensor | None, scaling: float | None = None,
                      dropout: float = 0.0, sliding_window: int | None = None,
                      softcap: float | None = None, **kwargs: Any
                      ) -> tuple[Tensor, Tensor | None]:
    """transformers' attention signature on ``opmux.ops.paged_attention``, registered as
    ``"opmux"``: the mask is ``sdpa``'s, the fallback ``sdpa`` (``eager`` with a soft cap,
    which ``sdpa`` refuses)."""
    if isinstance(kwargs.get("cache"), PagedAttentionCache):
        return paged_attention_forward(module, query, key, value, attention_mask, scaling,
                                       dropout, sliding_window, softcap, **kwargs)
    out = _opmux_attention("sdpa", module, query, key, value, attention_mask, scaling,
                           dropout, sliding_window, softcap, kwargs)
    if out is not None:
        return out, None
    if softcap is None:
        return ALL_ATTENTION_FUNCTIONS["sdpa"](  # type: ignore[no-any-return]
            module, query, key, value, attention_mask, scaling=scaling, dropout=dropout,
            sliding_window=sliding_window, **kwargs)
    eager = EAGER_FUNCTIONS.get(type(module), ALL_ATTENTION_FUNCTIONS["sdpa"])
    return eager(module, query, key, value,  # type: ignore[no-any-return]
                 _eager_mask(attention_mask, query, key, sliding_window), scaling=scaling,
                 dropout=dropout, sliding_window=sliding_window, softcap=softcap, **kwargs)


def _eager_mask(mask: Tensor | None, query: Tensor, key: Tensor,
                sliding_window: int | None) -> Tensor | None:
    """``sdpa``'s mask as the additive mask ``eager`` takes. ``sdpa``'s ``None`` is its
    ``is_causal``: every key for one query, else causal aligned upper left (its mask function
    returns ``None`` only where that is the causal rule)."""
    if mask is None:
        q_len, kv_len = query.shape[2], key.shape[2]
        if q_len == 1:
            return None
        mask = ALL_MASK_ATTENTION_FUNCTIONS["sdpa"](
            batch_size=query.shape[0], q_length=q_len, kv_length=kv_len,
            q_offset=0, kv_offset=0, mask_function=_causal(sliding_window),
            attention_mask=None, local_size=sliding_window, allow_is_causal_skip=False,
            device=query.device)
    if mask.dtype != torch.bool:
        return mask
    return torch.where(mask, 0.0, torch.finfo(query.dtype).min).to(query.dtype)


def _causal(sliding_window: int | None) -> Callable[..., Any]:
    if sliding_window is None:
        return causal_mask_function
    from transformers.masking_utils import sliding_window_causal_mask_function

    return sliding_window_causal_mask_function(sliding_window)  # type: ignore[no-any-return]


def module_attention(module: Any, query: Tensor, key: Tensor, value: Tensor,
                     attention_mask: Tensor | None, scaling: float | None = None,
                     dropout: float = 0.0, sliding_window: int | None = None,
                     softcap: float | None = None, **kwargs: Any
                     ) -> tuple[Tensor, Tensor | None]:
    """The attention of an enabled model's attention module: opmux's where it expresses the
    call, else the implementation the config names, with the mask built for it."""
    name = _config_value(module.config, "_attn_implementation", "_attn_implementation_internal")
    if name == PAGED_NAME[0]:
        return paged_attention_forward(module, query, key, value, attention_mask, scaling,
                                       dropout, sliding_window, softcap, **kwargs)
    if name in _READABLE:
        out = _opmux_attention(name, module, query, key, value, attention_mask, scaling,
                               dropout, sliding_window, softcap, kwargs)
        if out is not None:
            return out, None
    eager = EAGER_FUNCTIONS.get(type(module), ALL_ATTENTION_FUNCTIONS["sdpa"])
    fn = ALL_ATTENTION_FUNCTIONS.get_interface(name, eager)
    extra: dict[str, Any] = {} if softcap is None else {"softcap": softcap}
    return fn(module, query, key, value, attention_mask,  # type: ignore[no-any-return]
              scaling=scaling, dropout=dropout, sliding_window=sliding_window, **extra,
              **kwargs)


def _opmux_attention(name: str, module: Any, query: Tensor, key: Tensor, value: Tensor,
                     attention_mask: Tensor | None, scaling: float | None, dropout: float,
                     sliding_window: int | None, softcap: float | None,
                     kwargs: dict[str, Any]) -> Tensor | None:
    """``[B, Sq, H, D]`` from ``paged_attention``, or ``None`` when it does not express the
    call (the caller then runs transformers' implementation)."""
    if not _opmux_can_run(module, query, key, value, dropout, kwargs) or traced(query):
        return None
    scale = float(module.head_dim ** -0.5 if scaling is None else scaling)
    if attention_mask is None:
        q_len, kv_len = query.shape[2], key.shape[2]
        if 1 < q_len < kv_len:
            if name == "eager":
                return None  # eager's None: every row sees every key
            # sdpa's None with more keys than queries: its is_causal, aligned upper left
            # (a prefill into an empty static cache): the keys past the queries are unused
            key, value = key[:, :, :q_len], value[:, :, :q_len]
        return _dense_attention(query, key, value, scale, sliding_window, softcap)
    plan = _row_plan(attention_mask, query, key)
    if plan is None:
        return None
    return _masked_attention(plan, query, key, value, scale, softcap)


def _opmux_can_run(module: Any, query: Tensor, key: Tensor, value: Tensor, dropout: float,
                   kwargs: dict[str, Any]) -> bool:
    if dropout != 0.0 or _has_sinks(module) or kwargs.get("output_attentions") \
            or _config_value(getattr(module, "config", None), "output_attentions",
                             "_output_attentions"):
        return False  # (the weights are asked for: the op returns none)
    if not kwargs.get("is_causal", getattr(module, "is_causal", True)):
        return False
    if torch.is_grad_enabled() and (query.requires_grad or key.requires_grad
                                    or value.requires_grad):
        return False  # the ops have no backward: training stays on transformers' code
    q, k = query.shape, key.shape
    return (len(q) == 4 and len(k) == 4 and k == value.shape and key.dtype == query.dtype
            and value.dtype == query.dtype and q[0] == k[0] and q[3] == k[3]
            and q[1] % k[1] == 0 and k[2] >= q[2] > 0)


def _config_value(config: Any, name: str, stored: str) -> Any:
    """``config.<name>`` (``False`` for no config), read from the instance attribute
    ``stored`` that transformers' property returns where it is there: the property behind
    the config's own ``__getattribute__`` costs more than the rest of the attention call's
    checks together (the attention call of ``benchmarks/transformers_cpu.py``'s tiny
    model)."""
    if torch.compiler.is_compiling():
        return getattr(config, name, False)
    try:  # (not through the config's __getattribute__ either)
        own = object.__getattribute__(config, "__dict__")
    except AttributeError:
        return getattr(config, name, False)
    return own[stored] if stored in own else getattr(config, name, False)


def _has_sinks(module: Any) -> bool:
    """The module has attention sinks (``sinks``, a parameter or buffer in transformers'
    models). Read from the module's own dicts: ``hasattr`` on a module without them raises
    inside ``nn.Module.__getattr__``, the larger cost (the attention call of
    ``benchmarks/transformers_cpu.py``'s tiny model)."""
    own = getattr(module, "__dict__", {})
    return "sinks" in own or "sinks" in own.get("_parameters", ()) \
        or "sinks" in own.get("_buffers", ())


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
    """Causal attention over ``key``/``value [B, Hkv, Skv, D]`` as a paged cache, no copy.

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


# ------------------------------------------------------------------------- masked attention
class _RowPlan:
    """``paged_attention``'s inputs for a mask: one sequence of one query per (batch row,
    kv head, query row), its block table the ids of the keys it sees as one-token blocks."""

    __slots__ = ("lens", "live", "mask", "shape", "starts", "strides", "tables")

    def __init__(self, mask: Tensor, shape: tuple[int, ...], strides: tuple[int, ...],
                 tables: Tensor, lens: Tensor, starts: Tensor, live: Tensor | None) -> None:
        self.mask, self.shape, self.strides = mask, shape, strides
        self.tables, self.lens, self.starts = tables, lens, starts
        self.live = live  # [B or 1, Sq, 1, 1]: rows that see a key (None: all do)


#: the plans of the last masks: every layer of a forward gets the same mask object
_PLANS: list[_RowPlan] = []


def _token_strides(key: Tensor) -> tuple[int, ...] | None:
    """``key [B, Hkv, S, D]``'s strides in units of ``D`` (dims of size 1 as 0), when every
    token's ``D`` values are dense and start at a multiple of ``D``."""
    dim = key.shape[3]
    if key.stride(3) != 1 and dim > 1:
        return None
    strides = tuple(0 if n == 1 else s for n, s in zip(key.shape[:3], key.stride()[:3],
                                                         strict=True))
    if any(s % dim for s in strides):
        return None
    return tuple(s // dim for s in strides)


def _visible(mask: Tensor, batch: int, q_len: int, kv_len: int) -> Tensor | None:
    """``[B or 1, Sq, Skv]`` booleans (key seen) of a ``[B or 1, 1, Sq, Skv]`` mask, or None."""
    if mask.dim() != 4 or mask.shape[1] != 1 or mask.shape[0] not in (1, batch) \
            or mask.shape[2] != q_len or mask.shape[3] != kv_len:
        return None
    if mask.dtype == torch.bool:
        return mask[:, 0]
    if not mask.dtype.is_floating_point:
        return None
    seen = mask[:, 0] == 0
    if not bool((seen | (mask[:, 0] == torch.finfo(mask.dtype).min)).all()):
        return None  # another bias than "seen" / "not seen"
    return seen


def _row_plan(mask: Tensor, query: Tensor, key: Tensor) -> _RowPlan | None:
    batch, _, q_len, _ = query.shape
    _, kv_heads, kv_len, _ = key.shape
    strides = _token_strides(key)
    if strides is None:  # _token_blocks copies it: the strides of a contiguous one
        strides = (0 if batch == 1 else kv_heads * kv_len, 0 if kv_heads == 1 else kv_len,
                   0 if kv_len == 1 else 1)
    shape = tuple(key.shape)
    for plan in _PLANS:
        if plan.mask is mask and plan.shape == shape and plan.strides == strides:
            return plan
    seen = _visible(mask, batch, q_len, kv_len)
    if seen is None:
        return None
    counts = seen.sum(-1)                                               # [B or 1, Sq]
    width = max(int(counts.max()), 1)
    order = torch.argsort((~seen).to(torch.uint8), dim=-1, stable=True)[..., :width]
    device = key.device
    base = (torch.arange(batch, device=device) * strides[0]).view(-1, 1, 1, 1) \
        + (torch.arange(kv_heads, device=device) * strides[1]).view(1, -1, 1, 1)
    tables = (base + (order * strides[2]).unsqueeze(1)).to(torch.int32)  # [B, Hkv, Sq, W]
    tables = tables.reshape(batch * kv_heads * q_len, width)
    lens = counts.clamp(min=1).to(torch.int32).unsqueeze(1).expand(batch, kv_heads, q_len)
    starts = torch.arange(batch * kv_heads * q_len + 1, dtype=torch.int32, device=device)
    live = None if bool(counts.all()) else (counts > 0).view(counts.shape[0], q_len, 1, 1)
    plan = _RowPlan(mask, shape, strides, tables.contiguous(), lens.reshape(-1).contiguous(),
                    starts, live)
    if len(_PLANS) >= 2:
        _PLANS.pop(0)
    _PLANS.append(plan)
    return plan


def _token_blocks(states: Tensor, strides: tuple[int, ...]) -> Tensor:
    """``states [B, Hkv, S, D]`` as ``[n, 1, 1, D]`` one-token blocks: token ``t`` of head
    ``h`` of row ``b`` is block ``b * strides[0] + h * strides[1] + t * strides[2]``."""
    batch, kv_heads, length, dim = states.shape
    if _token_strides(states) != strides:
        states = states.contiguous()
    last = (batch - 1) * strides[0] + (kv_heads - 1) * strides[1] + (length - 1) * strides[2]
    return states.as_strided((last + 1, 1, 1, dim), (dim, dim, dim, 1),
                             states.storage_offset())


def _masked_attention(plan: _RowPlan, query: Tensor, key: Tensor, value: Tensor,
                      scale: float, softcap: float | None) -> Tensor:
    """Attention under a mask (the window is part of it); rows that see no key are zeros,
    as ``sdpa`` returns them."""
    batch, heads, q_len, dim = query.shape
    kv_heads = key.shape[1]
    group = heads // kv_heads
    rows = (query.view(batch, kv_heads, group, q_len, dim).transpose(2, 3)
            .reshape(batch * kv_heads * q_len, group, dim))
    out = ops.paged_attention.eager(rows, _token_blocks(key, plan.strides),
                                    _token_blocks(value, plan.strides), plan.tables,
                                    plan.lens, plan.starts, scale, None, softcap)
    out = (out.view(batch, kv_heads, q_len, group, dim).transpose(1, 2)
           .reshape(batch, q_len, heads, dim))
    if plan.live is not None:
        out = out * plan.live
    return out  # type: ignore[no-any-return]


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
            "continuous batching (generate_batch) only; set 'sdpa', 'eager' or 'opmux' for "
            "other forwards")
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
    """The experts implementation ``"opmux"``: ``opmux.ops.fused_moe`` where
    :func:`fused_moe_applies`, else the module class's own (``eager``) forward."""
    if fused_moe_applies(module, hidden_states):
        return ops.fused_moe.eager(hidden_states, module.gate_up_proj,  # type: ignore[no-any-return]
                                   module.down_proj, top_k_weights, top_k_index)
    for cls in type(module).__mro__:
        original = getattr(cls.__dict__.get("forward"), "__wrapped__", None)
        if original is not None:
            return original(module, hidden_states, top_k_index,  # type: ignore[no-any-return]
                            top_k_weights)
    raise TypeError(f"{type(module).__name__} is not an experts module of transformers")


def fused_moe_applies(module: Any, hidden_states: Tensor) -> bool:
    """A transformers experts module ``fused_moe`` computes: ``gate_up_proj [E, 2I, d]``
    gate rows first, ``down_proj [E, d, I]``, no bias, SiLU, the input's dtype, no autograd,
    tensors with data."""
    from transformers.activations import SiLUActivation

    w1 = getattr(module, "gate_up_proj", None)
    w2 = getattr(module, "down_proj", None)
    return (isinstance(w1, Tensor) and isinstance(w2, Tensor)
            and getattr(module, "is_concatenated", False) and getattr(module, "has_gate", False)
            and not getattr(module, "has_bias", True) and not getattr(module, "is_transposed", True)
            and not getattr(module, "has_post_expert_norm", True)
            and type(getattr(module, "act_fn", None)) in (SiLUActivation, torch.nn.SiLU)
            and w1.dtype == hidden_states.dtype == w2.dtype and not traced(hidden_states)
            and not (torch.is_grad_enabled()
                     and (hidden_states.requires_grad or w1.requires_grad
                          or w2.requires_grad)))
