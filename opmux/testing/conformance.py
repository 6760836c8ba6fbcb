"""The conformance kit: run a provider and the native reference on the same inputs, compare.

>>> import opmux
>>> from opmux.testing import check_provider
>>> report = check_provider("rms_norm", "cpp")          # doctest: +SKIP
>>> report.ok, len(report.cases)                        # doctest: +SKIP
(True, 11)

For each case the provider's implementation (``op.impls[provider]``, called directly) runs
on the device under test and native runs on fresh copies of the same inputs (on the CPU
by default). Outputs and every mutated argument are compared: floating tensors within the
dtype's tolerance (``|got - want| <= atol + rtol * |want|``, NaN where the reference has
NaN), everything else exactly. The provider call runs with the output checks of
:mod:`opmux.core.output_checks` on: a result that disagrees with the op's fake (dtype,
shape, device, structure) or a change to an argument outside ``mutates_args`` is an error.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any, Final

import torch

from opmux.core.errors import ProviderOutputError, ProviderUnavailableError
from opmux.core.op import NATIVE, Op
from opmux.core.output_checks import checked
from opmux.testing.cases import Case, cases_for, has_cases

if TYPE_CHECKING:
    from opmux.core.op import OpImpl

__all__ = [
    "TOLERANCES",
    "CaseResult",
    "ProviderReport",
    "check_provider",
    "compare_outputs",
    "provider_impl",
    "run_case",
    "run_opcheck",
    "tolerance",
]

TOLERANCES: Final[dict[torch.dtype, tuple[float, float]]] = {
    torch.float64: (1e-7, 1e-7),
    torch.float32: (1e-4, 1e-4),
    torch.float16: (5e-3, 5e-3),
    torch.bfloat16: (3e-2, 3e-2),
}
"""``dtype -> (atol, rtol)`` used unless a case overrides them."""


def tolerance(case: Case) -> tuple[float, float]:
    """The ``(atol, rtol)`` of ``case``: its overrides, else its dtype's; ``(0, 0)`` = exact."""
    dtype = case.tolerance_dtype()
    atol, rtol = TOLERANCES.get(dtype, (0.0, 0.0)) if dtype is not None else (0.0, 0.0)
    return (case.atol if case.atol is not None else atol,
            case.rtol if case.rtol is not None else rtol)


@dataclass
class CaseResult:
    """Outcome of one case: ``status`` is ``pass``, ``fail``, ``error`` or ``skip``."""

    name: str
    status: str
    max_abs: float = 0.0
    max_rel: float = 0.0
    #: worst ``|got - want| / (atol + rtol*|want|)``; at most 1 passes.
    ratio: float = 0.0
    atol: float = 0.0
    rtol: float = 0.0
    message: str = ""
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        return self.status in ("pass", "skip")

    def describe(self) -> str:
        """One paragraph: status, errors vs tolerance, and the message."""
        head = (f"{self.status}: max abs err {self.max_abs:.3g}, max rel err "
                f"{self.max_rel:.3g} (atol {self.atol:g}, rtol {self.rtol:g}, "
                f"worst err/tolerance {self.ratio:.3g})")
        return head + (f"\n{self.message}" if self.message else "")


@dataclass
class ProviderReport:
    """What :func:`check_provider` found for one op and provider."""

    op: str
    provider: str
    device: str
    #: ``checked``, ``unsupported`` (static ``supported=False``) or ``no-cases``.
    status: str
    cases: list[CaseResult] = field(default_factory=list)
    reason: str = ""

    @property
    def ok(self) -> bool:
        """No case failed or raised."""
        return all(c.ok for c in self.cases)

    @property
    def counts(self) -> dict[str, int]:
        out = {"pass": 0, "fail": 0, "error": 0, "skip": 0}
        for c in self.cases:
            out[c.status] += 1
        return out

    def verdict(self) -> str:
        """``PASS``, ``FAIL``, ``SKIP`` (no case ran) or ``UNSUPPORTED``."""
        if self.status == "unsupported":
            return "UNSUPPORTED"
        if not self.ok:
            return "FAIL"
        return "PASS" if self.counts["pass"] else "SKIP"

    def as_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["ok"], d["verdict"] = self.ok, self.verdict()
        return d

    def format(self) -> str:
        """An aligned table of the cases."""
        lines = [f"{self.op} provider {self.provider!r} on {self.device}: {self.verdict()}"
                 + (f" ({self.reason})" if self.reason else "")]
        if self.cases:
            width = max(len(c.name) for c in self.cases)
            lines.append(f"  {'case':<{width}}  status  {'max abs':>9}  {'max rel':>9}  "
                         f"{'err/tol':>8}")
            for c in self.cases:
                lines.append(f"  {c.name:<{width}}  {c.status:<6}  {c.max_abs:>9.3g}  "
                             f"{c.max_rel:>9.3g}  {c.ratio:>8.3g}"
                             + (f"  {c.message.splitlines()[0]}" if c.status != "pass"
                                and c.message else ""))
        return "\n".join(lines)


