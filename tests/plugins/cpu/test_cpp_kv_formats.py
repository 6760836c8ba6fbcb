"""The ``cpp`` provider's KV-cache formats: it reads and writes ``canonical`` and ``hnd`` (dense
blocks in either order), prefers ``canonical``, registers ``amx_bf16`` and declines it."""

from __future__ import annotations

from typing import Any

import pytest
import torch

import opmux
from opmux import ops
from opmux.plugins.cpu.amx_format import AMX_BF16
from opmux.testing import check_kv_cache_format, paged_batch
from opmux.testing.kv_format_cases import in_format


def _batch(dtype: torch.dtype, kv_heads: int = 2, block_size: int = 16):  # type: ignore[no-untyped-def]
    return paged_batch([5, 1, 1, 1], [40, 33, 17, 1], heads=8, kv_heads=kv_heads,
                       head_size=64, block_size=block_size, dtype=dtype,
                       generator=torch.Generator().manual_seed(11))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("kv_heads", [1, 2, 8])
def test_cpp_reads_hnd_as_native_reads_canonical(cpp: Any, dtype: torch.dtype,
                                                 kv_heads: int) -> None:
    b = _batch(dtype, kv_heads)
    args = list(b.args(None, 24, 30.0))
    want = ops.paged_attention.native(*args)
    args[1], args[2] = in_format(opmux.get_kv_cache_format("hnd"), b.key_cache, b.value_cache)
    assert ops.paged_attention.dispatch(*args, "hnd").provider == "cpp"
    got = cpp.paged_attention(*args, "hnd")
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got, want, atol=tol, rtol=tol)


def test_cpp_writes_hnd(cpp: Any) -> None:
    hnd = opmux.get_kv_cache_format("hnd")
    kc, vc = hnd.allocate(4, 16, 2, 64, torch.bfloat16)
    ck, cv = torch.zeros(4, 16, 2, 64, dtype=torch.bfloat16), torch.zeros(4, 16, 2, 64,
                                                                           dtype=torch.bfloat16)
    key, value = torch.randn(9, 2, 64).bfloat16(), torch.randn(9, 2, 64).bfloat16()
    slots = torch.tensor([0, 63, -1, 17, 16, 5, 40, 41, 2])
    assert ops.reshape_and_cache.dispatch(key, value, kc, vc, slots, "hnd").provider == "cpp"
    cpp.reshape_and_cache(key, value, kc, vc, slots, "hnd")
    ops.reshape_and_cache.native(key, value, ck, cv, slots)
    gk, gv = hnd.to_canonical(kc, vc)
    assert torch.equal(gk, ck) and torch.equal(gv, cv)


def test_cpp_prefers_canonical_and_declines_what_it_does_not_read(cpp: Any) -> None:
    from opmux.ops.kv_formats import KVCacheSpec, kv_cache_formats_of

    spec = KVCacheSpec(torch.device("cpu"), torch.bfloat16, 128, 8, 16)
    assert kv_cache_formats_of("cpp", spec) == ("canonical",)
    with ops.paged_attention.set_priority(["cpp", "native"]):
        assert opmux.kv_cache_format("cpu", torch.bfloat16, 128, 8, 16).name == "canonical"
    b = _batch(torch.bfloat16)
    args = list(b.args())
    args[1], args[2] = in_format(AMX_BF16, b.key_cache, b.value_cache)
    assert not cpp.paged_attention_supports(*args, "amx_bf16")
    assert ops.paged_attention.dispatch(*args, "amx_bf16").provider == "native"
    with pytest.raises(opmux.OpInputError, match=r"provider 'cpp'.*reads \(canonical, hnd\)"):
        cpp.paged_attention(*args, "amx_bf16")


def test_amx_bf16_layout_is_the_tile_operand_pairing(cpp: Any) -> None:
    assert "amx_bf16" in opmux.list_kv_cache_formats()
    assert check_kv_cache_format("amx_bf16") == []
    kc, vc = AMX_BF16.allocate(3, 16, 2, 32, torch.bfloat16)
    assert kc.shape == (3, 2, 16, 16, 2) and vc.shape == (3, 2, 8, 32, 2)
    key = torch.arange(2 * 32, dtype=torch.float32).view(1, 2, 32).bfloat16()
    value = -key
    ops.reshape_and_cache(key, value, kc, vc, torch.tensor([16 + 5]), "amx_bf16")
    # block 1, token 5: key pair-row r holds dims (2r, 2r+1) of token 5 at column 5
    for r in range(16):
        assert kc[1, 1, r, 5].tolist() == key[0, 1, 2 * r:2 * r + 2].tolist()
    # values: token 5 is the second of pair-row 2, every dim
    assert torch.equal(vc[1, 0, 2, :, 1], value[0, 0])
    assert (vc[1, 0, 2, :, 0] == 0).all()
    with pytest.raises(ValueError, match="must be even"):
        AMX_BF16.allocate(3, 15, 2, 32, torch.bfloat16)


@pytest.mark.parametrize(("heads", "kv_heads"), [(8, 1), (8, 2), (32, 4)])
def test_cpp_hnd_long_prefill_rows_stay_within_an_item(cpp: Any, heads: int,
                                                        kv_heads: int) -> None:
    # long prefills give items of many rows: only NHD blocks may take the row-tile path
    b = paged_batch([64, 40, 1], [64, 90, 33], heads=heads, kv_heads=kv_heads, head_size=64,
                    block_size=16, dtype=torch.float32,
                    generator=torch.Generator().manual_seed(5))
    args = list(b.args(None, 24, 30.0))
    want = ops.paged_attention.native(*args)
    args[1], args[2] = in_format(opmux.get_kv_cache_format("hnd"), b.key_cache, b.value_cache)
    torch.testing.assert_close(cpp.paged_attention(*args, "hnd"), want, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("damage", ["key-4d", "key-last-3", "value-short", "odd-block"])
def test_a_wrongly_shaped_amx_bf16_cache_is_an_op_input_error(damage: str) -> None:
    b = _batch(torch.bfloat16)
    args = list(b.args())
    kc, vc = in_format(AMX_BF16, b.key_cache, b.value_cache)
    if damage == "key-4d":
        kc = kc.flatten(3)
    elif damage == "key-last-3":
        kc = torch.zeros(*kc.shape[:4], 3, dtype=kc.dtype)
    elif damage == "value-short":
        vc = vc[:, :, :-1]
    else:
        kc, vc = kc[:, :, :, :15], vc[:, :, :7]
    args[1], args[2] = kc, vc
    for call in (ops.paged_attention, ops.paged_attention.native):
        with pytest.raises(opmux.OpInputError, match=r"paged_attention \(provider 'native'\): "
                           r"argument 'key_cache' expected caches in KV-cache format "
                           r"'amx_bf16'") as info:
            call(*args, "amx_bf16")
        assert info.value.argument == "key_cache"
    meta = [a.to("meta") if isinstance(a, torch.Tensor) else a for a in args]
    with pytest.raises(opmux.OpInputError, match="argument 'key_cache'"):
        ops.paged_attention(*meta, "amx_bf16")
