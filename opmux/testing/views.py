"""Strided views of conformance cases: every provider must honour strides or decline.

A provider agrees with native on every input native accepts, whatever its memory layout, or
declines it in ``supports_args`` (so native runs). :func:`strided_variants` turns one
:class:`~opmux.testing.Case` into variants where a single tensor argument is replaced by a
view over fresh storage:

- ``noncontiguous``: every dimension strided by 2 (``buf[::2, ::2, ...]``);
- ``transposed``: column-major storage viewed back in the logical shape
  (``t.transpose(0, -1).contiguous().transpose(0, -1)``; 2 or more dimensions);
- ``expanded``: stride 0 along dim 0 (``row.expand(n, ...)``); every row then holds row 0's
  values, so the variant's values are those of the expanded view (native sees the same);
  never used for an argument the op mutates (writing through overlapping memory is
  undefined);
- ``offset``: the same values at storage offset 7 of a larger buffer.

Every other kind holds exactly the case's values. :func:`run_variant` runs a provider on the
views and native on contiguous copies of the same values, and compares outputs and mutated
arguments as :func:`~opmux.testing.run_case` does.

>>> import torch
>>> from opmux.testing import Case
>>> from opmux.testing.views import strided_variants
>>> case = Case("demo", (torch.arange(6.0).reshape(2, 3),))
>>> [v.name for v in strided_variants(case)]
['x0-noncontiguous', 'x0-transposed', 'x0-expanded', 'x0-offset']
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Final

import torch

from opmux.core.op import NATIVE, Op
from opmux.testing.case_table import Case
from opmux.testing.conformance import CaseResult, compare_outputs, provider_impl, tolerance

__all__ = ["VIEW_KINDS", "StridedVariant", "run_variant", "strided_variants", "strided_view"]

VIEW_KINDS: Final = ("noncontiguous", "transposed", "expanded", "offset")
"""The view kinds :func:`strided_variants` makes, in order."""

_OFFSET: Final = 7


@dataclass(frozen=True)
class StridedVariant:
    """One case with one tensor argument replaced by a strided view.

    :ivar name: ``"<argument>-<kind>"`` (``x0`` = first positional argument when names are
        unknown).
    :ivar argument: the replaced argument's name (or ``x<i>``).
    :ivar kind: one of :data:`VIEW_KINDS`.
    :ivar case: the case holding the view (its tensors must not be cloned: cloning drops the
        strides); use :func:`run_variant`.
    """

    name: str
    argument: str
    kind: str
    case: Case


def strided_view(t: torch.Tensor, kind: str) -> torch.Tensor | None:
    """A view of fresh storage holding ``t``'s values with the layout ``kind``.

    :returns: the view, or ``None`` when ``kind`` does not apply to ``t`` (a 0-d tensor;
        ``transposed`` below 2 dimensions; ``expanded`` when dim 0 has fewer than 2 rows).
    :raises ValueError: for an unknown ``kind``.
    """
    if kind not in VIEW_KINDS:
        raise ValueError(f"unknown view kind {kind!r}; valid: {sorted(VIEW_KINDS)}")
    t = t.detach()
    if kind == "offset":
        buf = torch.empty(t.numel() + _OFFSET, dtype=t.dtype, device=t.device)
        view = buf[_OFFSET:].view(t.shape)
        view.copy_(t)
        return view
    if t.dim() == 0:
        return None
    if kind == "noncontiguous":
        buf = torch.empty([2 * s for s in t.shape], dtype=t.dtype, device=t.device)
        view = buf[tuple(slice(None, None, 2) for _ in t.shape)]
        view.copy_(t)
        return view
    if kind == "transposed":
        if t.dim() < 2:
            return None
        return t.transpose(0, -1).contiguous().transpose(0, -1)
    if t.shape[0] < 2:
        return None
    return t[:1].clone().expand(t.shape)


def strided_variants(case: Case, *, names: Sequence[str] | None = None,
                     mutated: Sequence[str] = (),
                     kinds: Sequence[str] = VIEW_KINDS) -> Iterator[StridedVariant]:
    """Yield the variants of ``case``: for each tensor argument and each kind, the case with
    that argument (only) replaced by :func:`strided_view`.

    :param names: the op's parameter names, in order (for labels and ``mutated``).
    :param mutated: names of arguments the op mutates (no ``expanded`` view for them).
    :param kinds: the view kinds to make.
    """
    params = list(names) if names is not None else []
    # (position or keyword, argument name, value) of every argument
    slots: list[tuple[int | str, str, Any]] = [
        (i, params[i] if i < len(params) else f"x{i}", v) for i, v in enumerate(case.args)]
    slots += [(key, key, v) for key, v in case.kwargs.items()]
    for where, arg, value in slots:
        if not isinstance(value, torch.Tensor):
            continue
        for kind in kinds:
            if kind == "expanded" and arg in mutated:
                continue
            view = strided_view(value, kind)
            if view is None:
                continue
            if isinstance(where, int):
                args, kwargs = (*case.args[:where], view, *case.args[where + 1:]), dict(case.kwargs)
            else:
                args, kwargs = case.args, {**case.kwargs, where: view}
            yield StridedVariant(f"{arg}-{kind}", arg, kind,
                                 Case(f"{case.name}[{arg}-{kind}]", args, kwargs, case.dtype,
                                      case.atol, case.rtol))


def _contiguous_copy(value: Any) -> Any:
    if not isinstance(value, torch.Tensor):
        return value
    return value.detach().clone(memory_format=torch.contiguous_format)


def _same_layout_copy(value: Any) -> Any:
    """A copy with the same sizes, strides and storage offset (a stride-0 view becomes a
    fresh stride-0 view of its first row)."""
    if not isinstance(value, torch.Tensor):
        return value
    if value.dim() > 0 and value.shape[0] > 1 and value.stride(0) == 0:
        return value[:1].clone().expand(value.shape)
    extent = 1 + sum((s - 1) * st for s, st in zip(value.shape, value.stride(), strict=True)
                     if s > 0)
    offset = value.storage_offset()
    buf = torch.empty(offset + extent, dtype=value.dtype, device=value.device)
    out = buf.as_strided(value.shape, value.stride(), offset)
    out.copy_(value)
    return out


def run_variant(op: Op | str, provider: str, variant: StridedVariant, *,
                check_native: bool = True) -> CaseResult:
    """Run ``provider`` on ``variant``'s views and native on contiguous copies; compare.

    Native runs on the views first. When it rejects them (:class:`opmux.OpInputError`, e.g.
    an op documented to need contiguous state), the provider must decline or reject them too
    (``skip``/``pass``; accepting is a ``fail``). Otherwise the reference is native on
    contiguous copies of the same values; native on the views must match it (when
    ``check_native``), and the provider, given a copy of the views with the same strides,
    must match it in outputs and mutated arguments, or decline in ``supports_args``
    (``skip``). A provider that raises where native succeeds is an ``error``.

    :raises ProviderUnavailableError: when ``op`` has no provider of that name.
    """
    from opmux.core.errors import OpInputError

    the_op, impl = provider_impl(op, provider)
    case = variant.case
    atol, rtol = tolerance(case)
    result = CaseResult(case.name, "pass", atol=atol, rtol=rtol)
    if not impl.supported:
        result.status, result.message = "skip", f"provider unsupported here: {impl.reason}"
        return result
    args = tuple(_same_layout_copy(a) for a in case.args)
    kwargs = {k: _same_layout_copy(v) for k, v in case.kwargs.items()}
    declined = impl.supports_args is not None and not impl.supports_args(*args, **kwargs)
    ref_args = tuple(_contiguous_copy(a) for a in case.args)  # same values, contiguous
    ref_kwargs = {k: _contiguous_copy(v) for k, v in case.kwargs.items()}
    # native on the views first: it defines which layouts the op takes
    n_args = tuple(_same_layout_copy(a) for a in case.args)
    n_kwargs = {k: _same_layout_copy(v) for k, v in case.kwargs.items()}
    try:
        n_got = the_op.native(*n_args, **n_kwargs)
    except OpInputError as exc:
        if declined:
            result.status, result.message = "skip", f"native rejects the views ({exc}); " \
                "the provider declines them"
            return result
        try:
            impl.fn(*args, **kwargs)
        except OpInputError:
            result.message = f"native and {provider!r} both reject the views: {exc}"
            return result
        except Exception as other:
            result.status = "error"
            result.message = (f"native rejects the views ({exc}); provider raised "
                              f"{type(other).__name__}: {other}")
            return result
        result.status = "fail"
        result.message = f"provider {provider!r} accepted views native rejects: {exc}"
        return result
    want = the_op.native(*ref_args, **ref_kwargs)
    problems: list[str] = []
    if provider != NATIVE or check_native:
        problems += [f"native on the views: {p}" for p in compare_outputs(
            the_op, n_got, want, atol=atol, rtol=rtol, args=n_args, kwargs=n_kwargs,
            ref_args=ref_args, ref_kwargs=ref_kwargs)]
    if provider == NATIVE:
        problems = compare_outputs(the_op, n_got, want, atol=atol, rtol=rtol, args=n_args,
                                   kwargs=n_kwargs, ref_args=ref_args, ref_kwargs=ref_kwargs,
                                   result=result)
    elif declined:
        result.status = "skip" if not problems else "fail"
        result.message = "supports_args declined the views" + (
            "\n" + "\n".join(problems) if problems else "")
        return result
    else:
        start = time.perf_counter()
        try:
            got = impl.fn(*args, **kwargs)
        except Exception as exc:
            result.seconds = time.perf_counter() - start
            result.status = "error"
            result.message = f"provider raised {type(exc).__name__}: {exc}"
            return result
        result.seconds = time.perf_counter() - start
        problems += compare_outputs(the_op, got, want, atol=atol, rtol=rtol, args=args,
                                    kwargs=kwargs, ref_args=ref_args, ref_kwargs=ref_kwargs,
                                    result=result)
    if problems:
        result.status, result.message = "fail", "\n".join(problems)
    return result
