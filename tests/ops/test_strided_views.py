"""Every catalog op with conformance cases, every provider here, on strided views.

For each case, each tensor argument is replaced in turn by a non-contiguous, a transposed
(column-major), a stride-0 (expanded) and a storage-offset view
(:mod:`opmux.testing.views`). Each provider must agree with native on contiguous copies of
the same values (mutated arguments included) or decline the views in ``supports_args``;
native must honour the views too. In the triton lane the Triton kernels (interpreter) are
checked the same way.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch

import opmux
import opmux.ops
from opmux.testing import cases_for, has_cases
from opmux.testing.views import run_variant, strided_variants

#: (op, provider, case) expected to fail, with the reason; strict, so one that starts passing
#: is noticed
KNOWN_FAILURES: dict[tuple[str, str, str], str] = {}


def _own_cpu_providers(op: opmux.Op) -> list[str]:
    return [name for name, impl in op.impls.items()
            if impl.supported and impl.dispatch_key in ("CPU", "CompositeExplicitAutograd")
            and getattr(impl.fn, "__module__", "").startswith("opmux.")]


def _catalog() -> list[opmux.Op]:
    opmux.load_plugins()
    return [op for op in opmux.list_ops() if op.namespace == "opmux" and has_cases(op.qualname)]


def _params() -> Iterator[Any]:
    for op in _catalog():
        for provider in _own_cpu_providers(op):
            for case in cases_for(op.qualname):
                reason = KNOWN_FAILURES.get((op.name, provider, case.name))
                marks = [] if reason is None else [pytest.mark.xfail(strict=True, reason=reason)]
                yield pytest.param(op.qualname, provider, case.name, marks=marks,
                                   id=f"{op.name}-{provider}-{case.name}")


def _run(op: opmux.Op, provider: str, case_name: str) -> None:
    case = next(c for c in cases_for(op.qualname) if c.name == case_name)
    names = list(op.signature.parameters)
    problems = []
    ran = 0
    for variant in strided_variants(case, names=names, mutated=op.mutates_args):
        result = run_variant(op, provider, variant)
        ran += result.status == "pass"
        if not result.ok:
            problems.append(f"{variant.name}: {result.describe()}")
    assert not problems, "\n".join(problems)
    if case.args and any(isinstance(a, torch.Tensor) and a.numel() for a in case.args):
        assert ran or provider != "native", "native must run every variant"


@pytest.mark.parametrize(("qualname", "provider", "case_name"), list(_params()))
def test_strided_views_agree_with_native(qualname: str, provider: str, case_name: str) -> None:
    _run(opmux.get_op(qualname), provider, case_name)


def test_catalog_is_covered() -> None:
    names = {op.name for op in _catalog()}
    for name in ("silu_and_mul", "gelu_and_mul", "rms_norm", "fused_add_rms_norm",
                 "rotary_embedding"):
        assert name in names


def test_cpp_rotary_honours_positions_strides() -> None:
    """cpp takes strided and stride-0 positions and agrees with native on them."""
    op = opmux.ops.rotary_embedding
    if "cpp" not in op.supported_providers():
        pytest.skip("the cpp provider did not build here")
    from opmux.ops.rotary import make_cos_sin_cache

    g = torch.Generator().manual_seed(0)
    pairs = torch.randint(0, 64, (6, 2), generator=g)
    query, key = torch.randn(6, 4 * 32, generator=g), torch.randn(6, 2 * 32, generator=g)
    cache = make_cos_sin_cache(64, 32)
    cpp = op.impls["cpp"]
    for positions in (pairs[:, 1], pairs[2, :1].expand(6)):
        assert positions.stride(0) != 1
        assert cpp.supports_args is not None and cpp.supports_args(positions, query, key,
                                                                   cache, 32, True)
        got = cpp.fn(positions, query, key, cache, 32, True)
        want = op.native(positions.contiguous(), query, key, cache, 32, True)
        for g_t, w_t in zip(got, want, strict=True):
            torch.testing.assert_close(g_t, w_t, rtol=1e-5, atol=1e-5)


# --------------------------------------------------------------------------- triton lane
def _triton_available() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


_TRITON_OPS = ("silu_and_mul", "gelu_and_mul", "rms_norm", "fused_add_rms_norm",
               "rotary_embedding", "reshape_and_cache", "paged_attention",
               "advance_step_flashattn")


@pytest.fixture
def triton_ops(registry: opmux.OpRegistry, ns: str) -> dict[str, opmux.Op]:
    """The catalog's natives in a fresh registry with provider ``triton`` on the CPU key
    (Triton's interpreter) or the CUDA key."""
    import os

    if not torch.cuda.is_available():
        assert os.environ.get("TRITON_INTERPRET") == "1", "run with TRITON_INTERPRET=1"
    from opmux.plugins.cuda import triton_ops as provider

    ops = {}
    for name in _TRITON_OPS:
        src = getattr(opmux.ops, name)
        ops[name] = registry.register_op(src.native, name=name, namespace=ns,
                                         mutates_args=src.mutates_args)
    provider.register(registry, "CUDA" if torch.cuda.is_available() else "CPU")
    return ops


def _triton_params() -> Iterator[Any]:
    if not _triton_available():
        return
    for name in _TRITON_OPS:
        for case in cases_for(name):
            marks = [pytest.mark.triton]
            reason = KNOWN_FAILURES.get((name, "triton", case.name))
            if reason is not None:
                marks.append(pytest.mark.xfail(strict=True, reason=reason))
            yield pytest.param(name, case.name, marks=marks, id=f"{name}-triton-{case.name}")


_TRITON_PARAMS = list(_triton_params())


# The interpreter runs tile products through numpy, which warns where a damaged cache's inf
# meets a zero probability (0 * inf, the products the kernel takes again key by key).
@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")
@pytest.mark.skipif(not _TRITON_PARAMS, reason="triton is not installed in this lane")
@pytest.mark.parametrize(("name", "case_name"),
                         _TRITON_PARAMS or [pytest.param("", "", marks=pytest.mark.triton)])
def test_triton_strided_views_agree_with_native(triton_ops: dict[str, opmux.Op], name: str,
                                                case_name: str) -> None:
    op = triton_ops[name]
    case = next(c for c in cases_for(name) if c.name == case_name)
    problems = []
    for variant in strided_variants(case, names=list(op.signature.parameters),
                                    mutated=op.mutates_args):
        result = run_variant(op, "triton", variant, check_native=False)
        if not result.ok:
            problems.append(f"{variant.name}: {result.describe()}")
    assert not problems, "\n".join(problems)
