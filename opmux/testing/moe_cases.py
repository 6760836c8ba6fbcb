"""Seeded conformance cases for the mixture-of-experts ops (``opmux.ops.moe``)."""

from __future__ import annotations

from collections.abc import Iterator

import torch

from opmux.testing.case_table import Case, register_cases
from opmux.testing.seeded import DTYPES, seeded_generator

__all__ = ["register_moe_cases"]



def topk_softmax_cases() -> Iterator[Case]:
    """Cases of ``topk_softmax``: several k, with and without renormalisation."""
    for tag, dt in DTYPES:
        for k, renorm in ((2, True), (1, False), (4, False)):
            name = f"{tag}-top{k}-{'renorm' if renorm else 'raw'}"
            logits = (torch.randn(11, 16, generator=seeded_generator(name)) * 2).to(dt)
            yield Case(name, (logits, k, renorm), dtype=torch.float32)
    yield Case("fp32-empty", (torch.zeros(0, 8), 2, True))


def grouped_topk_cases() -> Iterator[Case]:
    """Cases of ``grouped_topk``: softmax/sigmoid scoring, with a correction bias."""
    specs = [("fp32-softmax", torch.float32, "softmax", False, 1.0),
             ("fp32-sigmoid-bias", torch.float32, "sigmoid", True, 2.5),
             ("bf16-softmax", torch.bfloat16, "softmax", False, 1.0),
             ("bf16-sigmoid-bias", torch.bfloat16, "sigmoid", True, 1.0)]
    for name, dt, scoring, bias, factor in specs:
        g = seeded_generator(name)
        logits = torch.randn(9, 32, generator=g).to(dt)
        b = torch.randn(32, generator=g) * 0.1 if bias else None
        yield Case(name, (logits, 4, True, 8, 3, scoring, b, factor), dtype=torch.float32)


def fused_moe_cases() -> Iterator[Case]:
    """Cases of ``fused_moe``: top-1/top-2, int32/int64 ids, unused experts, empty batch."""
    specs = [(f"{tag}-top2", dt, 7, 2, torch.int32) for tag, dt in DTYPES]
    specs += [("fp32-top1-int64", torch.float32, 5, 1, torch.int64),
              ("fp32-empty", torch.float32, 0, 2, torch.int32)]
    for name, dt, tokens, k, id_dtype in specs:
        g = seeded_generator(name)
        experts, hidden, inter = 8, 64, 32
        x = torch.randn(tokens, hidden, generator=g).to(dt)
        w1 = (torch.randn(experts, 2 * inter, hidden, generator=g) * hidden ** -0.5).to(dt)
        w2 = (torch.randn(experts, hidden, inter, generator=g) * inter ** -0.5).to(dt)
        ids = torch.stack([torch.randperm(experts - 2, generator=g)[:k] for _ in range(tokens)]
                          ) if tokens else torch.zeros(0, k, dtype=torch.int64)
        weights = torch.softmax(torch.randn(tokens, k, generator=g), dim=-1)
        yield Case(name, (x, w1, w2, weights, ids.to(id_dtype)))


def register_moe_cases() -> None:
    """Register the generators above, ``<op>_cases`` for op ``<op>`` (replacing earlier
    ones)."""
    for generator in (topk_softmax_cases, grouped_topk_cases, fused_moe_cases):
        register_cases(generator.__name__.removesuffix("_cases"), generator, replace=True)