def _resolve(op: Op | str) -> Op:
    if isinstance(op, Op):
        return op
    from opmux.core.registry import get_op

    return get_op(op)


def provider_impl(op: Op | str, provider: str) -> tuple[Op, OpImpl]:
    """The op and its provider ``provider``.

    :param op: an :class:`~opmux.Op` or an op name (``"rms_norm"``, ``"ns::name"``).
    :raises ProviderUnavailableError: when ``op`` has no provider of that name (the message
        lists the registered ones).
    """
    the_op = _resolve(op)
    impl = the_op.impls.get(provider)
    if impl is None:
        raise ProviderUnavailableError(
            f"op {the_op.qualname!r} has no provider {provider!r}; registered: "
            f"{sorted(p for p in the_op.impls if p != NATIVE)}")
    return the_op, impl


def _flatten(value: Any, prefix: str) -> list[tuple[str, Any]]:
    if isinstance(value, (tuple, list)):
        return [item for i, v in enumerate(value) for item in _flatten(v, f"{prefix}[{i}]")]
    return [(prefix, value)]


def _compare(label: str, got: Any, want: Any, atol: float, rtol: float,
             result: CaseResult) -> list[str]:
    """Compare one leaf; update the error maxima of ``result``; return problems found."""
    if not isinstance(want, torch.Tensor):
        if isinstance(got, torch.Tensor) or got != want:
            return [f"{label}: expected {want!r}, got {got!r}"]
        return []
    if not isinstance(got, torch.Tensor):
        return [f"{label}: expected a tensor, got {type(got).__name__}"]
    if got.shape != want.shape:
        return [f"{label}: expected shape {list(want.shape)}, got {list(got.shape)}"]
    if got.dtype != want.dtype:
        return [f"{label}: expected dtype {want.dtype}, got {got.dtype}"]
    g, w = got.detach().cpu(), want.detach().cpu()
    if not w.is_floating_point():
        bad = int((g != w).sum())
        if bad:
            first = tuple(int(i) for i in (g != w).nonzero()[0])
            return [f"{label}: {bad} of {w.numel()} elements differ (exact comparison); first "
                    f"at {list(first)}: expected {w[first].item()}, got {g[first].item()}"]
        return []
    if w.numel() == 0:
        return []
    g64, w64 = g.double(), w.double()
    nan_want, nan_got = torch.isnan(w64), torch.isnan(g64)
    problems = []
    if not torch.equal(nan_want, nan_got):
        problems.append(f"{label}: NaN pattern differs ({int(nan_got.sum())} NaN in the "
                        f"result, {int(nan_want.sum())} in the reference)")
    finite = ~(nan_want | nan_got)
    diff = (g64 - w64).abs()
    diff = torch.where(finite & (g64 == w64), torch.zeros_like(diff), diff)  # equal infs
    diff = torch.where(finite, diff, torch.zeros_like(diff))
    bound = atol + rtol * w64.abs()
    ratio = diff / bound if atol + rtol > 0 else torch.where(diff > 0, math.inf, 0.0)
    max_abs = float(diff.max())
    nonzero = w64.abs() > 0
    max_rel = float((diff[nonzero] / w64.abs()[nonzero]).max()) if bool(nonzero.any()) \
        else 0.0
    worst = float(ratio.max())
    result.max_abs = max(result.max_abs, max_abs)
    result.max_rel = max(result.max_rel, max_rel)
    result.ratio = max(result.ratio, worst)
    if worst > 1.0:
        beyond = ratio > 1.0
        idx = tuple(int(i) for i in beyond.nonzero()[0])
        problems.append(f"{label}: {int(beyond.sum())} of {w.numel()} elements beyond tolerance; "
                        f"first at {list(idx)}: expected {w64[idx].item():.6g}, got "
                        f"{g64[idx].item():.6g}")
    return problems


def compare_outputs(op: Op | str, got: Any, want: Any, *, atol: float, rtol: float,
                    args: Sequence[Any] = (), kwargs: dict[str, Any] | None = None,
                    ref_args: Sequence[Any] = (), ref_kwargs: dict[str, Any] | None = None,
                    result: CaseResult | None = None) -> list[str]:
    """What differs between a provider's call of ``op`` and native's, one line per problem.

    Outputs are compared leaf by leaf (tuples and lists flattened): other values exactly;
    tensors by shape and dtype, then integer tensors exactly and floating ones within
    ``atol + rtol * |want|`` with NaN in the same places. The arguments ``op`` mutates are
    compared the same way, from the provider's call (``args``, ``kwargs``) against native's
    (``ref_args``, ``ref_kwargs``).

    :param got: the provider's output; ``want``: native's.
    :param result: when given, its ``max_abs``, ``max_rel`` and ``ratio`` are raised to the
        largest errors seen.
    :returns: the problems found (empty: they agree).
    """
    the_op = _resolve(op)
    kwargs = kwargs or {}
    ref_kwargs = ref_kwargs or {}
    result = result if result is not None else CaseResult("", "pass")
    got_leaves, want_leaves = _flatten(got, "output"), _flatten(want, "output")
    problems = [p for (label, g), (_, w) in zip(got_leaves, want_leaves, strict=False)
                for p in _compare(label, g, w, atol, rtol, result)]
    if len(got_leaves) != len(want_leaves):
        problems.append(f"output: expected {len(want_leaves)} values, got {len(got_leaves)}")
    params = list(the_op.signature.parameters)
    for name in the_op.mutates_args:
        i = params.index(name)
        g_arg = args[i] if i < len(args) else kwargs[name]
        w_arg = ref_args[i] if i < len(ref_args) else ref_kwargs[name]
        problems += _compare(f"mutated argument {name!r}", g_arg, w_arg, atol, rtol, result)
    return problems


