"""The ``opmux`` attention function (transformers' ``attn_implementation="opmux"``) reads
transformers' key/value tensors in place as paged blocks where their layout allows (a copy
otherwise), runs them on the ``cpp`` provider and equals a plain attention (core lane)."""

from __future__ import annotations

import math
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from _transformers_models import build

pytest.importorskip("transformers")

import opmux.ops
from opmux.integrations import transformers as otf


def _reference(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scale: float,
               window: int | None, softcap: float | None) -> torch.Tensor:
    """``[B, Sq, H, D]`` causal attention of the last ``Sq`` positions, in float64."""
    group = query.shape[1] // key.shape[1]
    q, k, v = (t.double() for t in (query, key.repeat_interleave(group, 1),
                                    value.repeat_interleave(group, 1)))
    scores = q @ k.transpose(-1, -2) * scale
    if softcap is not None:
        scores = softcap * torch.tanh(scores / softcap)
    q_len, kv_len = query.shape[2], key.shape[2]
    rows = torch.arange(kv_len - q_len, kv_len).unsqueeze(1)
    cols = torch.arange(kv_len)
    hidden = cols > rows
    if window is not None:
        hidden |= cols <= rows - window
    weights = scores.masked_fill(hidden, -math.inf).softmax(-1)
    return (weights @ v).transpose(1, 2).to(query.dtype)


def _dynamic(b: int, hkv: int, s: int, d: int) -> torch.Tensor:
    return torch.randn(b, hkv, s, d)                         # DynamicCache: HND blocks


def _token_major(b: int, hkv: int, s: int, d: int) -> torch.Tensor:
    return torch.randn(b, s, hkv, d).transpose(1, 2)         # no cache: NHD blocks


def _batch_slice(b: int, hkv: int, s: int, d: int) -> torch.Tensor:
    return torch.randn(b + 2, hkv, s, d)[1:b + 1]            # dense blocks, spaced apart


def _token_slice(b: int, hkv: int, s: int, d: int) -> torch.Tensor:
    return torch.randn(b, hkv, s + 3, d)[:, :, 3:]           # dense tokens, heads apart


def _padded_rows(b: int, hkv: int, s: int, d: int) -> torch.Tensor:
    return torch.randn(b, hkv, s, d + 4)[..., :d]            # tokens apart: copied


LAYOUTS: dict[str, tuple[Callable[[int, int, int, int], torch.Tensor], bool]] = {
    "dynamic-cache": (_dynamic, True), "token-major": (_token_major, True),
    "batch-slice": (_batch_slice, True), "token-slice": (_token_slice, True),
    "padded-rows": (_padded_rows, False),
}


@pytest.fixture(scope="module")
def opmux_attention() -> Callable[..., Any]:
    """transformers' registered ``opmux`` attention function (enable registers it)."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    otf.enable(build("llama"))
    return ALL_ATTENTION_FUNCTIONS[otf.ATTN_IMPLEMENTATION]  # type: ignore[no-any-return]


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize(("batch", "q_len", "kv_len"), [(1, 1, 9), (3, 1, 17), (2, 5, 12),
                                                        (2, 6, 6)])
@pytest.mark.parametrize(("window", "softcap"), [(None, None), (4, None), (None, 20.0)])
def test_attention_reads_each_layout(opmux_attention: Callable[..., Any],
                                     op_calls: Callable[[str], list[dict[str, Any]]],
                                     layout: str, batch: int, q_len: int, kv_len: int,
                                     window: int | None, softcap: float | None) -> None:
    make, in_place = LAYOUTS[layout]
    torch.manual_seed(batch * 100 + q_len * 10 + kv_len)
    heads, kv_heads, dim = 8, 2, 16
    query = torch.randn(batch, heads, q_len, dim)
    key, value = make(batch, kv_heads, kv_len, dim), make(batch, kv_heads, kv_len, dim)
    module = SimpleNamespace(is_causal=True, head_dim=dim)
    seen = op_calls("paged_attention")
    with torch.no_grad():
        out, weights = opmux_attention(module, query, key, value, None, scaling=dim ** -0.5,
                                       sliding_window=window, softcap=softcap)
    # no mask and more keys than queries: sdpa's is_causal, aligned upper left (the keys
    # past the queries are unused); one query, or as many queries as keys: the last keys
    seen_keys = q_len if 1 < q_len < kv_len else kv_len
    want = _reference(query, key[:, :, :seen_keys], value[:, :, :seen_keys], dim ** -0.5,
                      window, softcap)
    assert weights is None
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)
    (call,) = seen
    args = list(call.values())
    assert opmux.ops.paged_attention.dispatch(*args).provider == "cpp"
    read_in_place = call["key_cache"].data_ptr() == key.data_ptr() \
        and call["value_cache"].data_ptr() == value.data_ptr()
    assert read_in_place == in_place
