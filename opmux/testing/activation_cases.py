"""Seeded conformance cases of the activation ops (:mod:`opmux.ops.activation`).

``silu_and_mul`` and ``gelu_and_mul`` run on :data:`GATED_SHAPES`. vLLM's other activation rows
(``fatrelu_and_mul`` ... ``xielu``) get every dtype, several ranks, odd widths, an empty tensor
and strided views (a column slice and a transposed tensor), so providers that decline strided
input are seen declining and those that take it are checked on it."""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import torch

from opmux.testing.case_table import Case, register_cases
from opmux.testing.seeded import DTYPES, seeded_generator, seeded_randn

__all__ = ["GATED_SHAPES", "gelu_and_mul_cases", "register_activation_cases",
           "silu_and_mul_cases"]


def _randn(name: str, shape: Sequence[int], dtype: torch.dtype, scale: float) -> torch.Tensor:
    return seeded_randn(seeded_generator(name), shape, dtype, scale)


#: ``(case name, dtype, shape)`` of the inputs ``[..., 2*d]`` of the gated activations.
GATED_SHAPES: list[tuple[str, torch.dtype, tuple[int, ...]]] = [
    *((f"{tag}-basic", dt, (9, 2 * 64)) for tag, dt in DTYPES),
    ("fp32-odd-d", torch.float32, (5, 2 * 45)),
    ("fp32-3d", torch.float32, (2, 3, 2 * 40)),
    ("fp32-wide", torch.float32, (3, 2 * 1100)),
    ("bf16-3d", torch.bfloat16, (2, 5, 2 * 24)),
    ("fp32-empty", torch.float32, (0, 2 * 16))]


def _activation_cases(with_approximate: bool) -> Iterator[Case]:
    for name, dt, shape in GATED_SHAPES:
        x = seeded_randn(seeded_generator(name), shape, dt, scale=3.0)
        if with_approximate:
            for approx in ("none", "tanh"):
                yield Case(f"{name}-{approx}", (x, approx))
        else:
            yield Case(name, (x,))


def silu_and_mul_cases() -> Iterator[Case]:
    """Cases of ``silu_and_mul``."""
    return _activation_cases(False)


def gelu_and_mul_cases() -> Iterator[Case]:
    """Cases of ``gelu_and_mul`` (both approximations)."""
    return _activation_cases(True)


def _gated_inputs(op: str, scale: float) -> Iterator[tuple[str, torch.Tensor]]:
    for name, dt, shape in [*GATED_SHAPES, ("fp32-one-row", torch.float32, (2 * 32,))]:
        yield name, _randn(f"{op}-{name}", shape, dt, scale)
    wide = _randn(f"{op}-slice", (6, 2 * 48 + 10), torch.float32, scale)
    yield "fp32-column-slice", wide[:, 3:3 + 2 * 48]
    yield "fp32-transposed", _randn(f"{op}-t", (2 * 20, 7), torch.float32, scale).t()


def fatrelu_and_mul_cases() -> Iterator[Case]:
    """Cases of ``fatrelu_and_mul``: thresholds 0, positive, negative; ties at the threshold."""
    for name, x in _gated_inputs("fatrelu_and_mul", 2.0):
        yield Case(f"{name}-t0", (x, 0.0))
    for threshold in (0.5, -0.25):
        x = _randn(f"fatrelu-{threshold}", (7, 2 * 40), torch.float32, 2.0)
        x[:, ::5] = threshold  # exactly at the threshold: zeroed
        yield Case(f"fp32-threshold{threshold}", (x, threshold))
        yield Case(f"bf16-threshold{threshold}", (x.to(torch.bfloat16), threshold))


def mul_and_silu_cases() -> Iterator[Case]:
    """Cases of ``mul_and_silu``."""
    for name, x in _gated_inputs("mul_and_silu", 3.0):
        yield Case(name, (x,))


def gelu_and_mul_sparse_cases() -> Iterator[Case]:
    """Cases of ``gelu_and_mul_sparse``: Gemma-3n's 0.95, 0.5, both GELU forms."""
    for name, x in _gated_inputs("gelu_and_mul_sparse", 1.0):
        for approx in ("none", "tanh"):
            yield Case(f"{name}-{approx}-p0.95", (x, 0.95, approx))
    x = _randn("sparse-p0.5", (6, 2 * 96), torch.float32, 1.0)
    yield Case("fp32-p0.5", (x, 0.5, "tanh"))
    yield Case("fp32-p0.1", (x, 0.1, "none"))
    x = torch.ones(3, 2 * 16)  # constant gate: std 0, everything at the cutoff
    yield Case("fp32-constant-gate", (x, 0.95, "none"))


