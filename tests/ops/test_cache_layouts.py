"""KV caches in the layouts engines allocate, through every provider present.

Adapted from the parameters of vLLM's ``tests/kernels/attention/test_cache.py``
(``reshape_and_cache`` / ``reshape_and_cache_flash``): 8 heads, head sizes 64/80/256,
block sizes 8/16/32, bf16 and fp32, random distinct slots, key and value as views of one
``[T, 3, H, D]`` projection, and caches that are NHD or HND views, K and V as two halves of
one buffer. The number of blocks is smaller than vLLM's (64, not 1024/10000) to keep the
CPU run short. Each write is checked against a per-token reference of ours on contiguous
copies; ``paged_attention`` must read the same views and match native on contiguous caches.
"""

from __future__ import annotations

import os
import random
from collections.abc import Callable
from typing import Any

import pytest
import torch

import opmux
from opmux.ops import paged_attention, reshape_and_cache
from opmux.testing.attention_cases import attention_case
from opmux.testing.cache_cases import CACHE_LAYOUTS, cache_layout

NUM_TOKENS, NUM_HEADS, NUM_BLOCKS = 21, 8, 64
HEAD_SIZES = [64, 80, 256]
BLOCK_SIZES = [8, 16, 32]
DTYPES = [torch.bfloat16, torch.float32]


def _writers() -> dict[str, Callable[..., None]]:
    """Every way of running reshape_and_cache here: native, each CPU provider, the op."""
    opmux.load_plugins()
    out: dict[str, Callable[..., None]] = {"native": reshape_and_cache.native,
                                           "op": reshape_and_cache}
    for name, impl in reshape_and_cache.impls.items():
        if name != "native" and impl.supported and impl.dispatch_key == "CPU":
            out[name] = impl.fn if impl.supports_args is None else _or_native(impl)
    return out


def _or_native(impl: Any) -> Callable[..., None]:
    def run(*args: Any) -> None:
        # a provider declining the layout leaves the call to native, as dispatch does
        (impl.fn if impl.supports_args(*args) else reshape_and_cache.native)(*args)

    return run


