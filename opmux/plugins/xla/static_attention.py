"""Paged attention over a fused KV cache with static shapes only.

The function here is plain PyTorch written so that a lazy-tensor tracer (torch_xla) or
``torch.compile(backend="openxla")`` records the *same* graph for every call whose tensor
*shapes* match: every size comes from ``tensor.shape``, the per-token bookkeeping is built
from ``arange`` comparisons and gathers, masks replace ragged slicing, and nothing reads a
tensor value back to Python (no ``.item()``, ``.tolist()``, ``bool(tensor)``).

Changing ``context_lens``, ``query_start_loc`` or ``num_seqs`` values therefore reuses the
compiled graph; a new graph is compiled only for a new (tokens, batch bucket, max blocks,
cache) shape.
"""

from typing import Final, Optional

import torch
from torch import Tensor

from opmux.core.errors import OpInputError

OP_NAME: Final = "xla_gpu.paged_attention"
"""Qualified op name used in error messages."""

GATHER_BUDGET_ELEMS: Final = 1 << 26
"""Upper bound on the elements of one gathered key (or value) chunk.

Each query row gathers the ``max_blocks * block_size`` cached keys of its sequence. Rows
are processed in static chunks so that prefill batches (many rows per sequence) stay
within this bound; decode batches (one row per sequence) fit in a single chunk."""

_MASKED: Final = torch.finfo(torch.float32).min
"""Score given to invisible keys: finite, so that a row with no visible key (padding)
never produces NaN; such rows are zeroed afterwards."""

_INDEX_DTYPES: Final = (torch.int32, torch.int64)


def _fail(provider: str, argument: str, expected: str, got: object) -> OpInputError:
    return OpInputError(
        f"{OP_NAME} (provider {provider!r}): argument {argument!r} expected {expected}, "
        f"got {got}"
    )


PagedArgs = tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, float, Optional[int],
                  Optional[float]]
"""The op's arguments in schema order: ``(query, kv_cache, context_lens, block_tables,
query_start_loc, num_seqs, scale, sliding_window, soft_cap)``."""


def check_inputs(provider: str, args: PagedArgs) -> None:
    """Validate shapes and dtypes (static properties only; never reads tensor values).

    :param provider: provider name reported in errors.
    :param args: the op's arguments (:data:`PagedArgs`).
    :raises OpInputError: naming the argument, what was expected and what was got.
    """
    query, kv_cache, context_lens, block_tables, query_start_loc, num_seqs = args[:6]
    sliding_window, soft_cap = args[7], args[8]
    if query.dim() != 3:
        raise _fail(provider, "query", "a 3-d tensor [T, H, D]", f"shape {tuple(query.shape)}")
    if kv_cache.dim() != 5 or kv_cache.shape[0] != 2:
        raise _fail(
            provider,
            "kv_cache",
            "a 5-d tensor [2, num_blocks, block_size, Hkv, D]",
            f"shape {tuple(kv_cache.shape)}",
        )
    heads, head_size = query.shape[1], query.shape[2]
    kv_heads = kv_cache.shape[3]
    if kv_cache.shape[4] != head_size:
        raise _fail(provider, "kv_cache", f"head size {head_size} (query's D) in dim 4",
                    f"shape {tuple(kv_cache.shape)}")
    if kv_heads == 0 or heads % kv_heads != 0:
        raise _fail(provider, "kv_cache", f"a kv head count dividing H={heads}",
                    f"Hkv={kv_heads}")
    if kv_cache.dtype != query.dtype:
        raise _fail(provider, "kv_cache", f"dtype {query.dtype} (query's)", kv_cache.dtype)
    if block_tables.dim() != 2 or block_tables.dtype not in _INDEX_DTYPES:
        raise _fail(provider, "block_tables", "an int32/int64 tensor [S, max_blocks]",
                    f"{block_tables.dtype} shape {tuple(block_tables.shape)}")
    batch = block_tables.shape[0]
    if context_lens.shape != (batch,) or context_lens.dtype not in _INDEX_DTYPES:
        raise _fail(provider, "context_lens", f"an int32/int64 tensor [{batch}]",
                    f"{context_lens.dtype} shape {tuple(context_lens.shape)}")
    if query_start_loc.shape != (batch + 1,) or query_start_loc.dtype not in _INDEX_DTYPES:
        raise _fail(provider, "query_start_loc", f"an int32/int64 tensor [{batch + 1}]",
                    f"{query_start_loc.dtype} shape {tuple(query_start_loc.shape)}")
    if num_seqs.numel() != 1 or num_seqs.dtype not in _INDEX_DTYPES:
        raise _fail(provider, "num_seqs", "a 1-element int32/int64 tensor",
                    f"{num_seqs.dtype} shape {tuple(num_seqs.shape)}")
    if sliding_window is not None and sliding_window <= 0:
        raise _fail(provider, "sliding_window", "None or a positive int", sliding_window)
    if soft_cap is not None and not soft_cap > 0:
        raise _fail(provider, "soft_cap", "None or a positive float", soft_cap)


