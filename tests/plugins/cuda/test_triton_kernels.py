"""Every Triton kernel against the catalog's native reference (interpreter on CPU, or GPU).

The impl functions are called directly here; ``test_triton_dispatch.py`` goes through opmux.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from cuda_refs import DTYPES, TOL, close, paged_case

import opmux.ops
from opmux.core.errors import OpInputError

pytestmark = pytest.mark.triton


def native(name: str) -> Callable[..., Any]:
    fn: Callable[..., Any] = getattr(opmux.ops, name).native
    return fn


def declined(supports: Callable[..., bool], name: str, match: str, *args: Any,
             **kwargs: Any) -> None:
    """``supports`` declines the call, so the op runs native, whose check refuses it."""
    assert not supports(*args, **kwargs)
    with pytest.raises(OpInputError, match=rf"{name} \(provider 'native'\).*" + match):
        native(name)(*args, **kwargs)


@pytest.fixture(scope="module")
def k() -> Any:
    """The Triton kernel modules (imported after conftest switched the interpreter on)."""
    from opmux.plugins.cuda import (
        triton_activation,
        triton_attention,
        triton_cache,
        triton_norm,
        triton_rope,
    )

    class Kernels:
        act, attn, cache, norm, rope = (triton_activation, triton_attention, triton_cache,
                                        triton_norm, triton_rope)

    return Kernels


# ----------------------------------------------------------------------------- activations
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(3, 5, 2 * 37), (4, 2 * 64), (1, 2), (0, 8)])
def test_silu_and_mul(k: Any, device: torch.device, dtype: torch.dtype,
                      shape: tuple[int, ...]) -> None:
    x = torch.randn(shape, device=device).to(dtype)
    got = k.act.silu_and_mul(x)
    assert got.shape == (*shape[:-1], shape[-1] // 2) and got.dtype == dtype
    close(got, native("silu_and_mul")(x), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("approximate", ["none", "tanh"])
def test_gelu_and_mul(k: Any, device: torch.device, dtype: torch.dtype, approximate: str) -> None:
    x = (3 * torch.randn(6, 2 * 45, device=device)).to(dtype)
    close(k.act.gelu_and_mul(x, approximate), native("gelu_and_mul")(x, approximate), dtype)


def test_activation_non_contiguous_and_errors(k: Any, device: torch.device) -> None:
    x = torch.randn(2 * 16, 8, device=device).t()  # last dim strided
    close(k.act.silu_and_mul(x), native("silu_and_mul")(x), torch.float32)
    # declined by the predicate; native's check gives the error
    assert not k.act.gelu_and_mul_supports(x, "erf")
    with pytest.raises(OpInputError, match=r"gelu_and_mul \(provider 'native'\).*approximate"):
        native("gelu_and_mul")(x, "erf")
    odd = torch.randn(2, 5, device=device)
    assert not k.act.silu_and_mul_supports(odd)
    with pytest.raises(OpInputError,
                       match=r"silu_and_mul \(provider 'native'\).*even last dimension"):
        native("silu_and_mul")(odd)
    assert not k.act.silu_and_mul_supports(torch.randn(2, 4, dtype=torch.float64))


# ----------------------------------------------------------------------------------- norms
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("looped", [False, True])
def test_rms_norm(k: Any, device: torch.device, dtype: torch.dtype, looped: bool) -> None:
    # rows longer than the register block take the two-pass path
    d = k.norm.MAX_SINGLE_PASS_ROW + 100 if looped else 100
    x = torch.randn(2, 3, d, device=device).to(dtype)
    w = torch.randn(d, device=device).to(dtype)
    close(k.norm.rms_norm(x, w, 1e-5), native("rms_norm")(x, w, 1e-5), dtype)
    w32 = w.float()  # fp32 weight with a low-precision activation
    close(k.norm.rms_norm(x, w32), native("rms_norm")(x, w32), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("looped", [False, True])
def test_fused_add_rms_norm(k: Any, device: torch.device, dtype: torch.dtype,
                            looped: bool) -> None:
    d = k.norm.MAX_SINGLE_PASS_ROW + 72 if looped else 72
    x = torch.randn(5, d, device=device).to(dtype)
    r = torch.randn(5, d, device=device).to(dtype)
    w = torch.randn(d, device=device).to(dtype)
    x0, r0 = x.clone(), r.clone()
    out, res = k.norm.fused_add_rms_norm(x, r, w, 1e-6)
    want_out, want_res = native("fused_add_rms_norm")(x, r, w, 1e-6)
    close(res, want_res, dtype)
    close(out, want_out, dtype)
    assert torch.equal(x, x0) and torch.equal(r, r0)  # functional: inputs untouched


def test_norm_edges_and_errors(k: Any, device: torch.device) -> None:
    x = torch.randn(8, 6, device=device)[:, ::2]  # strided rows
    w = torch.randn(3, device=device)
    close(k.norm.rms_norm(x, w), native("rms_norm")(x, w), torch.float32)
    assert k.norm.rms_norm(torch.empty(0, 3, device=device), w).shape == (0, 3)
    # declined by the predicates; native's check gives the error
    wide = torch.randn(2, 4, device=device)
    assert not k.norm.rms_norm_supports(wide, w)
    with pytest.raises(OpInputError, match=r"rms_norm \(provider 'native'\): argument 'weight'"):
        native("rms_norm")(wide, w)
    residual = torch.randn(8, 4, device=device)
    assert not k.norm.fused_add_rms_norm_supports(x, residual, w)
    with pytest.raises(OpInputError, match="residual"):
        native("fused_add_rms_norm")(x, residual, w)
    assert not k.norm.rms_norm_supports(x, w, -1.0)
    assert not k.norm.rms_norm_supports(x, w, float("nan"))


# ---------------------------------------------------------------------------------- rotary
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("is_neox", [True, False])
@pytest.mark.parametrize("rot", [32, 16])
def test_rotary_embedding(k: Any, device: torch.device, dtype: torch.dtype, is_neox: bool,
                          rot: int) -> None:
    from opmux.ops.rotary import make_cos_sin_cache

    tokens, heads, kv_heads, head_size = 5, 4, 2, 32
    positions = torch.randint(0, 50, (tokens,), device=device)
    q = torch.randn(tokens, heads * head_size, device=device).to(dtype)
    kk = torch.randn(tokens, kv_heads * head_size, device=device).to(dtype)
    cache = make_cos_sin_cache(50, rot, dtype=dtype, device=device)
    q0, k0 = q.clone(), kk.clone()
    got_q, got_k = k.rope.rotary_embedding(positions, q, kk, cache, head_size, is_neox)
    want_q, want_k = native("rotary_embedding")(positions, q, kk, cache, head_size, is_neox)
    close(got_q, want_q, dtype)
    close(got_k, want_k, dtype)
    assert torch.equal(q, q0) and torch.equal(kk, k0)


def test_rotary_3d_and_errors(k: Any, device: torch.device) -> None:
    from opmux.ops.rotary import make_cos_sin_cache

    positions = torch.tensor([3, 0, 7], device=device)
    q = torch.randn(3, 6, 24, device=device)  # [T, H, D] with a head size that is no power of 2
    kk = torch.randn(3, 1, 24, device=device)
    cache = make_cos_sin_cache(8, 16, device=device)
    got = k.rope.rotary_embedding(positions, q, kk, cache, 24, True)
    want = native("rotary_embedding")(positions, q, kk, cache, 24, True)
    assert got[0].shape == q.shape and got[1].shape == kk.shape
    close(got[0], want[0], torch.float32)
    close(got[1], want[1], torch.float32)
    declined(k.rope.rotary_embedding_supports, "rotary_embedding", "cos_sin_cache", positions,
             q, kk, make_cos_sin_cache(8, 32, device=device), 24, True)
    if device.type == "cpu":  # positions are data, read where that costs no device sync
        with pytest.raises(OpInputError, match=r"rotary_embedding \(provider 'triton'\): "
                                               r"argument 'positions' expected values in \[0, 8\)"):
            k.rope.rotary_embedding(positions + 5, q, kk, cache, 24, True)


# ------------------------------------------------------------------------------ kv caches
@pytest.mark.parametrize("dtype", DTYPES)
def test_reshape_and_cache(k: Any, device: torch.device, dtype: torch.dtype) -> None:
    tokens, kv_heads, head_size, blocks, block_size = 7, 2, 24, 4, 5
    qkv = torch.randn(tokens, 3, kv_heads, head_size, device=device).to(dtype)
    key, value = qkv[:, 1], qkv[:, 2]  # strided views, as split from a fused projection
    kc = torch.randn(blocks, block_size, kv_heads, head_size, device=device).to(dtype)
    vc = torch.randn_like(kc)
    slots = torch.tensor([0, 6, -1, 19, 7, 11, -1], device=device)
    want_k, want_v = kc.clone(), vc.clone()
    native("reshape_and_cache")(key, value, want_k, want_v, slots)
    k.cache.reshape_and_cache(key, value, kc, vc, slots)
    assert torch.equal(kc, want_k) and torch.equal(vc, want_v)
    declined(k.cache.reshape_and_cache_supports, "reshape_and_cache",
             r"'slot_mapping' expected dtype int64", key, value, kc, vc, slots.to(torch.int32))
    assert torch.equal(kc, want_k)
    empty = key[:0]
    k.cache.reshape_and_cache(empty, empty, kc, vc, slots[:0])
    assert torch.equal(kc, want_k)


def test_reshape_and_cache_errors_write_nothing(k: Any, device: torch.device) -> None:
    key = torch.randn(3, 2, 8, device=device)
    kc = torch.zeros(2, 4, 2, 8, device=device)
    vc = torch.zeros_like(kc)
    declined(k.cache.reshape_and_cache_supports, "reshape_and_cache", "slot_map", key, key,
             kc, vc, torch.zeros(2, dtype=torch.int64, device=device))
    wrong = torch.zeros(2, 4, 3, 8, device=device)
    declined(k.cache.reshape_and_cache_supports, "reshape_and_cache",
             r"'key' expected \[T, 3, 8\] \(the cache's Hkv", key, key, wrong, wrong,
             torch.zeros(3, device=device).long())
    if device.type == "cpu":  # slot values are data: triton reads them where that is free
        with pytest.raises(OpInputError, match=r"reshape_and_cache \(provider 'triton'\): "
                                               r"argument 'slot_mapping' expected -1"):
            k.cache.reshape_and_cache(key, key, kc, vc,
                                      torch.tensor([0, 8, -1], device=device))
    assert not kc.any() and not vc.any()


def _step_state(device: torch.device, seq_lens: list[int], tables: list[list[int]],
                sampled: list[int]) -> dict[str, Any]:
    n = len(seq_lens)
    return {
        "input_tokens": torch.full((n,), 99, dtype=torch.int64, device=device),
        "sampled_token_ids": torch.tensor(sampled, dtype=torch.int64, device=device)[:, None],
        "input_positions": torch.full((n,), 99, dtype=torch.int64, device=device),
        "seq_lens": torch.tensor(seq_lens, dtype=torch.int32, device=device),
        "slot_mapping": torch.full((n,), 99, dtype=torch.int64, device=device),
        "block_tables": torch.tensor(tables, dtype=torch.int32, device=device),
    }


def test_advance_step_worked_example(k: Any, device: torch.device) -> None:
    s = _step_state(device, [6, 8, 6, 6], [[0], [1], [2], [3]], [11, 12, 13, 14])
    k.cache.advance_step_flashattn(4, 4, 128, **s)
    assert s["input_positions"].tolist() == [6, 8, 6, 6]
    assert s["seq_lens"].tolist() == [7, 9, 7, 7]
    assert s["slot_mapping"].tolist() == [6, 136, 262, 390]
    assert s["input_tokens"].tolist() == [11, 12, 13, 14]


@pytest.mark.parametrize("num_queries", [0, 3, 5])
def test_advance_step_vs_native_with_padding(k: Any, device: torch.device,
                                             num_queries: int) -> None:
    tables = [[4, 2, 9], [0, 7, 1], [3, 5, 8], [6, 11, 10], [12, 13, 14]]
    sampled = [5, 6, 7, 8, 9][:num_queries] or [0]
    s = _step_state(device, [15, 16, 4, 31, 17], tables, sampled)
    want = {name: t.clone() for name, t in s.items()}
    native("advance_step_flashattn")(5, num_queries, 16, **want)
    k.cache.advance_step_flashattn(5, num_queries, 16, **s)
    for name in s:
        assert torch.equal(s[name], want[name]), name
    assert s["slot_mapping"][num_queries:].eq(-1).all()


def test_advance_step_writes_through_strided_state(k: Any, device: torch.device) -> None:
    # state vectors as columns of one buffer, sampled ids 1-d, a column-strided table
    s = _step_state(device, [5, 9, 3], [[4, 2, 9], [0, 7, 1], [3, 5, 8]], [7, 8, 9])
    want = {name: t.clone() for name, t in s.items()}
    native("advance_step_flashattn")(3, 3, 4, **want)
    buf = torch.full((3, 4), 99, dtype=torch.int64, device=device)
    lens = torch.zeros(3, 2, dtype=torch.int32, device=device)
    lens[:, 1] = s["seq_lens"]
    strided = {"input_tokens": buf[:, 0], "sampled_token_ids": s["sampled_token_ids"][:, 0],
               "input_positions": buf[:, 1], "seq_lens": lens[:, 1], "slot_mapping": buf[:, 2],
               "block_tables": s["block_tables"].t().contiguous().t()}
    k.cache.advance_step_flashattn(3, 3, 4, **strided)
    for name in ("input_tokens", "input_positions", "seq_lens", "slot_mapping"):
        assert torch.equal(strided[name], want[name]), name
    assert buf[:, 3].eq(99).all() and lens[:, 0].eq(0).all()


def test_advance_step_errors_write_nothing(k: Any, device: torch.device) -> None:
    s = _step_state(device, [6, 8], [[0], [1]], [1, 2])
    before = {name: t.clone() for name, t in s.items()}
    supports = k.cache.advance_step_flashattn_supports
    bad = dict(s, seq_lens=s["seq_lens"].long())
    declined(supports, "advance_step_flashattn", r"seq_lens.*int32", 2, 2, 16, **bad)
    declined(supports, "advance_step_flashattn",
             r"'input_tokens' expected shape \[3\] \(num_seqs\)", 3, 2, 16, **s)
    declined(supports, "advance_step_flashattn",
             r"'slot_mapping' expected a tensor whose elements do not overlap", 2, 2, 16,
             **dict(s, slot_mapping=torch.zeros(1, dtype=torch.int64).expand(2)))
    if device.type == "cpu":  # index values are data: triton reads them where that is free
        with pytest.raises(OpInputError, match=r"advance_step_flashattn \(provider 'triton'\)"
                                               r": argument 'seq_lens' expected values"):
            k.cache.advance_step_flashattn(2, 2, 4, **s)
    for name in s:
        assert torch.equal(s[name], before[name]), name


# ----------------------------------------------------------------------- paged attention
PAGED_VARIANTS = [(None, None), (5, None), (None, 4.0), (3, 2.5)]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("heads", "kv_heads"), [(4, 4), (8, 2), (8, 1)])
@pytest.mark.parametrize(("window", "soft_cap"), PAGED_VARIANTS)
def test_paged_attention_mixed_batch(k: Any, device: torch.device, dtype: torch.dtype,
                                     heads: int, kv_heads: int, window: int | None,
                                     soft_cap: float | None) -> None:
    # decode rows, a prefill longer than one query tile, an empty sequence, chunked prefill
    # on top of cached tokens, a kv_len that is an exact multiple of the block size
    case = paged_case([1, 19, 0, 3, 1], [9, 19, 4, 13, 8], heads, kv_heads, 16, 4, dtype,
                      device, pad_rows=2)
    got = k.attn.paged_attention(**case, scale=0.3, sliding_window=window, soft_cap=soft_cap)
    want = native("paged_attention")(**case, scale=0.3, sliding_window=window,
                                     soft_cap=soft_cap)
    close(got, want, dtype)
    assert got[-2:].eq(0).all()  # padding rows


@pytest.mark.parametrize("block_size", [1, 5, 16])
def test_paged_attention_block_sizes_and_head_size(k: Any, device: torch.device,
                                                   block_size: int) -> None:
    case = paged_case([1, 1, 6], [37, 1, 6], 6, 2, 40, block_size, torch.float32, device)
    got = k.attn.paged_attention(**case, scale=40 ** -0.5)
    close(got, native("paged_attention")(**case, scale=40 ** -0.5), torch.float32)


def test_paged_attention_int64_indices_and_empty(k: Any, device: torch.device) -> None:
    case = paged_case([2, 1], [5, 3], 4, 2, 16, 4, torch.float16, device)
    case64 = {n: (t.long() if n in ("block_tables", "seq_lens", "query_start_loc") else t)
              for n, t in case.items()}
    close(k.attn.paged_attention(**case64, scale=0.25),
          native("paged_attention")(**case, scale=0.25), torch.float16)
    empty = paged_case([0, 0], [3, 0], 4, 2, 16, 4, torch.float32, device)
    assert k.attn.paged_attention(**empty, scale=1.0).shape == (0, 4, 16)


# the interpreter runs tiles through numpy, which warns on the inf and NaN fed in on purpose
@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")
@pytest.mark.filterwarnings("ignore:All-NaN slice encountered:RuntimeWarning")
@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bad", [float("inf"), float("nan")], ids=["inf", "nan"])
@pytest.mark.parametrize("cell", ["key", "value"])
@pytest.mark.parametrize(("window", "soft_cap"), [(None, None), (3, None), (None, 4.0)])
def test_paged_attention_nonfinite_cells(k: Any, device: torch.device, dtype: torch.dtype,
                                         bad: float, cell: str, window: int | None,
                                         soft_cap: float | None) -> None:
    # Cache rows no sequence owns hold NaN, and one cell of key 8 of the 9-row prefill is inf
    # or NaN: rows 0..4 (positions 3..7) do not see that key and must come out as native has
    # them, untouched by it (a value cell reaches the rows of its tile through the tile
    # product unless they are taken key by key).
    case = paged_case([1, 9], [20, 12], 8, 2, 16, 4, dtype, device)
    owned = torch.zeros(case["key_cache"].shape[:2], dtype=torch.bool, device=device)
    for i, kv_len in enumerate([20, 12]):
        t = torch.arange(kv_len, device=device)
        owned[case["block_tables"][i, t // 4].long(), t % 4] = True
    for cache in (case["key_cache"], case["value_cache"]):
        cache[~owned] = float("nan")
    case[f"{cell}_cache"][case["block_tables"][1, 8 // 4].long(), 8 % 4, 1, 5] = bad
    got = k.attn.paged_attention(**case, scale=0.3, sliding_window=window, soft_cap=soft_cap)
    want = native("paged_attention")(**case, scale=0.3, sliding_window=window,
                                     soft_cap=soft_cap)
    assert torch.isfinite(want[:6]).all()  # the decode row and the rows before key 8
    assert not torch.isfinite(want).all() or (cell == "key" and bad > 0)
    assert torch.equal(torch.isfinite(got.cpu()), torch.isfinite(want.cpu()))
    atol, rtol = TOL[dtype]
    torch.testing.assert_close(got.float().cpu(), want.float().cpu(), atol=atol, rtol=rtol,
                               equal_nan=True)


def test_paged_attention_errors(k: Any, device: torch.device) -> None:
    case = paged_case([1], [3], 4, 2, 16, 4, torch.float32, device)
    with pytest.raises(OpInputError, match=r"paged_attention \(provider 'triton'\).*seq_lens"):
        k.attn.paged_attention(**dict(case, seq_lens=case["seq_lens"] * 0), scale=1.0)
    declined(k.attn.paged_attention_supports, "paged_attention", "sliding_window", **case,
             scale=1.0, sliding_window=0)
    declined(k.attn.paged_attention_supports, "paged_attention", "query",
             **dict(case, query=case["query"][:, :3]), scale=1.0)
