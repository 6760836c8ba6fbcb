"""xla_gpu.paged_attention without torch_xla: CPU path, providers called directly, fake path."""

from __future__ import annotations

import functools
from collections.abc import Callable

import pytest
import torch
from xla_cases import CASES, Case, damage, loop_reference, make_case

import opmux
from opmux.plugins.xla import opmux_plugin_info
from opmux.plugins.xla import paged_attention as pa
from opmux.plugins.xla.static_attention import static_paged_attention


@pytest.fixture(scope="module", autouse=True)
def op() -> opmux.Op:
    opmux.load_plugins()  # the plugin defines the op when it registers, not at import
    return opmux.get_op("xla_gpu::paged_attention")


def catalog_reference(case: Case) -> torch.Tensor:
    """The catalog native ``paged_attention`` on the same data (separate caches), padded."""
    native = opmux.get_op("paged_attention").native
    out = torch.zeros_like(case.query)
    out[: case.live_tokens] = native(*case.catalog_args())
    return out


def tol(dtype: torch.dtype) -> dict[str, float]:
    return {"atol": 2e-5, "rtol": 2e-5} if dtype == torch.float32 else {"atol": 2e-2,
                                                                        "rtol": 2e-2}


def test_plugin_info_claims_every_platform() -> None:
    assert opmux_plugin_info() == {"name": "xla", "platforms": ["*"]}


def test_op_is_a_torch_op_with_providers_per_key(op: opmux.Op) -> None:
    assert op.namespace == "xla_gpu" and op.name == "paged_attention"
    assert op.torch_op is torch.ops.xla_gpu.paged_attention.default
    keys = {p: op.impls[p].dispatch_key for p in pa.PROVIDERS}
    assert keys == {"static_xla": "XLA", "catalog_cuda": "CUDA", "catalog_cpu": "CPU"}
    assert op.impls["catalog_cpu"].supported


@pytest.mark.parametrize("name", sorted(CASES))
def test_cpu_op_matches_catalog_native_and_loop(op: opmux.Op, name: str) -> None:
    case = make_case(**CASES[name])  # type: ignore[arg-type]
    out = torch.ops.xla_gpu.paged_attention(*case.args())
    torch.testing.assert_close(out, catalog_reference(case), **tol(out.dtype))
    torch.testing.assert_close(out, loop_reference(case), **tol(out.dtype))
    assert op.dispatch(*case.args()).provider == "catalog_cpu"


@pytest.mark.parametrize("provider", ["static_xla", "catalog_cuda", "catalog_cpu"])
@pytest.mark.parametrize("name", ["mixed", "window_soft_cap_padded", "gqa_4", "decode_padded"])
def test_each_provider_on_cpu_tensors(op: opmux.Op, provider: str, name: str) -> None:
    # catalog_cuda takes the triton provider where it is supported (triton lane,
    # interpreter) and the static code elsewhere; both must match.
    case = make_case(**CASES[name])  # type: ignore[arg-type]
    out = op.impls[provider](*case.args())
    torch.testing.assert_close(out, catalog_reference(case), **tol(out.dtype))


@pytest.mark.parametrize("provider", ["static_xla", "catalog_cuda", "catalog_cpu"])
@pytest.mark.parametrize("cell", [0, 1], ids=["key", "value"])
@pytest.mark.parametrize("bad", [float("inf"), float("nan")], ids=["inf", "nan"])
@pytest.mark.parametrize(("window", "cap"), [(None, None), (3, None), (None, 4.0)])
def test_nonfinite_cells_reach_only_the_rows_that_see_them(op: opmux.Op, provider: str,
                                                           cell: int, bad: float,
                                                           window: int | None,
                                                           cap: float | None) -> None:
    # the static code gathers whole block-table rows and multiplies masked keys' values by a
    # probability of 0: an inf or NaN value must still not reach a row that does not see it
    case = make_case([1, 9], [20, 12], heads=8, block_size=4, sliding_window=window,
                     soft_cap=cap)
    damage(case, cell, bad)
    out = op.impls[provider](*case.args())
    want = catalog_reference(case)
    assert torch.isfinite(want[:6]).all()
    assert torch.equal(torch.isfinite(out), torch.isfinite(want))
    torch.testing.assert_close(out, want, equal_nan=True, **tol(out.dtype))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision(op: opmux.Op, dtype: torch.dtype) -> None:
    case = make_case(**CASES["mixed"], dtype=dtype)  # type: ignore[arg-type]
    out = op(*case.args())
    assert out.dtype == dtype
    static = static_paged_attention(*case.args())  # type: ignore[arg-type]
    torch.testing.assert_close(out, catalog_reference(case), **tol(dtype))
    torch.testing.assert_close(static, loop_reference(case), **tol(dtype))


