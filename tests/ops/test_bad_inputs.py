"""Table-driven bad inputs: every registered row through native and every provider.

Each row of :mod:`opmux.testing.bad_inputs` must raise :class:`opmux.OpInputError` with
``.op``, ``.provider`` and ``.argument`` set and the one message format, when the provider's
impl is called directly and when the op is called, and must leave every input unchanged.
Providers: those registered and supported for the CPU here (``native``, ``cpp``, ...); in the
triton lane also ``triton`` (interpreter), called directly (native where its supports_args
declines the row).
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable
from typing import Any

import pytest
import torch

import opmux
import opmux.ops
from opmux.testing.bad_inputs import BadInput, bad_inputs_for, ops_with_bad_inputs

MESSAGE = re.compile(r"^opmux::(?P<op>\w+) \(provider '(?P<provider>\w+)'\): argument "
                     r"'(?P<argument>\w+)' (expected .+, got .+|rejected by the kernel: .+)$",
                     re.S)

#: the ops whose bad inputs this module must see (more may be registered)
OWN_OPS = ("silu_and_mul", "gelu_and_mul", "rms_norm", "fused_add_rms_norm", "rotary_embedding")
#: ops whose triton functions are called directly (the cache ops too)
TRITON_DIRECT_OPS = (*OWN_OPS, "reshape_and_cache", "paged_attention", "advance_step_flashattn")


def _cpu_providers(op: opmux.Op) -> list[str]:
    """opmux's own providers serving the CPU here (third-party plugins installed in the lane,
    such as the example vendor, run the kit themselves)."""
    return [name for name, impl in op.impls.items()
            if impl.supported and impl.dispatch_key in ("CPU", "CompositeExplicitAutograd")
            and getattr(impl.fn, "__module__", "").startswith("opmux.")]


def _rows() -> list[Any]:
    opmux.load_plugins()
    params = []
    for qualname in ops_with_bad_inputs():
        op = opmux.get_op(qualname)
        for provider in _cpu_providers(op):
            for row in bad_inputs_for(qualname):
                params.append(pytest.param(qualname, provider, row,
                                           id=f"{op.name}-{provider}-{row.label}"))
    return params


def _snapshot(values: tuple[Any, ...]) -> list[Any]:
    return [v.detach().clone() if isinstance(v, torch.Tensor) and v.device.type != "meta"
            else None for v in values]


def _assert_unchanged(values: tuple[Any, ...], before: list[Any]) -> None:
    for i, (v, b) in enumerate(zip(values, before, strict=True)):
        if b is not None:
            assert torch.equal(v, b) or torch.allclose(v, b, equal_nan=True), \
                f"argument {i} changed"


def _expect_error(call: Callable[[], Any], row: BadInput, op: str,
                  provider: str | None) -> opmux.OpInputError:
    with pytest.raises(opmux.OpInputError) as info:
        call()
    err = info.value
    assert err.op == op, str(err)
    assert err.argument == row.argument, str(err)
    assert err.provider is not None, str(err)
    if provider is not None:
        assert err.provider == provider, str(err)
    m = MESSAGE.match(str(err))
    assert m is not None, f"message not in the one format: {err}"
    assert (f"opmux::{m['op']}", m["provider"], m["argument"]) == (op, err.provider,
                                                                  err.argument)
    return err


def test_registry_covers_own_ops() -> None:
    registered = ops_with_bad_inputs()
    for name in OWN_OPS:
        assert f"opmux::{name}" in registered
    assert sum(len(bad_inputs_for(n)) for n in OWN_OPS) >= 80


@pytest.mark.parametrize(("qualname", "provider", "row"), _rows())
def test_bad_input_direct(qualname: str, provider: str, row: BadInput) -> None:
    # a provider never accepts what native rejects: its supports_args declines the call (the
    # op then runs native, whose error test_bad_input_through_op checks), or its impl
    # raises the op's error itself
    impl = opmux.get_op(qualname).impls[provider]
    if _declines(impl.supports_args, row):
        return
    before = _snapshot(row.args)
    _expect_error(lambda: impl.fn(*row.args, **row.kwargs), row, qualname, provider)
    _assert_unchanged(row.args, before)


def _declines(pred: Callable[..., bool] | None, row: BadInput) -> bool:
    if pred is None:
        return False
    try:
        return not pred(*row.args, **row.kwargs)
    except Exception:  # a predicate that raises declines
        return True


@pytest.mark.parametrize(("qualname", "provider", "row"), _rows())
def test_bad_input_through_op(qualname: str, provider: str, row: BadInput) -> None:
    op = opmux.get_op(qualname)
    before = _snapshot(row.args)
    order = [provider] if provider != "native" else []
    with op.set_priority([*order, "native"]):
        err = _expect_error(lambda: op(*row.args, **row.kwargs), row, qualname, None)
        explained = op.explain(*row.args, **row.kwargs)  # never raises on bad input
    assert err.provider in (provider, "native")
    assert qualname in explained
    _assert_unchanged(row.args, before)


def _triton_rows() -> list[Any]:
    try:
        import triton  # noqa: F401
    except ImportError:
        return []
    from opmux.plugins.cuda.triton_ops import KERNELS

    return [pytest.param(f"opmux::{name}", row, id=f"{name}-triton-{row.label}",
                         marks=pytest.mark.triton)
            for name in TRITON_DIRECT_OPS if name in KERNELS for row in bad_inputs_for(name)]


_TRITON_ROWS = _triton_rows()


@pytest.mark.skipif(not _TRITON_ROWS, reason="triton is not installed in this lane")
@pytest.mark.parametrize(("qualname", "row"),
                         _TRITON_ROWS or [pytest.param("", None, marks=pytest.mark.triton)])
def test_bad_input_triton_direct(qualname: str, row: BadInput) -> None:
    if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.fail("run the triton lane with TRITON_INTERPRET=1 (no GPU here)")
    import importlib

    from opmux.plugins.cuda.triton_ops import KERNELS

    name = qualname.split("::")[1]
    module_name, supports_name = KERNELS[name]
    module = importlib.import_module(f"opmux.plugins.cuda.{module_name}")
    fn, provider = getattr(module, name), "triton"
    if supports_name is not None and not getattr(module, supports_name)(*row.args, **row.kwargs):
        # declined: the op runs native, whose check refuses the row
        fn, provider = opmux.get_op(name).native, "native"
    before = _snapshot(row.args)
    _expect_error(lambda: fn(*row.args, **row.kwargs), row, qualname, provider)
    _assert_unchanged(row.args, before)


_CUDA_C_OPS = ("silu_and_mul", "rms_norm")


@pytest.mark.parametrize(("name", "row"), [
    pytest.param(name, row, id=f"{name}-cuda_c-{row.label}")
    for name in _CUDA_C_OPS for row in bad_inputs_for(name)])
def test_bad_input_cuda_c_direct(name: str, row: BadInput) -> None:
    """cuda_c's supports_args declines the row (here for the CPU tensors at least), so the op
    runs native, whose check refuses it."""
    from opmux.plugins.cuda import cuda_c

    assert not getattr(cuda_c, f"{name}_supports")(*row.args, **row.kwargs)
    op = opmux.get_op(name)
    before = _snapshot(row.args)
    _expect_error(lambda: op.native(*row.args, **row.kwargs), row, f"opmux::{name}", "native")
    _assert_unchanged(row.args, before)
