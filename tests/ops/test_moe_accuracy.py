"""``fused_moe`` in float32 against a float64 reference of ours.

Shapes and initialisation follow vLLM's CPU MoE test (8 experts, top 4, hidden and
intermediate sizes 128 / 2880, inputs and weights scaled by ``0.5 * sqrt(fan_in)``); the
2880 x 2880 pair is left out to keep memory small on a shared machine. Both the native
reference and the ``grouped`` provider accumulate the weighted sum in float32, in the
input dtype for float32 inputs; they must meet float32's default tolerance against the
exact (float64) result, and stay within a forward error bound scaled by the magnitude of
the summands (so elements that cancel to near zero are judged fairly).
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F

from opmux.ops.moe import fused_moe
from opmux.plugins.cpu.moe_ops import fused_moe_grouped

EPS32 = 2.0 ** -24


def _reference(x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor,
               ids: torch.Tensor, magnitude: bool = False) -> torch.Tensor:
    """Float64, slot by slot (each of a token's k choices, tokens grouped by expert). With
    ``magnitude`` every operand is replaced by its absolute value (and silu(g) by |g|, an
    upper bound), giving the sum of |terms|."""
    cast: Callable[[torch.Tensor], torch.Tensor] = (
        (lambda t: t.double().abs()) if magnitude else (lambda t: t.double()))
    x64, w1_64, w2_64, wt64 = cast(x), cast(w1), cast(w2), cast(weights)
    inter = w2.shape[2]
    out = torch.zeros(x.shape, dtype=torch.float64)
    for j in range(ids.shape[1]):
        for e in ids[:, j].unique().tolist():
            rows = (ids[:, j] == e).nonzero().squeeze(1)
            gate_up = x64[rows] @ w1_64[e].t()
            g, u = gate_up[:, :inter], gate_up[:, inter:]
            act = g * u if magnitude else F.silu(g) * u
            out[rows] += wt64[rows, j:j + 1] * (act @ w2_64[e].t())
    return out


@pytest.mark.parametrize("impl", [fused_moe.native, fused_moe_grouped],
                         ids=["native", "grouped"])
@pytest.mark.parametrize(("tokens", "hidden", "inter"), [
    (1, 128, 128), (64, 128, 128), (256, 128, 128), (1, 128, 2880), (64, 128, 2880),
    (1, 2880, 128), (64, 2880, 128)])
def test_fused_moe_fp32_matches_float64(impl: Callable[..., torch.Tensor], tokens: int,
                                        hidden: int, inter: int) -> None:
    experts, topk = 8, 4
    g = torch.Generator().manual_seed(tokens * 7 + hidden + inter)
    x = torch.randn(tokens, hidden, generator=g) / (0.5 * hidden ** 0.5)
    w1 = torch.randn(experts, 2 * inter, hidden, generator=g) / (0.5 * hidden ** 0.5)
    w2 = torch.randn(experts, hidden, inter, generator=g) / (0.5 * inter ** 0.5)
    scores = torch.softmax(torch.randn(tokens, experts, generator=g), -1)
    weights, ids = torch.topk(scores, topk)
    ids = ids.to(torch.int32)
    want = _reference(x, w1, w2, weights, ids)
    got = impl(x, w1, w2, weights, ids)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got.double(), want, atol=1e-5, rtol=1.3e-6)
    # forward error bound of a float32 evaluation: a few ulps of the summands' magnitude
    # per accumulated term along the longest dot product
    bound = 4 * EPS32 * (hidden + inter + topk) * _reference(x, w1, w2, weights, ids, True)
    excess = (got.double() - want).abs() - bound
    assert float(excess.max()) <= 0.0


def test_fused_moe_repeated_expert_ids_add_up() -> None:
    # a token routed twice to one expert gets both weights (accumulated in float32)
    g = torch.Generator().manual_seed(3)
    x = torch.randn(3, 16, generator=g)
    w1, w2 = torch.randn(2, 12, 16, generator=g), torch.randn(2, 16, 6, generator=g)
    ids = torch.tensor([[1, 1], [0, 1], [0, 0]], dtype=torch.int32)
    weights = torch.tensor([[0.25, 0.5], [0.5, 0.5], [1.0, 2.0]])
    want = _reference(x, w1, w2, weights, ids)
    for impl in (fused_moe.native, fused_moe_grouped):
        torch.testing.assert_close(impl(x, w1, w2, weights, ids).double(), want,
                                   atol=1e-5, rtol=1e-5)
