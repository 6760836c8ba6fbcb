"""The ``grouped`` CPU provider of ``fused_moe``: tokens grouped by expert, pure PyTorch.

The ``cpu`` plugin ranks it after ``cpp`` (:mod:`opmux.plugins.cpu.cpp_moe`), which declines
the float32 batches with many rows per expert: there these BLAS matmuls are faster.

Each (token, slot) pair is sorted by expert id once and the hidden states are gathered in
that order; every expert that received tokens then runs its matmul pair over its
contiguous segment, with the SiLU-and-mul done in place on the segment while it is still
in cache, and one ``embedding_bag`` forms each token's weighted sum over its k rows
straight into the output. The work is k/E of the reference's, which runs every expert on
every token, and there is no per-token Python loop: the only loop is over the experts.

Every dtype computes in float32 (the catalog's numerics rule): the gathered rows are widened
once and each expert's weights as its turn comes (a no-op for float32), and the result is
rounded once to the input dtype at the end.

Two layouts, chosen once per call from the mean segment length:

- *weight-major* (short segments, e.g. decode and small prefill batches): ``w @ x.T``,
  one ``[2I, n]`` then ``[d, n]`` block per expert. With a few rows per expert the
  matmuls only stream the weights, and BLAS does that markedly faster with the weight as
  the left operand (``benchmarks/moe_cpu.py``).
- *token-major* (long segments): ``x @ w.T`` into row blocks, the layout BLAS prefers once
  the matmuls are compute-bound.

When every expert received tokens and the segments are short (small batches), a third
layout, *batched*, pads each segment to the longest one and runs each projection as one
``bmm`` over all experts (weight-major): two batched
matmuls instead of two per expert, so two thread-pool fork/joins instead of 2E. The
padding rows are zeros and never read back. Measured on E=8, d=1024, I=512 at 64 tokens
on 2 contended threads: about half the time of the per-expert loop (medians).

Temporaries are sized by the longest segment and reused across experts, which keeps
fresh memory (and its page faults) per call small. An ``index_add_`` scatter of the
weighted rows took about a fifth of the whole call at 1024 tokens; a gather, multiply and
sum over ``[T, k, d]`` took three passes; ``embedding_bag`` with per-sample weights does
the gather, weighting and reduction in one.
"""

import torch
import torch.nn.functional as F
from torch import Tensor

from opmux.core.errors import OpInputError
from opmux.ops.checks import check_expert_ids, check_fused_moe_args
from opmux.plugins.registration import OpTable, RegistryLike, register_table

__all__ = ["OPS", "PROVIDER", "fused_moe_args_ok", "fused_moe_grouped", "register"]

PROVIDER = "grouped"
"""Provider name of the grouped implementation."""

WEIGHT_MAJOR_MAX_ROWS = 48
"""Mean rows per active expert up to which the weight-major layout is used.

Measured on E=8, d=1024, I=512, float32, 2 threads: weight-major wins clearly at 16 rows
per expert and the two are level at 64.
"""


def _experts_weight_major(x: Tensor, w1: Tensor, w2: Tensor,
                          segments: list[tuple[int, int, int]], longest: int) -> Tensor:
    """Expert MLPs as ``w @ x.T``; returns the ``[rows, d]`` outputs (a transposed view)."""
    rows, hidden = x.shape
    inter = w2.shape[2]
    y_t = torch.empty(hidden, rows, dtype=x.dtype, device=x.device)
    work = torch.empty(2 * inter * longest, dtype=x.dtype, device=x.device)
    for e, start, n in segments:
        gate_up = work[:2 * inter * n].view(2 * inter, n)
        torch.mm(w1[e].float(), x[start:start + n].t(), out=gate_up)
        act = F.silu(gate_up[:inter], inplace=True).mul_(gate_up[inter:])
        torch.mm(w2[e].float(), act, out=y_t[:, start:start + n])
    return y_t.t()


def _experts_token_major(x: Tensor, w1: Tensor, w2: Tensor,
                         segments: list[tuple[int, int, int]], longest: int) -> Tensor:
    """Expert MLPs as ``x @ w.T``; returns the ``[rows, d]`` outputs."""
    rows, hidden = x.shape
    inter = w2.shape[2]
    y = torch.empty(rows, hidden, dtype=x.dtype, device=x.device)
    gate_up = torch.empty(longest, 2 * inter, dtype=x.dtype, device=x.device)
    act = torch.empty(longest, inter, dtype=x.dtype, device=x.device)
    for e, start, n in segments:
        torch.mm(x[start:start + n], w1[e].float().t(), out=gate_up[:n])
        torch.mul(F.silu(gate_up[:n, :inter], inplace=True), gate_up[:n, inter:],
                  out=act[:n])
        torch.mm(act[:n], w2[e].float().t(), out=y[start:start + n])
    return y


