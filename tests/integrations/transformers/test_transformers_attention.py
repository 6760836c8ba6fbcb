"""The ``opmux`` attention function reads transformers' key/value tensors in place as paged
blocks where their layout allows (a copy otherwise), runs them on the ``cpp`` provider and
equals a plain attention (core lane)."""

from __future__ import annotations

import math
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import pytest
import torch

pytest.importorskip("transformers")

import opmux.ops
from opmux.integrations.transformers import _attention


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


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize(("batch", "q_len", "kv_len"), [(1, 1, 9), (3, 1, 17), (2, 5, 12)])
@pytest.mark.parametrize(("window", "softcap"), [(None, None), (4, None), (None, 20.0)])
def test_dense_attention_reads_each_layout(monkeypatch: pytest.MonkeyPatch, layout: str,
                                           batch: int, q_len: int, kv_len: int,
                                           window: int | None, softcap: float | None) -> None:
    make, in_place = LAYOUTS[layout]
    torch.manual_seed(batch * 100 + q_len * 10 + kv_len)
    heads, kv_heads, dim = 8, 2, 16
    query = torch.randn(batch, heads, q_len, dim)
    key, value = make(batch, kv_heads, kv_len, dim), make(batch, kv_heads, kv_len, dim)
    seen: list[Any] = []
    op = opmux.ops.paged_attention
    spy = SimpleNamespace(eager=lambda *args: seen.append(args) or op.eager(*args))
    monkeypatch.setattr(_attention, "ops", SimpleNamespace(paged_attention=spy))
    out = _attention._dense_attention(query, key, value, dim ** -0.5, window, softcap)
    want = _reference(query, key, value, dim ** -0.5, window, softcap)
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)
    (args,) = seen
    assert op.dispatch(*args).provider == "cpp"
    read_in_place = args[1].data_ptr() == key.data_ptr() and args[2].data_ptr() == value.data_ptr()
    assert read_in_place == in_place