def _reference_write(key: torch.Tensor, value: torch.Tensor, kc: torch.Tensor,
                     vc: torch.Tensor, slots: torch.Tensor) -> None:
    bs = kc.shape[1]
    for t, s in enumerate(slots.tolist()):
        if s >= 0:
            kc[s // bs, s % bs] = key[t]
            vc[s // bs, s % bs] = value[t]


@pytest.mark.parametrize("layout", [x for x in CACHE_LAYOUTS if x != "padded-d"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("block_size", BLOCK_SIZES)
@pytest.mark.parametrize("head_size", HEAD_SIZES)
def test_reshape_and_cache_writes_through_layouts(head_size: int, block_size: int,
                                                  dtype: torch.dtype, layout: str) -> None:
    rng = random.Random(head_size * 1000 + block_size)
    gen = torch.Generator().manual_seed(block_size + head_size)
    slots = torch.tensor(rng.sample(range(NUM_BLOCKS * block_size), NUM_TOKENS))
    slots[::7] = -1  # padding tokens write nothing
    qkv = torch.randn(NUM_TOKENS, 3, NUM_HEADS, head_size, generator=gen).to(dtype)
    _, key, value = qkv.unbind(dim=1)
    shape = (NUM_BLOCKS, block_size, NUM_HEADS, head_size)
    kc0 = torch.randn(shape, generator=gen).to(dtype)
    vc0 = torch.randn(shape, generator=gen).to(dtype)
    want_k, want_v = kc0.clone(), vc0.clone()
    _reference_write(key, value, want_k, want_v, slots)
    for name, write in _writers().items():
        kc, vc = cache_layout(kc0, vc0, layout)
        strides = (kc.stride(), vc.stride())
        write(key, value, kc, vc, slots)
        assert (kc.stride(), vc.stride()) == strides  # written in place, layout kept
        assert torch.equal(kc, want_k), name
        assert torch.equal(vc, want_v), name


def test_kv_halves_of_one_buffer_do_not_touch_each_other() -> None:
    kv = torch.zeros(4, 2, 8, 2, 16)
    key = torch.ones(3, 2, 16)
    for name, write in _writers().items():
        kv.zero_()
        write(key, key * 2, kv[:, 0], kv[:, 1], torch.tensor([0, 9, 31]))
        k_rows = kv[:, 0].reshape(-1, 2, 16)
        v_rows = kv[:, 1].reshape(-1, 2, 16)
        assert k_rows[[0, 9, 31]].eq(1).all() and v_rows[[0, 9, 31]].eq(2).all(), name
        assert int(k_rows.ne(0).any(-1).any(-1).sum()) == 3, name
        assert int(v_rows.ne(0).any(-1).any(-1).sum()) == 3, name


def _readers() -> dict[str, Callable[..., torch.Tensor]]:
    opmux.load_plugins()
    out: dict[str, Callable[..., torch.Tensor]] = {"native": paged_attention.native,
                                                   "op": paged_attention}
    for name, impl in paged_attention.impls.items():
        if name != "native" and impl.supported and impl.dispatch_key == "CPU":
            def run(*args: Any, impl: Any = impl) -> torch.Tensor:
                ok = impl.supports_args is None or impl.supports_args(*args)
                return (impl.fn if ok else paged_attention.native)(*args)

            out[name] = run
    return out


@pytest.mark.parametrize("layout", CACHE_LAYOUTS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_paged_attention_reads_layouts(layout: str, dtype: torch.dtype) -> None:
    case = attention_case(f"read-{layout}", dtype=dtype, q_lens=[3, 1, 5], kv_lens=[40, 17, 5],
                          heads=8, kv_heads=2, head_size=64, block_size=16, layout=layout,
                          sliding_window=24)
    query, kc, vc, *rest = case.args
    assert layout == "nhd" or not kc.is_contiguous()
    want = paged_attention.native(query, kc.contiguous(), vc.contiguous(), *rest)
    ref = _float64_attention(query, kc, vc, *rest)
    tol = {"atol": 2e-2, "rtol": 2e-2} if dtype == torch.bfloat16 else {"atol": 1e-5,
                                                                         "rtol": 1e-5}
    torch.testing.assert_close(want.double(), ref, **tol)
    for name, read in _readers().items():
        got = read(query, kc, vc, *rest)
        torch.testing.assert_close(got, want, **tol, msg=name)


def _float64_attention(query: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor,
                       tables: torch.Tensor, lens: torch.Tensor, qsl: torch.Tensor,
                       scale: float, window: int | None, soft_cap: float | None
                       ) -> torch.Tensor:
    """A per-row float64 reference of ours (gathers tokens one by one from the views)."""
    out = torch.zeros(query.shape, dtype=torch.float64)
    bs, hkv = kc.shape[1], kc.shape[2]
    group = query.shape[1] // hkv
    for i, kv_len in enumerate(lens.tolist()):
        q0, q1 = int(qsl[i]), int(qsl[i + 1])
        toks = [(int(tables[i, t // bs]), t % bs) for t in range(kv_len)]
        k = torch.stack([kc[b, o] for b, o in toks]).double() if toks else None
        v = torch.stack([vc[b, o] for b, o in toks]).double() if toks else None
        for j in range(q1 - q0):
            p = kv_len - (q1 - q0) + j
            lo = max(0, p - window + 1) if window else 0
            assert k is not None and v is not None
            for h in range(query.shape[1]):
                s = (k[lo:p + 1, h // group] @ query[q0 + j, h].double()) * scale
                if soft_cap:
                    s = soft_cap * torch.tanh(s / soft_cap)
                out[q0 + j, h] = torch.softmax(s, 0) @ v[lo:p + 1, h // group]
    return out


@pytest.mark.triton
@pytest.mark.parametrize("layout", CACHE_LAYOUTS)
def test_triton_cache_layouts(layout: str) -> None:
    if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.fail("run the triton lane with TRITON_INTERPRET=1 (no GPU here)")
    from opmux.plugins.cuda import triton_attention, triton_cache

    gen = torch.Generator().manual_seed(5)
    kc0, vc0 = torch.randn(8, 16, 2, 80, generator=gen), torch.randn(8, 16, 2, 80, generator=gen)
    qkv = torch.randn(11, 3, 2, 80, generator=gen)
    slots = torch.randperm(128, generator=gen)[:11]
    slots[4] = -1
    want_k, want_v = kc0.clone(), vc0.clone()
    _reference_write(qkv[:, 1], qkv[:, 2], want_k, want_v, slots)
    kc, vc = cache_layout(kc0, vc0, layout)
    triton_cache.reshape_and_cache(qkv[:, 1], qkv[:, 2], kc, vc, slots)
    assert torch.equal(kc, want_k) and torch.equal(vc, want_v)
    case = attention_case(f"triton-{layout}", q_lens=[2, 1], kv_lens=[19, 6], head_size=32,
                          layout=layout)
    query, kc, vc, *rest = case.args
    want = paged_attention.native(query, kc.contiguous(), vc.contiguous(), *rest)
    got = triton_attention.paged_attention(query, kc, vc, *rest)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("tokens", [5, 300])  # the small (Python) and large (tensor) paths
def test_slot_values_checked_for_small_and_large_batches(tokens: int) -> None:
    kc, vc = torch.zeros(64, 8, 1, 4), torch.zeros(64, 8, 1, 4)
    key = torch.ones(tokens, 1, 4)
    slots = torch.randperm(512, generator=torch.Generator().manual_seed(tokens))[:tokens]
    slots[1] = -1
    slots[2] = -1  # -1 may repeat
    reshape_and_cache.native(key, key, kc, vc, slots)
    assert int(kc.ne(0).any(-1).any(-1).sum()) == tokens - 2
    repeated, past = slots.clone(), slots.clone()
    repeated[4] = repeated[3]
    past[0] = 512
    with pytest.raises(opmux.OpInputError, match=r"'slot_mapping' expected distinct slots"):
        reshape_and_cache.native(key, key, kc, vc, repeated)
    with pytest.raises(opmux.OpInputError, match=r"'slot_mapping' expected -1 \(skip\) or "
                                                 r"slots in \[0, 512\)"):
        reshape_and_cache.native(key, key, kc, vc, past)