def run_case(op: Op | str, provider: str, case: Case, device: str | torch.device = "cpu", *,
             reference_device: str | torch.device | None = "cpu") -> CaseResult:
    """Run one case on ``provider`` and on native, and compare.

    :param reference_device: where native runs (``None``: the same device as the provider).
    :raises ProviderUnavailableError: when ``op`` has no provider of that name.
    """
    the_op, impl = provider_impl(op, provider)
    atol, rtol = tolerance(case)
    result = CaseResult(case.name, "pass", atol=atol, rtol=rtol)
    if not impl.supported:
        result.status, result.message = "skip", f"provider unsupported here: {impl.reason}"
        return result
    args, kwargs = case.materialize(device)
    if impl.supports_args is not None and not impl.supports_args(*args, **kwargs):
        result.status, result.message = "skip", "supports_args rejected these arguments"
        return result
    ref_args, ref_kwargs = case.materialize(reference_device or device)
    start = time.perf_counter()
    try:
        got = checked(the_op, impl)(*args, **kwargs)
    except ProviderOutputError as exc:
        result.status, result.message = "fail", str(exc)
        return result
    except Exception as exc:
        result.status = "error"
        result.message = f"provider raised {type(exc).__name__}: {exc}"
        return result
    finally:
        result.seconds = time.perf_counter() - start
    want = the_op.native(*ref_args, **ref_kwargs)
    problems = compare_outputs(the_op, got, want, atol=atol, rtol=rtol, args=args,
                               kwargs=kwargs, ref_args=ref_args, ref_kwargs=ref_kwargs,
                               result=result)
    if problems:
        result.status, result.message = "fail", "\n".join(problems)
    return result


def check_provider(op: Op | str, provider: str, device: str | torch.device = "cpu", *,
                   cases: Iterable[Case] | None = None,
                   reference_device: str | torch.device | None = "cpu") -> ProviderReport:
    """Check ``provider`` of ``op`` against native over the op's conformance cases.

    :param op: an :class:`~opmux.Op` or an op name (``"rms_norm"``, ``"ns::name"``).
    :param provider: the provider name, as in ``op.impls``.
    :param device: where the provider runs.
    :param cases: cases to use (default: the op's registered generator).
    :param reference_device: where native runs (default CPU; ``None`` = ``device``).
    :returns: a :class:`ProviderReport`; ``report.ok`` is false when any case failed.
    :raises ProviderUnavailableError: when ``op`` has no provider of that name.
    """
    the_op, impl = provider_impl(op, provider)
    report = ProviderReport(the_op.qualname, provider, str(device), "checked")
    if not impl.supported:
        report.status, report.reason = "unsupported", impl.reason or "supported=False"
        return report
    if cases is None:
        if not has_cases(the_op.qualname):
            report.status = "no-cases"
            report.reason = (f"no conformance cases registered for {the_op.qualname!r} "
                             f"(opmux.testing.register_cases)")
            return report
        cases = cases_for(the_op.qualname)
    for case in cases:
        report.cases.append(run_case(the_op, provider, case, device,
                                     reference_device=reference_device))
    return report


def run_opcheck(op: Op | str, *, cases: Sequence[Case] | None = None,
                test_utils: Sequence[str] | None = None) -> dict[str, dict[str, str]]:
    """Run :func:`torch.library.opcheck` on ``op``'s torch op for every case.

    :param test_utils: opcheck's tests (default: all of them).
    :returns: ``{case name: opcheck result}``.
    :raises AssertionError: naming the case, when opcheck finds a problem.
    """
    the_op = _resolve(op)
    chosen = list(cases) if cases is not None else cases_for(the_op.qualname)
    results: dict[str, dict[str, str]] = {}
    for case in chosen:
        args, kwargs = case.materialize("cpu")
        try:
            if test_utils is None:
                results[case.name] = torch.library.opcheck(the_op.torch_op, args, kwargs)
            else:
                results[case.name] = torch.library.opcheck(the_op.torch_op, args, kwargs,
                                                           test_utils=tuple(test_utils))
        except Exception as exc:
            raise AssertionError(f"opcheck of {the_op.qualname} failed on case "
                                 f"{case.name!r}: {exc}") from exc
    return results