def _experts_batched(x: Tensor, w1: Tensor, w2: Tensor, sorted_ids: Tensor,
                     counts: list[int], longest: int) -> tuple[Tensor, Tensor]:
    """All experts at once over segments padded to ``longest`` rows.

    :returns: ``(y [E * longest, d], row)``: the padded outputs and, for each sorted row,
        its row in ``y``.
    """
    rows, hidden = x.shape
    experts = w1.shape[0]
    inter = w2.shape[2]
    starts = torch.tensor([0, *counts[:-1]], device=x.device).cumsum(0)
    row = sorted_ids * longest + (torch.arange(rows, device=x.device) - starts[sorted_ids])
    padded = x.new_zeros(experts * longest, hidden).index_copy_(0, row, x)
    padded = padded.view(experts, longest, hidden)
    gate_up = torch.bmm(w1.float(), padded.transpose(1, 2))  # [E, 2I, L]
    act = F.silu(gate_up[:, :inter], inplace=True).mul_(gate_up[:, inter:])
    y = torch.bmm(w2.float(), act).transpose(1, 2)  # [E, L, d] (a view)
    return y.reshape(experts * longest, hidden), row


@torch.no_grad()
def fused_moe_grouped(hidden_states: Tensor, w1: Tensor, w2: Tensor, topk_weights: Tensor,
                      topk_ids: Tensor) -> Tensor:
    """``fused_moe`` with tokens grouped by expert; see :func:`opmux.ops.moe.fused_moe`.

    An inference kernel: it writes into preallocated buffers (``out=``), which autograd
    refuses for weights that require grad, so it runs without building a graph (the op has
    no backward registered either way).
    """
    tokens, hidden = hidden_states.shape
    experts = w1.shape[0]
    dtype = hidden_states.dtype
    top_k = topk_ids.shape[1]
    if tokens == 0 or top_k == 0:
        return torch.zeros(tokens, hidden, dtype=dtype, device=hidden_states.device)
    sorted_ids, order = torch.sort(topk_ids.reshape(-1), stable=True)
    lo, hi = sorted_ids[[0, -1]].tolist()  # one sync for both extremes
    # the ids are data, which the predicate does not read
    check_expert_ids(PROVIDER, lo, hi, experts)
    counts = torch.bincount(sorted_ids, minlength=experts).tolist()

    rows = order.numel()
    x = hidden_states.index_select(0, order // top_k).float()  # [rows, d], grouped by expert
    segments = []
    start = 0
    for e, n in enumerate(counts):
        if n:
            segments.append((e, start, n))
            start += n
    longest = max(counts)
    short = rows <= WEIGHT_MAJOR_MAX_ROWS * len(segments)
    inverse = torch.empty_like(order)
    if short and len(segments) == experts:
        y, row = _experts_batched(x, w1, w2, sorted_ids, counts, longest)
        inverse[order] = row
    else:
        if short:
            y = _experts_weight_major(x, w1, w2, segments, longest)
        else:
            y = _experts_token_major(x, w1, w2, segments, longest)
        inverse[order] = torch.arange(rows, device=order.device)

    # each token's weighted sum over its k rows (in y's layout), in float32
    rows_f32 = y.contiguous()
    out = F.embedding_bag(inverse.view(tokens, top_k), rows_f32, mode="sum",
                          per_sample_weights=topk_weights.to(torch.float32))
    return out if dtype == torch.float32 else out.to(dtype)


def fused_moe_args_ok(hidden_states: Tensor, w1: Tensor, w2: Tensor, topk_weights: Tensor,
                      topk_ids: Tensor) -> bool:
    """Whether ``fused_moe``'s arguments pass native's static check (shapes, dtypes, devices;
    no data read): the acceptance test of the CPU providers of ``fused_moe``."""
    try:
        check_fused_moe_args(PROVIDER, hidden_states, w1, w2, topk_weights, topk_ids)
    except OpInputError:
        return False
    return True


OPS: OpTable = {"fused_moe": (fused_moe_grouped, fused_moe_args_ok)}
"""Op name -> (impl, supports_args) of the ``grouped`` provider."""


def register(registry: RegistryLike, dispatch_key: str = "CPU") -> list[str]:
    """Register provider ``grouped`` of ``fused_moe``; returns the ``op:provider`` pairs."""
    return register_table(registry, PROVIDER, dispatch_key, OPS)
