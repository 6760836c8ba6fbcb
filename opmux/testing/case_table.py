"""The case table: what a conformance case is, and the one table of case generators per op.

A generator is a function with no arguments returning an iterable of :class:`Case`
objects built on the CPU from fixed seeds (so every run, on every machine, sees the same
inputs); the kit moves them to the device under test. Every generator enters the table
through :func:`register_cases`: the catalog's family modules (``activation_cases``,
``attention_cases``, ...) and plugins that add ops alike. This module imports none of them;
:mod:`opmux.testing.cases` loads the catalog's and answers lookups.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from opmux.core.errors import RegistrationError
from opmux.core.state import runtime

__all__ = ["Case", "CaseGenerator", "check_unique", "generator_for", "register_cases",
           "registered_ops", "unregister_cases"]


@dataclass(frozen=True)
class Case:
    """One set of arguments for an op.

    :ivar name: short id, unique within the op (``"bf16-gqa4-decode"``); used in test ids.
    :ivar args: positional arguments (tensors on the CPU).
    :ivar kwargs: keyword arguments.
    :ivar dtype: dtype whose tolerance applies (default: first floating tensor argument).
    :ivar atol: absolute tolerance override for this case.
    :ivar rtol: relative tolerance override for this case.
    """

    name: str
    args: tuple[Any, ...]
    kwargs: dict[str, Any] = field(default_factory=dict)
    dtype: torch.dtype | None = None
    atol: float | None = None
    rtol: float | None = None

    def materialize(self, device: str | torch.device) -> tuple[tuple[Any, ...], dict[str, Any]]:
        """Fresh copies of the arguments on ``device`` (safe to mutate).

        A strided, non-overlapping tensor keeps its sizes, strides and storage offset (a
        case may hold a cache that is one half of a K/V buffer); an overlapping one
        (expanded) becomes contiguous.
        """
        def move(a: Any) -> Any:
            return _fresh_copy(a, device) if isinstance(a, torch.Tensor) else a

        return tuple(move(a) for a in self.args), {k: move(v) for k, v in self.kwargs.items()}

    def tolerance_dtype(self) -> torch.dtype | None:
        """The dtype that selects the tolerance (``None``: exact comparison)."""
        if self.dtype is not None:
            return self.dtype
        for a in (*self.args, *self.kwargs.values()):
            if isinstance(a, torch.Tensor) and a.is_floating_point():
                return a.dtype
        return None

    def args_with(self, names: Sequence[str], **over: Any) -> list[Any]:
        """The positional arguments, named in order by ``names``, with the ones named in
        ``over`` replaced (to build a bad call from a good case). Trailing names the case
        leaves out (defaulted parameters) stay out unless ``over`` names them."""
        if len(self.args) > len(names):
            raise ValueError(f"case {self.name!r} has {len(self.args)} arguments, "
                             f"{len(names)} names given")
        values = dict(zip(names, self.args, strict=False))
        values.update(over)
        used = max((i + 1 for i, n in enumerate(names) if n in values), default=0)
        return [values[n] for n in names[:used]]


def _fresh_copy(t: torch.Tensor, device: str | torch.device) -> torch.Tensor:
    t = t.detach()
    if t.is_contiguous() or t.numel() == 0 or torch._debug_has_internal_overlap(t) != 0:
        return t.clone(memory_format=torch.contiguous_format).to(device)
    extent = 1 + sum((n - 1) * st for n, st in zip(t.shape, t.stride(), strict=True))
    buf = torch.empty(t.storage_offset() + extent, dtype=t.dtype, device=device)
    out = buf.as_strided(t.shape, t.stride(), t.storage_offset())
    out.copy_(t)
    return out


CaseGenerator = Callable[[], Iterable[Case]]
"""A function returning an op's cases (built on the CPU, deterministic)."""



def _qualify(op_name: str) -> str:
    return op_name if "::" in op_name else f"opmux::{op_name}"


def register_cases(op_name: str, generator: CaseGenerator, *, replace: bool = False) -> None:
    """Register the conformance cases of ``op_name`` (``"ns::name"``; bare = ``opmux::``).

    :param generator: no-argument function returning :class:`Case` objects.
    :param replace: allow replacing an existing generator.
    :raises RegistrationError: when the op already has a generator and ``replace`` is false.
    """
    qualname = _qualify(op_name)
    rt = runtime()
    with rt.lock:
        if qualname in rt.case_generators and not replace:
            raise RegistrationError(
                f"conformance cases for op {qualname!r} are already registered; pass "
                f"replace=True to override them", op=qualname)
        rt.case_generators[qualname] = generator


def unregister_cases(op_name: str) -> None:
    """Remove the generator of ``op_name`` (tests)."""
    rt = runtime()
    with rt.lock:
        rt.case_generators.pop(_qualify(op_name), None)


def generator_for(op_name: str) -> CaseGenerator | None:
    """The generator registered for ``op_name``, or ``None``."""
    return runtime().case_generators.get(_qualify(op_name))


def registered_ops() -> list[str]:
    """Qualified names of the ops that have a generator, sorted."""
    rt = runtime()
    with rt.lock:
        return sorted(rt.case_generators)


def check_unique(qualname: str, what: str, key: str, labels: list[str]) -> None:
    """The generated ``what`` (cases, bad inputs) of op ``qualname`` must not repeat a
    ``key`` (name, label).

    :raises RegistrationError: naming the repeated ones.
    """
    dup = sorted({x for x in labels if labels.count(x) > 1})
    if dup:
        raise RegistrationError(f"{what} of op {qualname!r} repeat {key} {dup}", op=qualname)
