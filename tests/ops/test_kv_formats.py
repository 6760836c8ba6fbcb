"""KV-cache formats: the registry, the ops' ``kv_cache_format`` argument, the format an engine
is told to allocate, and the conformance of every registered format."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, Optional

import pytest
import torch
from torch import Tensor

import opmux
from opmux import ops
from opmux.ops.kv_formats import kv_cache_format_report, slot_positions
from opmux.testing import cases_for, check_kv_cache_format, check_provider, paged_batch
from opmux.testing.kv_format_cases import in_format


class _DimMajor(opmux.KVCacheFormat):
    """A copying format: storage ``[blocks, D, block_size, Hkv]`` contiguous, read back as a
    contiguous copy (so it needs its own writer)."""

    name = "test_dim_major"
    views = False

    def storage_shape(self, num_blocks: int, block_size: int, num_kv_heads: int,
                      head_size: int) -> tuple[int, ...]:
        return (num_blocks, head_size, block_size, num_kv_heads)

    def to_canonical(self, key_cache: Tensor, value_cache: Tensor) -> tuple[Tensor, Tensor]:
        return (key_cache.permute(0, 2, 3, 1).contiguous(),
                value_cache.permute(0, 2, 3, 1).contiguous())

    def write(self, key: Tensor, value: Tensor, key_cache: Tensor, value_cache: Tensor,
              slot_mapping: Tensor) -> None:
        valid, blocks, offsets = slot_positions(slot_mapping, key_cache.shape[2])
        # [blocks, D, bs, Hkv] indexed at (block, :, offset, :) -> [n, D, Hkv]
        key_cache.permute(0, 2, 3, 1).index_put_((blocks, offsets), key[valid])
        value_cache.permute(0, 2, 3, 1).index_put_((blocks, offsets), value[valid])


@pytest.fixture
def dim_major(fresh_plugins: None) -> Iterator[opmux.KVCacheFormat]:
    yield opmux.register_kv_cache_format(_DimMajor())


def _batch(dtype: torch.dtype = torch.float32):  # type: ignore[no-untyped-def]
    return paged_batch([3, 1, 1], [20, 9, 6], heads=4, kv_heads=2, head_size=16,
                       block_size=8, dtype=dtype, generator=torch.Generator().manual_seed(5))


def test_builtin_formats_and_public_names() -> None:
    assert opmux.list_kv_cache_formats()[:2] == ["canonical", "hnd"]
    hnd = opmux.get_kv_cache_format("hnd")
    k, v = hnd.allocate(3, 8, 2, 16, torch.bfloat16, "cpu")
    assert k.shape == v.shape == (3, 2, 8, 16) and k.dtype == torch.bfloat16
    ck, _ = hnd.to_canonical(k, v)
    assert ck.shape == (3, 8, 2, 16) and ck.data_ptr() == k.data_ptr()  # a view
    canon = opmux.get_kv_cache_format("canonical")
    assert canon.allocate(3, 8, 2, 16, torch.float32)[0].shape == (3, 8, 2, 16)


@pytest.mark.parametrize("name", ["canonical", "hnd"])
def test_every_builtin_format_conforms(name: str) -> None:
    assert check_kv_cache_format(name) == []


def test_a_copying_format_conforms_and_runs_in_the_ops(dim_major: opmux.KVCacheFormat) -> None:
    assert "test_dim_major" in opmux.list_kv_cache_formats()
    assert check_kv_cache_format("test_dim_major") == []
    # the kit's cases carry it once registered; native passes them against itself, cpp declines them
    names = [c.name for c in cases_for("paged_attention")]
    assert "format-test_dim_major-float32" in names
    report = check_provider("reshape_and_cache", "native")
    assert report.ok


def test_a_wrong_format_is_caught_by_the_kit(fresh_plugins: None) -> None:
    class _Broken(_DimMajor):
        name = "test_broken"

        def to_canonical(self, key_cache: Tensor, value_cache: Tensor
                         ) -> tuple[Tensor, Tensor]:
            # right shapes, head dims reversed
            return (key_cache.permute(0, 2, 3, 1).flip(-1).contiguous(),
                    value_cache.permute(0, 2, 3, 1).flip(-1).contiguous())

    opmux.register_kv_cache_format(_Broken())
    failures = check_kv_cache_format("test_broken")
    assert failures and "to_canonical" in failures[0]


def test_registration_errors_and_reset(fresh_plugins: None) -> None:
    fmt = _DimMajor()
    assert opmux.register_kv_cache_format(fmt) is fmt
    assert opmux.register_kv_cache_format(fmt) is fmt        # same object: a no-op
    with pytest.raises(opmux.RegistrationError, match="already registered"):
        opmux.register_kv_cache_format(_DimMajor())
    with pytest.raises(opmux.RegistrationError, match="must match"):
        opmux.register_kv_cache_format(type("Bad", (_DimMajor,), {"name": "Bad-Name"})())
    with pytest.raises(opmux.RegistrationError, match="expected a KVCacheFormat"):
        opmux.register_kv_cache_format(object())  # type: ignore[arg-type]
    no_writer = type("NoWriter", (opmux.KVCacheFormat,), {
        "name": "test_no_writer", "views": False,
        "storage_shape": _DimMajor.storage_shape, "to_canonical": _DimMajor.to_canonical})
    with pytest.raises(opmux.RegistrationError, match="define write"):
        opmux.register_kv_cache_format(no_writer())
    assert "test_no_writer" not in opmux.list_kv_cache_formats()
    with pytest.raises(TypeError, match="abstract"):  # to_canonical missing
        type("Half", (opmux.KVCacheFormat,), {"name": "test_half"})()
    shapeless = type("Shapeless", (opmux.KVCacheFormat,), {
        "name": "test_shapeless", "to_canonical": _DimMajor.to_canonical})()
    with pytest.raises(opmux.RegistrationError, match="neither storage_shape"):
        opmux.register_kv_cache_format(shapeless)
    with pytest.raises(opmux.RegistrationError, match="neither storage_shape"):
        shapeless.allocate(1, 16, 1, 8, torch.float32)
    assert "test_shapeless" not in opmux.list_kv_cache_formats()
    for bad in ([1, 16, 1, 8], (1, -16, 1, 8), (1, 16.0, 1, 8)):
        misshapen = type("Misshapen", (_DimMajor,), {
            "name": "test_misshapen", "storage_shape": lambda self, *sizes, bad=bad: bad})()
        with pytest.raises(opmux.RegistrationError, match="tuple of non-negative ints"):
            misshapen.allocate(1, 16, 1, 8, torch.float32)
    from opmux.testing import reset_for_tests

    reset_for_tests()
    assert "test_dim_major" not in opmux.list_kv_cache_formats()


@pytest.mark.parametrize("fmt_name", ["hnd", "test_dim_major"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_ops_on_a_format_equal_the_canonical_cache(dim_major: opmux.KVCacheFormat,
                                                   fmt_name: str, dtype: torch.dtype) -> None:
    fmt = opmux.get_kv_cache_format(fmt_name)
    b = _batch(dtype)
    _, _, hkv, d = b.key_cache.shape
    key, value = torch.randn(7, hkv, d).to(dtype), torch.randn(7, hkv, d).to(dtype)
    slots = torch.tensor([0, 5, -1, 17, 9, 30, 2])
    ck, cv = b.key_cache.clone(), b.value_cache.clone()
    fk, fv = in_format(fmt, b.key_cache, b.value_cache)
    ops.reshape_and_cache(key, value, ck, cv, slots)
    ops.reshape_and_cache(key, value, fk, fv, slots, fmt_name)   # dispatched (cpp or native)
    gk, gv = fmt.to_canonical(fk, fv)
    assert torch.equal(gk, ck) and torch.equal(gv, cv)
    args = list(b.args())
    args[1], args[2] = ck, cv
    want = ops.paged_attention(*args)
    args[1], args[2] = fk, fv
    got = ops.paged_attention(*args, kv_cache_format=fmt_name)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_unknown_format_is_a_clear_error_on_both_ops_and_under_compile() -> None:
    b = _batch()
    with pytest.raises(opmux.OpInputError, match=r"opmux::paged_attention .*'kv_cache_format' "
                       r"expected a registered KV-cache format \(canonical, hnd"):
        ops.paged_attention(*b.args(), kv_cache_format="nhd_typo")
    k = torch.zeros(1, 2, 16)
    with pytest.raises(opmux.OpInputError, match=r"opmux::reshape_and_cache .*kv_cache_format"):
        ops.reshape_and_cache(k, k, b.key_cache, b.value_cache, torch.zeros(1, dtype=torch.int64),
                              "nope")
    fn = torch.compile(lambda: ops.paged_attention(*b.args(), kv_cache_format="nope"),
                       fullgraph=True)
    with pytest.raises(Exception, match="kv_cache_format"):
        fn()


def test_hnd_under_compile_fullgraph() -> None:
    b = _batch()
    fk, fv = in_format(opmux.get_kv_cache_format("hnd"), b.key_cache, b.value_cache)
    args = list(b.args())
    want = ops.paged_attention(*args)
    args[1], args[2] = fk, fv
    fn = torch.compile(lambda: ops.paged_attention(*args, kv_cache_format="hnd"),
                       fullgraph=True)
    torch.testing.assert_close(fn(), want, atol=1e-5, rtol=1e-5)


def _probe(query: Tensor, key_cache: Tensor, value_cache: Tensor, block_tables: Tensor,
           seq_lens: Tensor, query_start_loc: Tensor, scale: float,
           sliding_window: Optional[int] = None, soft_cap: Optional[float] = None,
           kv_cache_format: str = "canonical") -> Tensor:
    out: Tensor = ops.paged_attention.native(query, key_cache, value_cache, block_tables,
                                             seq_lens, query_start_loc, scale, sliding_window,
                                             soft_cap, kv_cache_format)
    return out


def _probe_supports(query: Tensor, key_cache: Tensor, value_cache: Tensor,
                    block_tables: Tensor, seq_lens: Tensor, query_start_loc: Tensor,
                    scale: float, sliding_window: Optional[int] = None,
                    soft_cap: Optional[float] = None, kv_cache_format: str = "canonical") -> bool:
    return kv_cache_format in ("hnd", "canonical") and query.dtype == torch.float32


def test_kv_cache_format_follows_the_winning_provider(fresh_plugins: None) -> None:
    op = ops.paged_attention
    op.register_impl("kvfmt_probe", dispatch_key="CPU", supports_args=_probe_supports)(_probe)
    try:
        _follows_the_winning_provider(op)
    finally:
        op.unregister_impl("kvfmt_probe")


def _follows_the_winning_provider(op: opmux.Op) -> None:
    opmux.declare_kv_cache_formats(
        "kvfmt_probe", lambda spec: ("hnd", "canonical") if spec.dtype == torch.float32 else ())
    # the default priority (the probe registered last): cpp or native wins, reads canonical
    with op.set_priority([p for p in op.priority() if p != "kvfmt_probe"]):
        assert opmux.kv_cache_format("cpu", torch.float32, 16, 2, 8).name == "canonical"
    with op.set_priority(["kvfmt_probe", "cpp", "native"]):
        assert opmux.kv_cache_format("cpu", torch.float32, 16, 2, 8).name == "hnd"
        # the probe takes no bf16 caches: the next provider decides
        assert opmux.kv_cache_format("cpu", torch.bfloat16, 16, 2, 8).name == "canonical"
        assert "'hnd' (preferred by 'kvfmt_probe'" in kv_cache_format_report(
            "cpu", torch.float32, 16, 2, 8)
        # another device's key: the CPU provider has no say there
        assert opmux.kv_cache_format("cuda", torch.float32, 16, 2, 8).name == "canonical"
    with op.set_priority(["native"]):
        assert opmux.kv_cache_format("cpu", torch.float32, 16, 2, 8).name == "canonical"


def test_an_unknown_name_is_a_config_error() -> None:
    with pytest.raises(opmux.ConfigError, match=r"no KV-cache format 'nope'; registered: "
                       r"canonical, hnd"):
        opmux.get_kv_cache_format("nope")


def test_declaring_no_format_is_refused() -> None:
    with pytest.raises(opmux.RegistrationError, match="at least one format"):
        opmux.declare_kv_cache_formats("someone", [])


@pytest.mark.parametrize(("formats", "message"), [
    ("hnd", r"declare_kv_cache_formats\('someone', 'hnd'\): give a sequence of format names, "
            r"e.g. \('hnd',\)"),
    (["hnd", 3], r"format names are non-empty strings, got \[3\]"),
    (["hnd", ""], r"format names are non-empty strings"),
    (5, r"expected a sequence of format names or a function of the cache spec, got int"),
])
def test_declaring_formats_refuses_a_bare_string_and_non_names(formats: Any,
                                                               message: str) -> None:
    from opmux.ops.kv_formats import KVCacheSpec, kv_cache_formats_of

    with pytest.raises(opmux.RegistrationError, match=message):
        opmux.declare_kv_cache_formats("someone", formats)
    spec = KVCacheSpec(torch.device("cpu"), torch.float32, 64, 2, 16)
    assert kv_cache_formats_of("someone", spec) == ("canonical",)  # nothing was declared