def token_layout(
    num_tokens: int,
    context_lens: Tensor,
    query_start_loc: Tensor,
    num_seqs: Tensor,
) -> tuple[Tensor, Tensor, Tensor]:
    """Per query row: owning sequence, absolute position, and whether the row is live.

    Row ``t`` belongs to sequence ``i`` when ``query_start_loc[i] <= t <
    query_start_loc[i + 1]`` and ``i < num_seqs``; rows at or past
    ``query_start_loc[num_seqs]`` are padding (``live`` False, sequence clamped into range).
    ``num_seqs`` itself is clamped into ``[0, S]``.

    :returns: ``(seq_of_row [T] int64, position [T] int64, live [T] bool)``.
    """
    device = query_start_loc.device
    batch = context_lens.shape[0]
    qsl = query_start_loc.to(torch.int64)
    # clamped rather than checked: checking would read the value back to the host
    count = num_seqs.reshape(1).to(torch.int64).clamp(0, batch)
    rows = torch.arange(num_tokens, device=device, dtype=torch.int64)
    seq_live = torch.arange(batch, device=device, dtype=torch.int64) < count
    ended = (qsl[1:].unsqueeze(0) <= rows.unsqueeze(1)) & seq_live.unsqueeze(0)
    seq = ended.sum(dim=1).clamp(max=batch - 1)
    live = (rows < qsl.gather(0, count)) & (rows >= qsl[0])
    start = qsl.index_select(0, seq)
    q_len = qsl.index_select(0, seq + 1) - start
    kv_len = context_lens.to(torch.int64).index_select(0, seq)
    position = kv_len - q_len + (rows - start)
    return seq, position, live


def static_paged_attention(
    query: Tensor,
    kv_cache: Tensor,
    context_lens: Tensor,
    block_tables: Tensor,
    query_start_loc: Tensor,
    num_seqs: Tensor,
    scale: float,
    sliding_window: Optional[int] = None,
    soft_cap: Optional[float] = None,
) -> Tensor:
    """Paged attention with static shapes (see :func:`token_layout` for the row mapping).

    Every query row gathers its sequence's whole block-table row (``max_blocks *
    block_size`` keys) and masks keys by position, so the work per row is fixed by shapes.
    Block ids are clamped into ``[0, num_blocks)``: entries past a sequence's length
    (often stale or -1 padding) are gathered but masked, never read out of bounds, and a
    value a row does not see is zeroed before the product, so not even an inf or NaN one
    reaches it.

    :returns: ``[T, H, D]`` in ``query.dtype``; padding rows are zero.
    """
    num_tokens, heads, head_size = query.shape
    num_blocks, block_size, kv_heads = kv_cache.shape[1], kv_cache.shape[2], kv_cache.shape[3]
    max_blocks = block_tables.shape[1]
    group = heads // kv_heads
    span = max_blocks * block_size
    seq, position, live = token_layout(num_tokens, context_lens, query_start_loc, num_seqs)
    table = block_tables.to(torch.int64).clamp(0, num_blocks - 1).index_select(0, seq)
    key_pos = torch.arange(span, device=query.device, dtype=torch.int64)
    visible = key_pos.unsqueeze(0) <= position.unsqueeze(1)
    if sliding_window is not None:
        visible = visible & (key_pos.unsqueeze(0) > position.unsqueeze(1) - sliding_window)
    q = query.reshape(num_tokens, kv_heads, group, head_size).to(torch.float32)
    keys, values = kv_cache[0], kv_cache[1]
    chunk = max(1, GATHER_BUDGET_ELEMS // max(1, span * kv_heads * head_size))
    outs: list[Tensor] = []
    for begin in range(0, num_tokens, chunk):
        end = min(num_tokens, begin + chunk)
        rows = end - begin
        ids = table[begin:end]
        k = keys[ids].reshape(rows, span, kv_heads, head_size).to(torch.float32)
        v = values[ids].reshape(rows, span, kv_heads, head_size).to(torch.float32)
        scores = torch.einsum("tkgd,tlkd->tkgl", q[begin:end], k) * scale
        if soft_cap is not None:
            scores = torch.tanh(scores / soft_cap) * soft_cap
        mask = visible[begin:end].reshape(rows, 1, 1, span)
        scores = torch.where(mask, scores, _MASKED)
        probs = torch.softmax(scores, dim=-1)
        # a key a row does not see must not reach it through an inf or NaN value (0 * inf)
        v = torch.where(visible[begin:end].reshape(rows, span, 1, 1), v, 0.0)
        out = torch.einsum("tkgl,tlkd->tkgd", probs, v).reshape(rows, heads, head_size)
        outs.append(out)
    if not outs:
        return query.new_zeros(query.shape)
    result = outs[0] if len(outs) == 1 else torch.cat(outs, dim=0)
    result = torch.where(live.reshape(num_tokens, 1, 1), result, 0.0)
    return result.to(query.dtype)
