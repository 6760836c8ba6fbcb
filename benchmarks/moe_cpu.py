"""``fused_moe`` on the CPU: the ``grouped`` provider against the native reference.

Both run in this process on the same inputs (top-k softmax routing of random logits);
the script checks they agree, then prints the best-of-N and median time of each and the
ratio of the bests, for float32 and bfloat16. Target: grouped >= 3x native.
Run: ``python benchmarks/moe_cpu.py [--dtype fp32] [--tokens 64]``.
"""

from __future__ import annotations

import argparse
import statistics
from collections.abc import Callable

import torch
from timing import samples

from opmux.ops.moe import fused_moe, topk_softmax
from opmux.plugins.cpu.moe_ops import fused_moe_grouped

_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def time_ms(fns: list[Callable[[], object]], *, repeats: int) -> list[tuple[float, float]]:
    """``(best, median)`` ms of each function over ``repeats`` runs (on a shared machine
    the best is the stable statistic, the median shows the spread); after one warm-up
    call each, they alternate within every repeat so drift hits both alike."""
    runs = samples({str(i): fn for i, fn in enumerate(fns)}, rounds=repeats, warmup=1)
    return [(min(s) * 1e3, statistics.median(s) * 1e3) for s in runs.values()]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, nargs="+", default=[64, 256, 1024])
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--topk", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--intermediate", type=int, default=512)
    parser.add_argument("--dtype", choices=sorted(_DTYPES), nargs="+", default=["fp32", "bf16"])
    parser.add_argument("--repeats", type=int, default=15)
    args = parser.parse_args()
    worst = float("inf")
    for name in args.dtype:
        worst = min(worst, run(args, name))
    print(f"target >= 3x native: {'met' if worst >= 3 else 'MISSED'} (worst {worst:.2f}x)")


def run(args: argparse.Namespace, dtype_name: str) -> float:
    """Benchmark one dtype; returns the worst speed-up over the token counts."""
    dtype = _DTYPES[dtype_name]
    g = torch.Generator().manual_seed(0)
    e, d, i = args.experts, args.hidden, args.intermediate
    w1 = (torch.randn(e, 2 * i, d, generator=g) * d ** -0.5).to(dtype)
    w2 = (torch.randn(e, d, i, generator=g) * i ** -0.5).to(dtype)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {dtype_name}, "
          f"E={e} top-{args.topk} d={d} I={i}, best (median) of {args.repeats}")
    print(f"{'tokens':>7}{'native ms':>20}{'grouped ms':>20}{'speed-up':>10}")
    worst = float("inf")
    for tokens in args.tokens:
        x = torch.randn(tokens, d, generator=g).to(dtype)
        weights, ids = topk_softmax(torch.randn(tokens, e, generator=g), args.topk, True)
        tol = 1e-4 if dtype == torch.float32 else 3e-2
        torch.testing.assert_close(fused_moe_grouped(x, w1, w2, weights, ids),
                                   fused_moe.native(x, w1, w2, weights, ids), atol=tol, rtol=tol)
        call = (x, w1, w2, weights, ids)
        (native, native_med), (grouped, grouped_med) = time_ms([lambda a=call: fused_moe.native(*a),  # type: ignore[misc]
                                   lambda a=call: fused_moe_grouped(*a)],  # type: ignore[misc]
                                  repeats=args.repeats)
        worst = min(worst, native / grouped)
        print(f"{tokens:>7}{native:>11.2f} ({native_med:>6.2f}){grouped:>11.2f} "
              f"({grouped_med:>6.2f}){native / grouped:>9.2f}x")
    return worst


if __name__ == "__main__":
    main()
