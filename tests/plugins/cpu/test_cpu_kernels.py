"""The C++ CPU kernels (provider ``cpp``) against fp32 references and the native impls."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import cpu_reference as ref
import pytest
import torch

import opmux
from opmux.core.errors import OpInputError
from opmux.testing import paged_batch

pytestmark = pytest.mark.slow  # the session fixture compiles the extension on first use

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
TOL = {torch.float32: (2e-5, 2e-5), torch.bfloat16: (2e-2, 2e-2), torch.float16: (2e-3, 2e-3)}


def native(name: str) -> Callable[..., Any]:
    """The native reference from the op catalog (every op tested here is in it)."""
    import opmux

    return opmux.get_op(name).impls["native"].fn  # type: ignore[no-any-return]


def close(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype, scale: float = 1.0) -> None:
    rtol, atol = TOL[dtype]
    torch.testing.assert_close(got.float(), want.float(), rtol=rtol * scale, atol=atol * scale)


def check_native(name: str, got: Any, *args: Any, dtype: torch.dtype, scale: float = 1.0) -> None:
    want = native(name)(*args)
    pairs = zip(got, want, strict=True) if isinstance(got, tuple) else [(got, want)]
    for g, w in pairs:
        close(g, w, dtype, scale)


# ----------------------------------------------------------------------------- norms
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(7, 64), (3, 5, 4096), (2, 33)])
def test_rms_norm(cpp: Any, dtype: torch.dtype, shape: tuple[int, ...]) -> None:
    torch.manual_seed(0)
    x = torch.randn(shape, dtype=dtype)
    w = torch.randn(shape[-1], dtype=dtype)
    got = cpp.rms_norm(x, w, 1e-5)
    assert got.dtype == dtype and got.shape == x.shape
    close(got, ref.rms_norm(x, w, 1e-5), dtype)
    check_native("rms_norm", got, x, w, 1e-5, dtype=dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_fused_add_rms_norm(cpp: Any, dtype: torch.dtype) -> None:
    torch.manual_seed(1)
    x = torch.randn(9, 200, dtype=dtype)
    res = torch.randn(9, 200, dtype=dtype)
    w = torch.randn(200, dtype=dtype)
    x0, res0 = x.clone(), res.clone()
    out, new_res = cpp.fused_add_rms_norm(x, res, w, 1e-6)
    want_out, want_res = ref.fused_add_rms_norm(x, res, w, 1e-6)
    torch.testing.assert_close(new_res, want_res, rtol=0, atol=0)
    close(out, want_out, dtype)
    assert torch.equal(x, x0) and torch.equal(res, res0), "inputs must be untouched"
    check_native("fused_add_rms_norm", (out, new_res), x, res, w, 1e-6, dtype=dtype)


def test_rms_norm_rejects_mismatched_weight(cpp: Any) -> None:
    # through the op the predicate declines and native says what is wrong
    assert not cpp.rms_norm_supports(torch.randn(4, 8), torch.randn(7), 1e-6)
    with pytest.raises(OpInputError, match=r"rms_norm \(provider 'native'\): argument "
                                           r"'weight' expected shape \[8\]"):
        opmux.ops.rms_norm(torch.randn(4, 8), torch.randn(7), 1e-6)
    # the impl called directly: the kernel's own check is the last guard
    with pytest.raises(OpInputError, match=r"rms_norm \(provider 'cpp'\): .*rejected by the "
                                           r"kernel: weight must be a contiguous \[8\] tensor"):
        cpp.rms_norm(torch.randn(4, 8), torch.randn(7), 1e-6)
    # a dtype the shared check accepts but the kernel does not: the kernel's own check
    with pytest.raises(OpInputError, match="weight dtype must equal x dtype") as info:
        cpp.rms_norm(torch.randn(4, 8), torch.randn(8, dtype=torch.bfloat16), 1e-6)
    assert (info.value.op, info.value.provider) == ("opmux::rms_norm", "cpp")


# ----------------------------------------------------------------------------- activations
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(5, 2 * 40), (2, 3, 2 * 1000)])
def test_silu_and_mul(cpp: Any, dtype: torch.dtype, shape: tuple[int, ...]) -> None:
    torch.manual_seed(2)
    x = torch.randn(shape, dtype=dtype) * 3
    got = cpp.silu_and_mul(x)
    assert got.shape == (*shape[:-1], shape[-1] // 2)
    close(got, ref.silu_and_mul(x), dtype, scale=5)
    check_native("silu_and_mul", got, x, dtype=dtype, scale=5)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("approximate", ["none", "tanh"])
def test_gelu_and_mul(cpp: Any, dtype: torch.dtype, approximate: str) -> None:
    torch.manual_seed(3)
    x = torch.randn(6, 2 * 77, dtype=dtype) * 3
    got = cpp.gelu_and_mul(x, approximate)
    close(got, ref.gelu_and_mul(x, approximate), dtype, scale=5)
    check_native("gelu_and_mul", got, x, approximate, dtype=dtype, scale=5)


def test_gelu_and_mul_rejects_unknown_approximation(cpp: Any) -> None:
    assert not cpp.gelu_and_mul_supports(torch.randn(2, 8), "erf")
    with pytest.raises(OpInputError, match=r"'approximate' expected one of \['none', 'tanh'\]"):
        opmux.ops.gelu_and_mul(torch.randn(2, 8), "erf")
    with pytest.raises(OpInputError, match=r"gelu_and_mul \(provider 'cpp'\): .*rejected by "
                                           r"the kernel"):
        cpp.gelu_and_mul(torch.randn(2, 8), "erf")  # the kernel's own check, the last guard


# ----------------------------------------------------------------------------- rotary
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("is_neox", [True, False])
@pytest.mark.parametrize("rot", [64, 32])
def test_rotary_embedding(cpp: Any, dtype: torch.dtype, is_neox: bool, rot: int) -> None:
    torch.manual_seed(4)
    n_tok, heads, kv_heads, d, max_pos = 11, 4, 2, 64, 100
    positions = torch.randint(0, max_pos, (n_tok,))
    qkv = torch.randn(n_tok, (heads + 2 * kv_heads) * d, dtype=dtype)
    query = qkv[:, : heads * d]  # a strided view, as in a fused qkv projection
    key = qkv[:, heads * d: (heads + kv_heads) * d]
    inv = 1.0 / (10000 ** (torch.arange(0, rot, 2).float() / rot))
    freqs = torch.arange(max_pos).float()[:, None] * inv[None, :]
    cache = torch.cat([freqs.cos(), freqs.sin()], dim=-1).to(dtype)
    q0, k0 = query.clone(), key.clone()
    q, k = cpp.rotary_embedding(positions, query, key, cache, d, is_neox)
    want_q, want_k = ref.rotary_embedding(positions, query, key, cache, d, is_neox)
    close(q, want_q, dtype)
    close(k, want_k, dtype)
    assert torch.equal(query, q0) and torch.equal(key, k0), "inputs must be untouched"
    assert torch.equal(q.view(n_tok, heads, d)[..., rot:], q0.view(n_tok, heads, d)[..., rot:])
    check_native("rotary_embedding", (q, k), positions, query, key, cache, d, is_neox,
                 dtype=dtype, scale=2)


def test_rotary_embedding_rejects_position_out_of_range(cpp: Any) -> None:
    cache = torch.randn(8, 16)
    q, k = torch.randn(2, 32), torch.randn(2, 16)
    # the kernel checks the range (one pass) before writing; same error type and attributes
    with pytest.raises(OpInputError, match=r"'positions' rejected by the kernel: "
                                           r"positions\[1\] = 8 is outside \[0, 8\)") as info:
        cpp.rotary_embedding(torch.tensor([0, 8]), q, k, cache, 16, True)
    assert (info.value.op, info.value.provider, info.value.argument) == (
        "opmux::rotary_embedding", "cpp", "positions")


# ----------------------------------------------------------------------------- kv cache
@pytest.mark.parametrize("dtype", DTYPES)
def test_reshape_and_cache(cpp: Any, dtype: torch.dtype) -> None:
    torch.manual_seed(5)
    n_blocks, bs, kv_heads, d, n_tok = 6, 4, 2, 16, 7
    kv = torch.randn(n_tok, 2, kv_heads, d, dtype=dtype)
    key, value = kv[:, 0], kv[:, 1]  # strided views
    kc = torch.randn(n_blocks, bs, kv_heads, d, dtype=dtype)
    vc = torch.randn(n_blocks, bs, kv_heads, d, dtype=dtype)
    slots = torch.tensor([3, -1, 0, 23, 9, -1, 12])
    want_k, want_v = kc.clone(), vc.clone()
    ref.reshape_and_cache(key, value, want_k, want_v, slots)
    cpp.reshape_and_cache(key, value, kc, vc, slots)
    assert torch.equal(kc, want_k) and torch.equal(vc, want_v)


def test_reshape_and_cache_bad_slot_writes_nothing(cpp: Any) -> None:
    key = torch.randn(3, 1, 8)
    kc, vc = torch.zeros(2, 4, 1, 8), torch.zeros(2, 4, 1, 8)
    # the impl checks the slot values (data the predicate does not read) ...
    with pytest.raises(OpInputError, match=r"opmux::reshape_and_cache \(provider 'cpp'\): "
                                           r"argument 'slot_mapping' expected -1 \(skip\) or "
                                           r"slots in \[0, 8\).*got values in \[0, 8\]"):
        cpp.reshape_and_cache(key, key, kc, vc, torch.tensor([0, 1, 8]))
    assert not kc.any() and not vc.any()
    # ... the predicate declines what native refuses, and native says what is wrong ...
    bad = (key.half(), key.half(), kc, vc, torch.tensor([0, 1, 2]))
    assert not cpp.reshape_and_cache_supports(*bad)
    with pytest.raises(OpInputError, match=r"\(provider 'native'\): argument 'key' expected "
                                           r"the cache's dtype"):
        opmux.ops.reshape_and_cache(*bad)
    # ... and the kernel keeps its own guard, read through the slot mapping's stride
    kernel = torch.ops.opmux_cpu.reshape_and_cache
    with pytest.raises(ValueError, match=r"slot_mapping\[2\] = 8 is outside \[-1, 8\)"):
        kernel(key, key, kc, vc, torch.tensor([[0, 9], [1, 9], [8, 0]])[:, 0])
    with pytest.raises(ValueError, match="must share a dtype"):
        kernel(key.half(), key.half(), kc, vc, torch.tensor([0, 1, 2]))
    assert not kc.any() and not vc.any()


def _paged_case(dtype: torch.dtype, heads: int, kv_heads: int, d: int, bs: int,
                q_lens: list[int], kv_lens: list[int], seed: int = 0) -> dict[str, Any]:
    batch = paged_batch(q_lens, kv_lens, heads=heads, kv_heads=kv_heads, head_size=d,
                        block_size=bs, dtype=dtype, unused=-1, seed=seed).as_dict()
    wide = torch.cat([batch["query"], batch["query"][:, :2]], dim=1)
    return {**batch, "query": wide[:, :heads],  # non-contiguous across tokens
            "scale": d ** -0.5}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (8, 2), (8, 1)])
@pytest.mark.parametrize("window,cap", [(None, None), (8, None), (None, 5.0), (6, 3.0)])
def test_paged_attention_ragged(cpp: Any, dtype: torch.dtype, heads: int, kv_heads: int,
                                window: int | None, cap: float | None) -> None:
    # decode rows, a prefill chunk, an empty sequence, a full prefill (kv == q), partial blocks
    case = _paged_case(dtype, heads, kv_heads, 64, 16, q_lens=[1, 5, 0, 3, 1],
                       kv_lens=[7, 40, 10, 3, 70])
    got = cpp.paged_attention(**case, sliding_window=window, soft_cap=cap)
    want = ref.paged_attention(**case, sliding_window=window, soft_cap=cap)
    assert got.shape == case["query"].shape and got.dtype == dtype
    close(got, want, dtype, scale=2)
    close(got, native("paged_attention")(*case.values(), window, cap), dtype, scale=2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("d,bs", [(80, 16), (128, 128), (32, 5), (72, 16), (36, 16), (33, 16)])
@pytest.mark.parametrize("heads", [8, 16])
def test_paged_attention_head_and_block_sizes(cpp: Any, dtype: torch.dtype, d: int,
                                              bs: int, heads: int) -> None:
    # bf16: head sizes that are multiples of 32 take the pair-dot-product scores (where the
    # CPU has AVX512-BF16), the others widen keys to fp32; 72 (AVX-512) and 36 (AVX2) are not
    # multiples of the vector width (values through the zero-padded fp32 copy). 4 and 8 query
    # heads per kv head: the groups with rows in vector lanes, at every head size (33: an odd
    # one, whose last pair of a four-row group ends in padding)
    case = _paged_case(dtype, heads, 2, d, bs, q_lens=[1, 1, 17], kv_lens=[1, 300, 40])
    got = cpp.paged_attention(**case, sliding_window=None, soft_cap=None)
    close(got, ref.paged_attention(**case, sliding_window=None, soft_cap=None), dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("group", [1, 2, 3, 4, 5, 6, 7, 8])
def test_paged_attention_group_sizes(cpp: Any, dtype: torch.dtype, group: int) -> None:
    # every query-heads-per-kv-head count up to 8: the score tiles take the rows of one kv
    # head three, two or one at a time against four keys and the value step four, two or one
    # (AVX2), so each split of 1..8 decode rows and of the prefill rows (x 5 positions) and key
    # counts that leave 1-3 keys in the last tile of four are all met
    case = _paged_case(dtype, 2 * group, 2, 64, 16, q_lens=[1, 1, 5], kv_lens=[37, 301, 50])
    got = cpp.paged_attention(**case, sliding_window=None, soft_cap=None)
    close(got, ref.paged_attention(**case, sliding_window=None, soft_cap=None), dtype, scale=2)


def test_paged_attention_long_prefill_window(cpp: Any) -> None:
    # q_len > the rows of one work item: several items per sequence and kv head
    case = _paged_case(torch.float32, 4, 2, 64, 16, q_lens=[70], kv_lens=[90])
    got = cpp.paged_attention(**case, sliding_window=20, soft_cap=None)
    close(got, ref.paged_attention(**case, sliding_window=20, soft_cap=None), torch.float32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (8, 2), (8, 1), (16, 1)])
@pytest.mark.parametrize("window,cap", [(None, None), (700, None), (None, 5.0), (1500, 3.0)])
def test_paged_attention_split_kv(cpp: Any, dtype: torch.dtype, heads: int, kv_heads: int,
                                  window: int | None, cap: float | None) -> None:
    # one long decode sequence (fewer items than threads) is cut into key ranges whose
    # partial softmaxes are merged; a second short one stays whole; 2 threads at least.
    # 16 query heads per kv head: split items with more than 8 rows of one kv head
    threads = torch.get_num_threads()
    torch.set_num_threads(max(2, threads))
    try:
        case = _paged_case(dtype, heads, kv_heads, 32, 16, q_lens=[1, 1], kv_lens=[2100, 40])
        got = cpp.paged_attention(**case, sliding_window=window, soft_cap=cap)
        one = _paged_case(dtype, heads, kv_heads, 32, 16, q_lens=[1], kv_lens=[3000], seed=1)
        got_one = cpp.paged_attention(**one, sliding_window=window, soft_cap=cap)
    finally:
        torch.set_num_threads(threads)
    close(got, ref.paged_attention(**case, sliding_window=window, soft_cap=cap), dtype, scale=2)
    close(got_one, ref.paged_attention(**one, sliding_window=window, soft_cap=cap), dtype,
          scale=2)


@pytest.mark.parametrize("amx", [True, False], ids=["amx", "vector"])
@pytest.mark.parametrize("heads,kv_heads,d,bs,q_lens,kv_lens,window,cap", [
    (32, 4, 128, 128, [1, 1, 1, 1], [512, 300, 7, 1000], None, None),   # GQA 8 decode
    (32, 8, 128, 128, [1, 1, 1], [512, 2000, 7], None, 30.0),           # GQA 4 decode
    (32, 2, 128, 16, [1, 64, 1], [512, 600, 33], 256, 50.0),            # mixed, window, cap
    (32, 2, 64, 16, [1, 5, 1], [40, 40, 3], None, None),                # GQA 16, short
    (8, 1, 32, 5, [1, 17, 3], [300, 40, 3], 8, 3.0),                    # block 5, tails
    (64, 4, 256, 32, [1, 40, 1], [900, 45, 77], None, None),            # head size 256
    (12, 4, 96, 16, [1, 9], [50, 30], None, None),                      # GQA 3
    (32, 2, 128, 128, [1], [9000], 1000, 20.0),                         # split-KV
    (32, 32, 128, 128, [1, 1, 1], [300, 1000, 17], None, None),         # GQA 1 decode
    (32, 16, 64, 16, [1, 1], [250, 9], 100, 10.0),                      # GQA 2 decode
    (2, 1, 96, 32, [1, 3, 2, 4, 9], [70, 50, 20, 33, 40], None, None),  # 2 to 18 rows
    (1, 1, 32, 16, [1, 5], [47, 5], None, 4.0),                         # 1 and 5 rows
    (16, 2, 64, 16, [1, 1, 7], [700, 333, 300], 123, None),             # unaligned windows
])
def test_paged_attention_bf16_amx_and_vector(cpp: Any, amx: bool, heads: int, kv_heads: int,
                                              d: int, bs: int, q_lens: list[int],
                                              kv_lens: list[int], window: int | None,
                                              cap: float | None) -> None:
    # bf16 with head sizes that are multiples of 32 takes the AMX tile path where the CPU has
    # AMX (decode groups of 1 to 16 rows per kv head, items of one kv head), the vector paths
    # otherwise; both are run here on an AMX machine, and the switch reports what torch
    # detects. Cache rows no sequence owns hold NaN: tiles read straight from the cache must
    # stop at each sequence's last key.
    switch = torch.ops.opmux_cpu.paged_attention_amx
    threads = torch.get_num_threads()
    torch.set_num_threads(max(2, threads))
    try:
        on = switch(1 if amx else 0)
        assert on == (amx and torch.cpu._is_amx_tile_supported())
        case = _paged_case(torch.bfloat16, heads, kv_heads, d, bs, q_lens, kv_lens)
        owned = torch.zeros(case["key_cache"].shape[:2], dtype=torch.bool)
        for i, kv_len in enumerate(kv_lens):
            t = torch.arange(kv_len)
            owned[case["block_tables"][i, t // bs].long(), t % bs] = True
        for cache in (case["key_cache"], case["value_cache"]):
            cache[~owned] = float("nan")
        got = cpp.paged_attention(**case, sliding_window=window, soft_cap=cap)
    finally:
        switch(1)
        torch.set_num_threads(threads)
    want = ref.paged_attention(**case, sliding_window=window, soft_cap=cap)
    assert torch.isfinite(got).all()
    close(got, want, torch.bfloat16, scale=2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("amx", [True, False], ids=["amx", "vector"])
@pytest.mark.parametrize("window,cap", [(None, None), (50, None), (None, 400.0)])
@pytest.mark.parametrize("scale", [8.0, -8.0])
def test_paged_attention_sharp_scores(cpp: Any, dtype: torch.dtype, amx: bool,
                                      window: int | None, cap: float | None,
                                      scale: float) -> None:
    # Scores spread over hundreds: the softmax's exponents run from 0 down past fp32's range
    # (the kernels' exp gives 0 below -87, never a denormal), a row's probabilities are nearly
    # one-hot, and a negative scale reverses the order of the raw scores.
    switch = torch.ops.opmux_cpu.paged_attention_amx
    threads = torch.get_num_threads()
    torch.set_num_threads(max(2, threads))
    try:
        switch(1 if amx else 0)
        case = _paged_case(dtype, 16, 2, 128, 16, [1, 1, 9], [300, 33, 400])
        case["scale"] = scale
        got = cpp.paged_attention(**case, sliding_window=window, soft_cap=cap)
    finally:
        switch(1)
        torch.set_num_threads(threads)
    want = native("paged_attention")(*case.values(), window, cap)
    assert torch.isfinite(got).all()
    # fp32: a scaled score of a few hundred carries an absolute rounding error of about
    # |s| x 6e-8 x sqrt(d) (1e-4) whatever the order of its sum, and so does each probability
    # relatively (up to 7.6e-5 here)
    close(got, want, dtype, scale=2 if dtype == torch.bfloat16 else 8)


_DAMAGED_AT = pytest.mark.parametrize("kv_heads,q_lens,kv_lens,window,t,row", [
    (4, [1, 1, 1], [300, 700, 50], None, 123, 0),  # decode
    (4, [1], [9000], None, 8823, 0),               # split-KV
    (2, [40], [300], 10, 265, 5),                  # prefill: rows 5..14 see key 265
], ids=["decode", "split-kv", "window"])
"""Where the damaged cell goes: token ``t`` of the first sequence, kv head 1, column 7; ``row``
is a query row that sees it."""


def _damaged_run(cpp: Any, cache: str, bad: float, dtype: torch.dtype, amx: bool,
                 kv_heads: int, q_lens: list[int], kv_lens: list[int], window: int | None,
                 cap: float | None, t: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``cpp``'s and native's outputs with ``bad`` in one cell of ``cache`` ("key_cache" or
    "value_cache"), 2 threads, the AMX path on or off."""
    switch = torch.ops.opmux_cpu.paged_attention_amx
    threads = torch.get_num_threads()
    torch.set_num_threads(max(2, threads))
    try:
        switch(1 if amx else 0)
        case = _paged_case(dtype, 32, kv_heads, 128, 16, q_lens, kv_lens)
        case[cache][case["block_tables"][0, t // 16].long(), t % 16, 1, 7] = bad
        got = cpp.paged_attention(**case, sliding_window=window, soft_cap=cap)
    finally:
        switch(1)
        torch.set_num_threads(threads)
    return got, native("paged_attention")(*case.values(), window, cap)


def _same_nonfinite_and_close(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype) -> None:
    assert torch.equal(torch.isfinite(got), torch.isfinite(want))
    rtol, atol = TOL[dtype]
    torch.testing.assert_close(got.float(), want.float(), rtol=2 * rtol, atol=2 * atol,
                               equal_nan=True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bad", [float("inf"), float("nan")], ids=["inf", "nan"])
@pytest.mark.parametrize("amx", [True, False], ids=["amx", "vector"])
@_DAMAGED_AT
def test_paged_attention_nonfinite_value(cpp: Any, dtype: torch.dtype, bad: float, amx: bool,
                                         kv_heads: int, q_lens: list[int], kv_lens: list[int],
                                         window: int | None, t: int, row: int) -> None:
    # An inf or NaN value cell reaches the rows that see its key, in its own column, as native
    # has it: not the rows of the same item that do not see it (0 x inf), nor (AMX parity
    # form) the other column of its pair. Such rows are computed again over their own keys.
    got, want = _damaged_run(cpp, "value_cache", bad, dtype, amx, kv_heads, q_lens, kv_lens,
                             window, None, t)
    group = 32 // kv_heads  # the query heads of kv head 1
    assert not torch.isfinite(want[row, group:2 * group, 7]).any()
    assert torch.isfinite(want[:, :, 6]).all() and torch.isfinite(want[:, :group]).all()
    _same_nonfinite_and_close(got, want, dtype)


@pytest.mark.parametrize("dtype,amx", [(torch.float32, True), (torch.float16, True),
                                       (torch.bfloat16, True), (torch.bfloat16, False)],
                         ids=["fp32", "fp16", "bf16-amx", "bf16-vector"])
@pytest.mark.parametrize("bad", [float("inf"), float("nan")], ids=["inf", "nan"])
@pytest.mark.parametrize("cap", [None, 30.0], ids=["nocap", "cap"])
@_DAMAGED_AT
def test_paged_attention_nonfinite_key(cpp: Any, dtype: torch.dtype, amx: bool, bad: float,
                                       cap: float | None, kv_heads: int, q_lens: list[int],
                                       kv_lens: list[int], window: int | None, t: int,
                                       row: int) -> None:
    # An inf or NaN key cell gives the rows that see it what native gives them: NaN for a NaN
    # key (with a soft cap too: the cap's tanh must keep NaN), NaN or a one-hot row for an
    # infinite score, and with a soft cap an infinite score becomes +-cap, a finite one.
    got, want = _damaged_run(cpp, "key_cache", bad, dtype, amx, kv_heads, q_lens, kv_lens,
                             window, cap, t)
    group = 32 // kv_heads  # the query heads of kv head 1
    assert torch.isfinite(want[:, :group]).all()
    if bad != bad:  # NaN: every row that sees the key, every column
        assert torch.isnan(want[row, group:2 * group]).all()
    _same_nonfinite_and_close(got, want, dtype)


def test_paged_attention_errors(cpp: Any) -> None:
    case = _paged_case(torch.float32, 4, 2, 32, 16, q_lens=[2], kv_lens=[5])
    kernel = torch.ops.opmux_cpu.paged_attention_out
    out = torch.empty(case["query"].shape)

    def refused(match: str, argument: str, **change: Any) -> None:
        # what the predicate can see it declines, and native says what is wrong; index
        # values only the kernel reads, and its refusal names the argument
        args = {**case, **change}
        if cpp.paged_attention_supports(**args):
            with pytest.raises(OpInputError, match=rf"opmux::paged_attention \(provider "
                                                   rf"'cpp'\): argument '{argument}' rejected "
                                                   rf"by the kernel: {match}"):
                cpp.paged_attention(**args)
        else:
            with pytest.raises(OpInputError, match=rf"opmux::paged_attention \(provider "
                                                   rf"'native'\): argument '{argument}' "
                                                   rf"expected"):
                opmux.ops.paged_attention(**args)

    # int64 tables are valid (native takes them): the kernel refuses them, so cpp declines
    wide = {**case, "block_tables": case["block_tables"].long()}
    assert not cpp.paged_attention_supports(**wide)
    with pytest.raises(ValueError, match="must be contiguous int32"):
        kernel(out, *wide.values(), -1, 0.0)
    refused(r"sequence 0 has 2 query rows but seq_lens\[0\] = 1", "seq_lens",
            seq_lens=torch.tensor([1], dtype=torch.int32))
    bad = case["block_tables"].clone()
    bad[0, 0] = 10_000
    refused(r"block_tables\[0, 0\] = 10000 is outside", "block_tables", block_tables=bad)
    refused("", "query", query=case["query"].half())
    with pytest.raises(ValueError, match="must share a dtype"):
        kernel(out, *{**case, "query": case["query"].half()}.values(), -1, 0.0)
    refused("query_start_loc must run from 0", "query_start_loc",
            query_start_loc=torch.tensor([1, 2], dtype=torch.int32))
    refused(r"seq_lens\[0\] = -1 is outside", "seq_lens",
            seq_lens=torch.tensor([-1], dtype=torch.int32))
    # one meaning everywhere: 0 / negative is an error, None means none; the scalars the
    # kernel cannot see (it reads -1 and 0.0 as "none") are the predicate's
    for name, value in (("sliding_window", 0), ("soft_cap", 0.0), ("soft_cap", -1.0),
                        ("scale", True), ("scale", "0.5"), ("sliding_window", 4.0),
                        ("sliding_window", True), ("soft_cap", float("nan"))):
        assert not cpp.paged_attention_supports(**{**case, name: value}), (name, value)
        with pytest.raises(OpInputError) as info:
            native("paged_attention")(**{**case, name: value})
        assert info.value.argument == name


# ----------------------------------------------------------------------------- advance step
def _step_args(num_seqs: int = 4) -> list[Any]:
    return [
        torch.zeros(num_seqs, dtype=torch.int64),
        torch.tensor([[11], [12], [13]], dtype=torch.int64),
        torch.full((num_seqs,), 5, dtype=torch.int64),
        torch.tensor([6, 8, 6, 6][:num_seqs], dtype=torch.int32),
        torch.full((num_seqs,), 7, dtype=torch.int64),
        torch.tensor([[0], [1], [2], [3]][:num_seqs], dtype=torch.int32),
    ]


def test_advance_step_worked_example(cpp: Any) -> None:
    tokens, sampled, positions, lens, slots, bt = _step_args()
    sampled = torch.tensor([[11], [12], [13], [14]])
    cpp.advance_step_flashattn(4, 4, 128, tokens, sampled, positions, lens, slots, bt)
    assert positions.tolist() == [6, 8, 6, 6]
    assert lens.tolist() == [7, 9, 7, 7]
    assert slots.tolist() == [6, 136, 262, 390]
    assert tokens.tolist() == [11, 12, 13, 14]


def test_advance_step_padding_rows(cpp: Any) -> None:
    args = _step_args()
    want = [a.clone() for a in args]
    cpp.advance_step_flashattn(4, 3, 16, *args)
    ref.advance_step(4, 3, 16, *want)
    for got, exp in zip(args, want, strict=True):
        assert torch.equal(got, exp)
    assert args[3].tolist() == [7, 9, 7, 6], "padding rows keep their seq_lens"
    assert args[4][3].item() == -1


@pytest.mark.parametrize("index,bad,argument,match", [
    (3, torch.tensor([6, 8, 6, 6], dtype=torch.int64), "seq_lens",
     "seq_lens must be Int, got Long"),
    (0, torch.zeros(4, dtype=torch.int32), "input_tokens", "input_tokens must be Long, got Int"),
    (2, torch.zeros(1, dtype=torch.int64).expand(4), "input_positions",
     "input_positions must be contiguous"),
    (4, torch.zeros(5, dtype=torch.int64), "slot_mapping",
     "slot_mapping must have first dim num_seqs=4"),
    (1, torch.tensor([[1], [2]]), "sampled_token_ids",
     r"sampled_token_ids must be \[num_queries=3, 1\]"),
    (5, torch.tensor([[0], [1], [-1], [3]], dtype=torch.int32), "block_tables",
     r"block_tables\[2, 0\] = -1 \(the block of the next position\)"),
])
def test_advance_step_rejects_bad_input_and_writes_nothing(cpp: Any, index: int, bad: Any,
                                                           argument: str, match: str) -> None:
    args = _step_args()
    args[index] = bad
    before = [a.clone() for a in args]
    # the predicate declines what it can see, and native names the argument; the block ids
    # at the next positions are data only the kernel reads, and its refusal names them
    if cpp.advance_step_flashattn_supports(4, 3, 16, *args):
        with pytest.raises(OpInputError, match=rf"advance_step_flashattn \(provider 'cpp'\): "
                                               rf"argument '{argument}' rejected by the kernel"):
            cpp.advance_step_flashattn(4, 3, 16, *args)
    else:
        with pytest.raises(OpInputError, match=rf"advance_step_flashattn \(provider "
                                               rf"'native'\): argument '{argument}' expected"):
            opmux.ops.advance_step_flashattn(4, 3, 16, *args)
    # the kernel's own guard
    with pytest.raises(ValueError, match=rf"advance_step_flashattn \(provider 'cpp'\): {match}"):
        torch.ops.opmux_cpu.advance_step_flashattn(4, 3, 16, *args)
    for got, exp in zip(args, before, strict=True):
        assert torch.equal(got, exp)


def test_advance_step_declines_strided_state(cpp: Any) -> None:
    # native writes strided state vectors; the kernel writes contiguous arrays, so cpp
    # declines them and native serves the call
    args = _step_args()
    args[2] = torch.full((8,), 5, dtype=torch.int64)[::2]
    assert not cpp.advance_step_flashattn_supports(4, 3, 16, *args)
    with pytest.raises(OpInputError, match=r"rejected by the kernel: "
                                           r"input_positions must be contiguous"):
        cpp.advance_step_flashattn(4, 3, 16, *args)


def test_advance_step_reads_strided_ids_and_tables(cpp: Any) -> None:
    # 1-d or strided sampled ids, extra rows and strided block tables are what
    # native accepts; cpp serves them (through their strides) and agrees with native
    tables = torch.tensor([[0, 5], [1, 6], [2, 7], [3, 8]], dtype=torch.int32)
    sampled_variants = [
        torch.tensor([11, 12, 13]),
        torch.tensor([[11, 0], [12, 0], [13, 0]])[:, :1],
        torch.tensor([[11], [12], [13], [99], [98]]),
        torch.tensor([11, 0, 12, 0, 13, 0])[::2],
    ]
    table_variants = [tables, tables.t().contiguous().t(),
                      torch.cat([tables, tables], 1)[:, ::2]]
    for sampled in sampled_variants:
        for bt in table_variants:
            got, want = _step_args(), _step_args()
            got[1], got[5] = sampled, bt
            want[1], want[5] = sampled, bt
            assert cpp.advance_step_flashattn_supports(4, 3, 5, *got)
            cpp.advance_step_flashattn(4, 3, 5, *got)
            native("advance_step_flashattn")(4, 3, 5, *want)  # type: ignore[misc]
            for g, w in zip(got, want, strict=True):
                assert torch.equal(g, w)