def test_padding_rows_are_zero_and_bucket_does_not_change_live_rows() -> None:
    tight = make_case([1, 4, 1], [9, 6, 3], seed=3)
    padded = make_case([1, 4, 1], [9, 6, 3], batch_bucket=8, token_bucket=16, max_blocks=6,
                       seed=3)
    # same live data in both (same seed draws the same cache and queries first)
    padded.kv_cache = tight.kv_cache
    padded.query[: tight.live_tokens] = tight.query
    padded.block_tables[:3, : tight.block_tables.shape[1]] = tight.block_tables
    for fn in (static_paged_attention, torch.ops.xla_gpu.paged_attention):
        small, big = fn(*tight.args()), fn(*padded.args())
        torch.testing.assert_close(big[: tight.live_tokens], small)
        assert torch.count_nonzero(big[tight.live_tokens:]) == 0


def test_num_seqs_selects_the_live_prefix_of_a_bucket() -> None:
    case = make_case([1, 1, 1, 1], [5, 9, 3, 7], batch_bucket=4, token_bucket=4)
    full = static_paged_attention(*case.args())  # type: ignore[arg-type]
    case.num_seqs = torch.tensor([2], dtype=torch.int32)
    case.q_lens, case.kv_lens = case.q_lens[:2], case.kv_lens[:2]
    for fn in (static_paged_attention, torch.ops.xla_gpu.paged_attention):
        part = fn(*case.args())
        torch.testing.assert_close(part[:2], full[:2])
        assert torch.count_nonzero(part[2:]) == 0
        torch.testing.assert_close(part, loop_reference(case))


class _NoHostReads(torch.utils._python_dispatch.TorchDispatchMode):
    """Fails on any op that reads tensor values to the host or has data-dependent shape."""

    banned = frozenset({"aten::_local_scalar_dense", "aten::nonzero", "aten::masked_select",
                        "aten::unique", "aten::_unique2", "aten::item"})

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        assert func._schema.name not in self.banned, f"host read: {func._schema.name}"
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("name", ["mixed", "window_soft_cap_padded"])
def test_static_code_never_reads_values_back(name: str) -> None:
    case = make_case(**CASES[name])  # type: ignore[arg-type]
    with _NoHostReads():
        out = pa.static_xla(*case.args())  # type: ignore[arg-type]
    torch.testing.assert_close(out, loop_reference(case))


def test_fake_path_gives_shape_and_dtype(op: opmux.Op) -> None:
    from torch._subclasses.fake_tensor import FakeTensorMode

    case = make_case(**CASES["mixed"], dtype=torch.bfloat16)  # type: ignore[arg-type]
    with FakeTensorMode(allow_non_fake_inputs=False) as mode:
        args = [mode.from_tensor(a) if isinstance(a, torch.Tensor) else a for a in case.args()]
        out = torch.ops.xla_gpu.paged_attention(*args)
    assert out.shape == case.query.shape and out.dtype == torch.bfloat16
    meta = [a.to("meta") if isinstance(a, torch.Tensor) else a for a in case.args()]
    assert torch.ops.xla_gpu.paged_attention(*meta).shape == case.query.shape


def test_fake_path_rejects_bad_shapes() -> None:
    from torch._subclasses.fake_tensor import FakeTensorMode

    case = make_case(**CASES["decode"])  # type: ignore[arg-type]
    case.kv_cache = case.kv_cache[0]
    with FakeTensorMode() as mode:
        args = [mode.from_tensor(a) if isinstance(a, torch.Tensor) else a for a in case.args()]
        with pytest.raises(opmux.OpInputError, match=r"'fake'.*'kv_cache'.*5-d"):
            torch.ops.xla_gpu.paged_attention(*args)


def test_compiles_without_graph_breaks(op: opmux.Op) -> None:
    case = make_case(**CASES["mixed"])  # type: ignore[arg-type]

    def step(*args: object) -> torch.Tensor:
        return torch.ops.xla_gpu.paged_attention(*args) * 2

    explained = torch._dynamo.explain(step)(*case.args())
    assert explained.graph_break_count == 0 and explained.graph_count == 1
    compiled = torch.compile(step, backend="eager", fullgraph=True)
    torch.testing.assert_close(compiled(*case.args()), 2 * loop_reference(case))


