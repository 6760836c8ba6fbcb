"""Debug-mode checks of provider calls: outputs against the fake, inputs against mutation.

A provider that returns the wrong dtype, shape, device or ``None`` passes silently through
an eager call and corrupts a compiled graph, whose shapes come from the fake. With
``OPMUX_CHECK_OUTPUTS=1`` (or :func:`opmux.enable_output_checks`, or the conformance kit)
every provider call goes through :func:`checked`, which compares the provider's result
with the op's fake run on fake copies of the same arguments, and reports any change to a
tensor argument that the op does not declare in ``mutates_args``. The checks are slow
(they copy inputs) and live only in the rebuilt chains of debug mode: when off, the hot
path runs the provider's own function.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from opmux.core.errors import ProviderOutputError

if TYPE_CHECKING:
    from opmux.core.op import Op, OpImpl

__all__ = ["checked"]


def checked(op: Op, impl: OpImpl) -> Callable[..., Any]:
    """``impl.fn`` wrapped with the output and mutation checks of this module."""
    fn = impl.fn
    provider = impl.provider
    params = list(op.signature.parameters)
    guarded = [name for name in params if name not in op.mutates_args]

    def run(*args: Any, **kwargs: Any) -> Any:
        named = dict(zip(params, args, strict=False))
        named.update(kwargs)
        before = {name: _snapshot(value) for name in guarded
                  if isinstance(value := named.get(name), torch.Tensor)}
        expected = _expected(op, args, kwargs)
        out = fn(*args, **kwargs)
        if expected is not _UNKNOWN:
            problem = _compare("output", out, expected)
            if problem:
                raise ProviderOutputError(
                    f"op {op.qualname!r}: provider {provider!r} returned {problem} (the op's "
                    f"fake gives the expected structure, dtype, shape and device)",
                    op=op.qualname, provider=provider)
        for name, (version, copy) in before.items():
            tensor = named[name]
            if _version(tensor) != version or not _same(copy, tensor):
                raise ProviderOutputError(
                    f"op {op.qualname!r}: provider {provider!r} changed argument {name!r}, "
                    f"which is not in mutates_args {list(op.mutates_args)}",
                    op=op.qualname, provider=provider)
        return out

    run.__name__ = f"checked_{getattr(fn, '__name__', provider)}"
    return run


_UNKNOWN: Any = object()


def _expected(op: Op, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """The fake's result on fake copies of the arguments (``_UNKNOWN`` if it cannot say)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    mode = FakeTensorMode()

    def fake(value: Any) -> Any:
        if isinstance(value, torch.Tensor):
            return mode.from_tensor(value)
        if isinstance(value, (list, tuple)):
            return type(value)(fake(v) for v in value)
        return value

    try:
        with mode:
            return op.fake(*(fake(a) for a in args), **{k: fake(v) for k, v in kwargs.items()})
    except Exception:
        # the fake cannot decide (data-dependent shape, or the arguments are bad and the
        # provider will say so itself): only the mutation check applies
        return _UNKNOWN


def _compare(label: str, got: Any, want: Any) -> str | None:
    if isinstance(want, torch.Tensor):
        if not isinstance(got, torch.Tensor):
            return f"{_describe(got)} as {label}, expected a Tensor"
        for what, g, w in (("dtype", got.dtype, want.dtype), ("shape", list(got.shape),
                           list(want.shape)), ("device", got.device, want.device)):
            if g != w:
                return f"{label} with {what} {g} (expected {what} {w})"
        return None
    if isinstance(want, (tuple, list)):
        if not isinstance(got, (tuple, list)) or len(got) != len(want):
            return f"{_describe(got)} as {label}, expected {len(want)} values"
        for i, (g, w) in enumerate(zip(got, want, strict=True)):
            problem = _compare(f"{label}[{i}]", g, w)
            if problem:
                return problem
        return None
    if want is None and got is not None:
        return f"{_describe(got)} as {label}, expected None"
    return None


def _describe(value: Any) -> str:
    if isinstance(value, (tuple, list)):
        return f"{type(value).__name__} of {len(value)}"
    return "None" if value is None else type(value).__name__


def _version(tensor: torch.Tensor) -> int:
    """The tensor's version counter; ``-1`` for an inference tensor, which has none (its
    values are compared)."""
    return -1 if tensor.is_inference() else tensor._version


def _snapshot(tensor: torch.Tensor) -> tuple[int, torch.Tensor]:
    return _version(tensor), tensor.detach().clone()


def _same(before: torch.Tensor, after: torch.Tensor) -> bool:
    """Bitwise equality (NaN equals NaN), on any device and dtype."""
    if before.shape != after.shape or before.dtype != after.dtype:
        return False
    if before.numel() == 0:
        return True
    a = before.detach().reshape(-1).contiguous().view(torch.uint8)
    b = after.detach().reshape(-1).contiguous().view(torch.uint8)
    return bool(torch.equal(a, b))