def swigluoai_and_mul_cases() -> Iterator[Case]:
    """Cases of ``swigluoai_and_mul``: values beyond ``limit`` on both sides."""
    for name, x in _gated_inputs("swigluoai_and_mul", 5.0):
        yield Case(name, (x, 1.702, 7.0))
    x = _randn("swiglu-small-limit", (5, 2 * 33), torch.float32, 3.0)
    yield Case("fp32-alpha1-limit2", (x, 1.0, 2.0))
    yield Case("bf16-alpha1-limit2", (x.to(torch.bfloat16), 1.0, 2.0))


def _unary_inputs(op: str, scale: float) -> Iterator[tuple[str, torch.Tensor]]:
    specs: list[tuple[str, torch.dtype, tuple[int, ...]]] = [
        (f"{tag}-basic", dt, (9, 130)) for tag, dt in DTYPES]
    specs += [("fp32-1d", torch.float32, (257,)),
              ("fp32-3d", torch.float32, (2, 3, 50)),
              ("bf16-large", torch.bfloat16, (4, 4096)),
              ("fp32-empty", torch.float32, (0, 16))]
    for name, dt, shape in specs:
        yield name, _randn(f"{op}-{name}", shape, dt, scale)
    yield "fp32-wide-values", _randn(f"{op}-wide", (5, 64), torch.float32, 12.0)
    yield "fp32-transposed", _randn(f"{op}-t", (33, 6), torch.float32, scale).t()
    yield "fp32-scalar", torch.tensor(0.75)


def _unary_cases(op: str) -> Iterator[Case]:
    for name, x in _unary_inputs(op, 3.0):
        yield Case(name, (x,))


def gelu_new_cases() -> Iterator[Case]:
    """Cases of ``gelu_new``."""
    return _unary_cases("gelu_new")


def gelu_fast_cases() -> Iterator[Case]:
    """Cases of ``gelu_fast``."""
    return _unary_cases("gelu_fast")


def quick_gelu_cases() -> Iterator[Case]:
    """Cases of ``quick_gelu``."""
    return _unary_cases("quick_gelu")


def relu2_cases() -> Iterator[Case]:
    """Cases of ``relu2``."""
    return _unary_cases("relu2")


def _xielu_params(dtype: torch.dtype, alpha_p: float = 0.8, alpha_n: float = 0.8,
                  beta: float = 0.5) -> tuple[torch.Tensor, torch.Tensor]:
    # the layer's raw parameters: inverse softplus of the initial values, shape [1]
    ap = torch.log(torch.exp(torch.tensor(alpha_p, dtype=dtype)) - 1).unsqueeze(0)
    an = torch.log(torch.exp(torch.tensor(alpha_n - beta, dtype=dtype)) - 1).unsqueeze(0)
    return ap, an


def xielu_cases() -> Iterator[Case]:
    """Cases of ``xielu``: parameters in the input's dtype, bf16 parameters with fp32 input
    (vLLM's default parameter dtype), fp16 input with bf16 parameters (result promoted to
    fp32), values around 0 and ``eps``."""
    eps_bf16 = float(torch.tensor(-1e-6, dtype=torch.bfloat16))
    for name, x in _unary_inputs("xielu", 2.0):
        ap, an = _xielu_params(x.dtype)
        yield Case(name, (x, ap, an, 0.5, eps_bf16))
    x = _randn("xielu-mixed", (7, 96), torch.float32, 2.0)
    ap, an = _xielu_params(torch.bfloat16, 1.2, 0.4, 0.25)
    yield Case("fp32-bf16-params", (x, ap, an, 0.25, eps_bf16))
    yield Case("fp16-bf16-params", (x.to(torch.float16), ap, an, 0.25, eps_bf16))
    small = torch.linspace(-1e-3, 1e-3, 101)
    yield Case("fp32-near-zero", (small, *_xielu_params(torch.float32), 0.5, -1e-6))


def register_activation_cases() -> None:
    """Register the generators above, ``<op>_cases`` for op ``<op>`` (replacing earlier
    ones)."""
    for generator in (silu_and_mul_cases, gelu_and_mul_cases, fatrelu_and_mul_cases,
                      mul_and_silu_cases, gelu_and_mul_sparse_cases, swigluoai_and_mul_cases,
                      gelu_new_cases, gelu_fast_cases, quick_gelu_cases, relu2_cases, xielu_cases):
        register_cases(generator.__name__.removesuffix("_cases"), generator, replace=True)