@pytest.mark.parametrize(
    ("mutate", "match"),
    [
        (lambda c: setattr(c, "query", c.query[0]), r"'query'.*3-d"),
        (lambda c: setattr(c, "kv_cache", c.kv_cache[:1]), r"'kv_cache'.*\[2, num_blocks"),
        (lambda c: setattr(c, "kv_cache", c.kv_cache[..., :8]), r"'kv_cache'.*head size 16"),
        (lambda c: setattr(c, "kv_cache", c.kv_cache.double()), r"'kv_cache'.*dtype"),
        (lambda c: setattr(c, "block_tables", c.block_tables.float()), r"'block_tables'"),
        (lambda c: setattr(c, "context_lens", c.context_lens[:1]), r"'context_lens'.*\[3\]"),
        (lambda c: setattr(c, "query_start_loc", c.query_start_loc[:3]),
         r"'query_start_loc'.*\[4\]"),
        (lambda c: setattr(c, "num_seqs", torch.tensor([1, 2])), r"'num_seqs'.*1-element"),
        (lambda c: setattr(c, "sliding_window", 0), r"'sliding_window'.*positive"),
        (lambda c: setattr(c, "soft_cap", -1.0), r"'soft_cap'.*positive"),
    ],
)
def test_bad_inputs_name_op_provider_and_argument(mutate: object, match: str) -> None:
    case = make_case(**CASES["decode"])  # type: ignore[arg-type]
    mutate(case)  # type: ignore[operator]
    # the CPU provider declines; the op runs native, whose check says why
    supports = opmux.get_op(pa.QUALNAME).impls["catalog_cpu"].supports_args
    assert supports is not None and not supports(*case.args())
    with pytest.raises(opmux.OpInputError, match=r"xla_gpu\.paged_attention \(provider "
                                                 r"'native'\).*" + match):
        torch.ops.xla_gpu.paged_attention(*case.args())


def test_cpu_provider_rejects_num_seqs_beyond_bucket() -> None:
    case = make_case(**CASES["decode"])  # type: ignore[arg-type]
    case.num_seqs = torch.tensor([4], dtype=torch.int32)
    with pytest.raises(opmux.OpInputError, match=r"'num_seqs' expected a value in \[0, 3\]"):
        torch.ops.xla_gpu.paged_attention(*case.args())


def test_empty_batch_gives_zeros() -> None:
    case = make_case(**CASES["decode_padded"])  # type: ignore[arg-type]
    case.num_seqs = torch.zeros(1, dtype=torch.int32)
    for fn in (static_paged_attention, torch.ops.xla_gpu.paged_attention):
        assert torch.count_nonzero(fn(*case.args())) == 0


def _routed_fns(kind: str) -> tuple[Callable[..., torch.Tensor], Callable[..., bool] | None]:
    """The catalog ``paged_attention`` function and predicate the CUDA route hands the call
    to, served here as provider ``triton`` of the catalog op."""
    if kind == "triton":
        import os

        os.environ.setdefault("TRITON_INTERPRET", "1")  # before the kernel module is imported
        from opmux.plugins.cuda import triton_attention

        return triton_attention.paged_attention, triton_attention.paged_attention_supports
    return opmux.get_op("paged_attention").native, None


@pytest.mark.parametrize("kind", ["native", pytest.param("triton", marks=pytest.mark.triton)])
@pytest.mark.parametrize("name", ["mixed", "window_soft_cap_padded", "decode_padded", "gqa_4"])
def test_cuda_route_converts_layout_without_host_reads(kind: str, name: str) -> None:
    # the CUDA provider's conversion (no host reads: CUDA-graph safe), run on CPU tensors
    # against the catalog op's provider "triton", counting its calls (Triton runs interpreted)
    catalog = opmux.get_op("paged_attention")
    assert not catalog.has_provider("triton"), "this test serves the route's triton provider"
    inner, pred = _routed_fns(kind)
    calls: list[int] = []

    def counted(*args: object) -> torch.Tensor:
        calls.append(1)
        with torch.utils._python_dispatch._pop_mode_temporarily():  # the routed impl may read
            return inner(*args)

    functools.update_wrapper(counted, catalog.native)  # the catalog op's signature
    catalog.register_impl("triton", dispatch_key="CPU", supports_args=pred)(counted)
    case = make_case(**CASES[name])  # type: ignore[arg-type]
    try:
        with _NoHostReads():
            out = pa.catalog_cuda(*case.args())  # type: ignore[arg-type]
    finally:
        catalog.unregister_impl("triton")
    assert calls == [1]
    torch.testing.assert_close(out, loop_reference(case), atol=1e-4, rtol=1e-4)


_DEFINED_WHEN = """
import torch, opmux.plugins.xla.paged_attention
defined = lambda: hasattr(torch.ops.xla_gpu, "paged_attention")
before = defined()
opmux.load_plugins()
print(before, defined())
"""


def test_op_is_defined_by_the_plugin_not_by_import() -> None:
    import subprocess
    import sys

    out = subprocess.check_output([sys.executable, "-c", _DEFINED_WHEN], text=True)
    assert out.split() == ["False", "True"]


def test_register_is_idempotent_and_global_only(op: opmux.Op,
                                                registry: opmux.OpRegistry) -> None:
    assert pa.register(opmux.global_registry()) == []  # already registered by the plugin
    assert pa.register(registry) == []  # the op is not another registry's
    assert pa.paged_attention_op() is op
