"""Seeded conformance cases of the normalisation ops (:mod:`opmux.ops.layernorm`): ``rms_norm``,
``fused_add_rms_norm``, the Gemma norms and ``rms_norm_gated``.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from opmux.testing.case_table import Case, register_cases
from opmux.testing.seeded import DTYPES, seeded_generator, seeded_randn

__all__ = [
    "fused_add_rms_norm_cases",
    "gemma_fused_add_rms_norm_cases",
    "gemma_rms_norm_cases",
    "register_layernorm_cases",
    "rms_norm_cases",
    "rms_norm_gated_cases",
]


def _norm_inputs() -> Iterator[tuple[str, torch.Tensor, torch.Tensor, float]]:
    specs: list[tuple[str, torch.dtype, tuple[int, ...], float, float]] = [
        (f"{tag}-basic", dt, (13, 128), 1.0, 1e-6) for tag, dt in DTYPES]
    specs += [("fp32-d1000", torch.float32, (4, 1000), 1.0, 1e-6),
              ("fp32-3d", torch.float32, (2, 5, 64), 1.0, 1e-6),
              ("fp32-large-values", torch.float32, (6, 256), 50.0, 1e-6),
              ("fp32-eps1e-2-small-values", torch.float32, (6, 96), 1e-2, 1e-2),
              ("bf16-d4096", torch.bfloat16, (3, 4096), 1.0, 1e-5),
              ("fp16-d2048", torch.float16, (3, 2048), 1.0, 1e-5),
              ("fp32-one-row", torch.float32, (1, 32), 1.0, 1e-6),
              ("fp32-empty", torch.float32, (0, 64), 1.0, 1e-6)]
    for name, dt, shape, scale, eps in specs:
        g = seeded_generator(name)
        x = seeded_randn(g, shape, dt, scale)
        weight = (torch.randn(shape[-1], generator=g) * 0.5 + 1.0).to(dt)
        yield name, x, weight, eps


def rms_norm_cases() -> Iterator[Case]:
    """Cases of ``rms_norm``."""
    for name, x, weight, eps in _norm_inputs():
        yield Case(name, (x, weight, eps))


def fused_add_rms_norm_cases() -> Iterator[Case]:
    """Cases of ``fused_add_rms_norm``."""
    for name, x, weight, eps in _norm_inputs():
        residual = seeded_randn(seeded_generator(name + "-residual"), x.shape, x.dtype, 2.0)
        yield Case(name, (x, residual, weight, eps))


def gemma_rms_norm_cases() -> Iterator[Case]:
    """Cases of ``gemma_rms_norm`` (the norm cases, plus an fp32 weight on bf16 rows)."""
    for name, x, weight, eps in _norm_inputs():
        yield Case(name, (x, weight - 1.0, eps))
    g = seeded_generator("bf16-fp32-weight")
    yield Case("bf16-fp32-weight", (seeded_randn(g, (5, 256), torch.bfloat16),
                                    seeded_randn(g, (256,), torch.float32, 0.3), 1e-6))


def gemma_fused_add_rms_norm_cases() -> Iterator[Case]:
    """Cases of ``gemma_fused_add_rms_norm``."""
    for name, x, weight, eps in _norm_inputs():
        residual = seeded_randn(seeded_generator(name + "-residual"), x.shape, x.dtype, 2.0)
        yield Case(name, (x, residual, weight - 1.0, eps))


def rms_norm_gated_cases() -> Iterator[Case]:
    """Cases of ``rms_norm_gated``: no gate / gate before / after the norm, groups, sigmoid."""
    specs: list[tuple[str, torch.dtype, tuple[int, ...], str, int | None, str]] = []
    for tag, dt in DTYPES:
        for gate in ("none", "before", "after"):
            specs.append((f"{tag}-gate-{gate}", dt, (7, 256), gate, None, "swish"))
        specs.append((f"{tag}-groups64-after", dt, (5, 256), "after", 64, "silu"))
    specs += [("fp32-groups32-before-sigmoid", torch.float32, (4, 128), "before", 32, "sigmoid"),
              ("fp32-3d-groups-none", torch.float32, (2, 3, 96), "none", 48, "swish"),
              ("bf16-d2048-groups256", torch.bfloat16, (3, 2048), "after", 256, "swish"),
              ("fp32-odd-d", torch.float32, (3, 45), "before", None, "swish"),
              ("fp32-empty", torch.float32, (0, 64), "after", 16, "swish")]
    for name, dt, shape, gate, group, act in specs:
        g = seeded_generator(name)
        x = seeded_randn(g, shape, dt)
        z = None if gate == "none" else seeded_randn(g, shape, dt, 2.0)
        weight = (torch.randn(shape[-1], generator=g) * 0.5 + 1.0).to(dt)
        yield Case(name, (x, weight, z, 1e-5, group, gate == "before", act))
    g = seeded_generator("bf16-fp32-gate")
    yield Case("bf16-fp32-gate-fp32-weight",
               (seeded_randn(g, (4, 64), torch.bfloat16), seeded_randn(g, (64,), torch.float32),
                seeded_randn(g, (4, 64), torch.float32), 1e-6, None, False, "swish"))


def register_layernorm_cases() -> None:
    """Register the generators above, ``<op>_cases`` for op ``<op>`` (replacing earlier
    ones)."""
    for generator in (rms_norm_cases, fused_add_rms_norm_cases, gemma_rms_norm_cases,
                      gemma_fused_add_rms_norm_cases, rms_norm_gated_cases):
        register_cases(generator.__name__.removesuffix("_cases"), generator, replace=True)
