"""Per-call overhead of a runner op against the bare torch.library op it is built on.

Three ways to run the same stateful kernel (a runner holding a bias, adding it):

* ``direct``  : ``runner.run(x)`` — a plain Python call, no torch op at all;
* ``bare``    : an op defined with ``Library.define`` + ``Library.impl`` with the same
  schema ``(int runner_id, Tensor x)`` whose kernel ignores the ID and calls the runner
  captured in a closure (the floor for an op that carries an ID); also shown without
  the ID argument, to show what the ``int`` costs in the torch dispatcher itself;
* ``runner_op``: :func:`opmux.core.runners.register_runner_op` — schema carries
  ``runner_id: int``, the kernel looks the runner up per call. Called both through the
  :class:`opmux.Op` (``op(rid, x)``) and through its ``torch_op``.

Target: runner op <= 1.15x the bare op of the same schema.
Run: ``python benchmarks/runner_op_overhead.py``.
"""

from __future__ import annotations

import argparse
import uuid
from collections.abc import Callable
from typing import Any

import torch
from timing import interleaved_us

from opmux.core.runners import register_runner_op, runner_scope


class BiasRunner:
    """A stateful kernel: holds a bias, adds it."""

    def __init__(self, bias: torch.Tensor) -> None:
        self.bias = bias

    def run(self, x: torch.Tensor) -> torch.Tensor:
        return torch.add(x, self.bias)


def time_interleaved(fns: dict[str, Callable[[], Any]], *, calls: int,
                     repeats: int) -> dict[str, float]:
    """Median µs per call of each function, the functions taking turns in every repeat."""
    return interleaved_us(fns, calls=calls, rounds=repeats, warmup=calls // 10)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=10000)
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--numel", type=int, default=4)
    args = parser.parse_args()
    torch.set_num_threads(1)

    ns = f"opmux_bench_{uuid.uuid4().hex[:8]}"
    x = torch.randn(args.numel)
    runner = BiasRunner(torch.randn(args.numel))

    lib = torch.library.Library(ns, "FRAGMENT")
    lib.define("bare(int runner_id, Tensor x) -> Tensor")
    lib.impl("bare", lambda _rid, t: runner.run(t), "CompositeExplicitAutograd")
    lib.define("bare_no_id(Tensor x) -> Tensor")
    lib.impl("bare_no_id", lambda t: runner.run(t), "CompositeExplicitAutograd")
    bare = getattr(torch.ops, ns).bare.default
    bare_no_id = getattr(torch.ops, ns).bare_no_id.default

    @register_runner_op("runner_add", namespace=ns,
                        fake=lambda runner_id, x: torch.empty_like(x))
    def runner_add(r: BiasRunner, x: torch.Tensor) -> torch.Tensor:
        return r.run(x)

    with runner_scope(runner) as rid:
        runner_add(rid, x)  # first call loads plugins
        expected = runner.run(x)
        torch.testing.assert_close(runner_add(rid, x), expected)
        torch.testing.assert_close(bare(rid, x), expected)
        rows = time_interleaved({
            "direct runner.run(x)": lambda: runner.run(x),
            "bare op, no id argument": lambda: bare_no_id(x),
            "bare Library.define/impl op": lambda: bare(rid, x),
            "runner op via torch_op": lambda: runner_add.torch_op(rid, x),
            "runner op via opmux.Op": lambda: runner_add(rid, x),
        }, calls=args.calls, repeats=args.repeats)
    base = rows["bare Library.define/impl op"]
    print(f"torch {torch.__version__}, 1 thread, {args.numel}-element add, "
          f"median of {args.repeats} x {args.calls} calls")
    print(f"{'path':<32}{'us/call':>10}{'vs bare':>10}")
    for name, us in rows.items():
        print(f"{name:<32}{us:>10.2f}{us / base:>9.2f}x")
    worst = max(rows["runner op via torch_op"], rows["runner op via opmux.Op"]) / base
    print(f"target <= 1.15x bare: {'met' if worst <= 1.15 else 'MISSED'} ({worst:.2f}x)")


if __name__ == "__main__":
    main()
