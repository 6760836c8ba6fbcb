"""Per-call overhead of opmux dispatch on a 4-element add, against baselines run here.

Prints µs/call (median of repeats) and ratios: opmux (torch wrap on) vs a bare
``Library.define/impl`` op, opmux (wrap off) vs a plain call of the chosen provider,
both vs ``torch.library.custom_op``. Each with 1 provider and with 3 providers (the first
with a ``supports_args`` that declines, so the second runs), and the same 3 providers with a
tuned table that orders them per size bucket (what ``opmux tune`` writes; the call's bucket
has the same order, so the difference is the cost of picking the bucket). A second bare op
runs the same predicate itself before its add: what a hand-written op making the same choice
costs, so the three-provider ratio can be read without the predicate's own price.

    python benchmarks/dispatch_overhead.py [--number 500] [--repeat 400]

Many short samples (500 calls each): on a shared machine a preemption spoils a few samples,
which the median drops, instead of a large part of a long one.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any

import torch
from timing import interleaved_us

import opmux
from opmux.core.dispatch import SIZE_BUCKETS, bucket_of


def _time_all(cases: dict[str, Callable[[], Any]], number: int, repeat: int) -> dict[str, float]:
    """Median µs/call per case; rounds interleave the cases so load spikes hit all alike."""
    return interleaved_us(cases, calls=number, rounds=repeat, warmup=200)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--number", type=int, default=500)
    parser.add_argument("--repeat", type=int, default=400)
    ns = parser.parse_args()
    torch.set_num_threads(1)
    x, y = torch.ones(4), torch.ones(4)

    def add(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return torch.add(x, y)

    lib = torch.library.Library("opmux_bench_bare", "FRAGMENT")
    lib.define("add(Tensor x, Tensor y) -> Tensor")
    lib.impl("add", add, "CPU")
    bare = torch.ops.opmux_bench_bare.add.default

    def declines(x: torch.Tensor, y: torch.Tensor) -> bool:
        return x.dtype == torch.float64

    def picky_add(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        if declines(x, y):  # the first provider's choice, made by the op itself
            return torch.add(x, y)
        return add(x, y)

    lib.define("picky_add(Tensor x, Tensor y) -> Tensor")
    lib.impl("picky_add", picky_add, "CPU")
    bare_picky = torch.ops.opmux_bench_bare.picky_add.default

    @torch.library.custom_op("opmux_bench_co::add", mutates_args=())
    def co_add(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return torch.add(x, y)

    registry = opmux.OpRegistry()
    one = opmux.register_op(name="add1", namespace="opmux_bench", registry=registry)(add)
    one.register_impl("fast", dispatch_key="CPU")(add)
    three = opmux.register_op(name="add3", namespace="opmux_bench", registry=registry)(add)
    three.register_impl("picky", dispatch_key="CPU", supports_args=declines)(add)
    three.register_impl("second", dispatch_key="CPU")(add)
    three.register_impl("third", dispatch_key="CPU")(add)
    three.set_default_priority(["picky", "second", "third"])
    assert one.dispatch(x, y).provider == "fast" and three.dispatch(x, y).provider == "second"
    sized = opmux.register_op(name="add3_sized", namespace="opmux_bench", registry=registry)(add)
    for name, pred in (("picky", declines), ("second", None), ("third", None)):
        sized.register_impl(name, dispatch_key="CPU", supports_args=pred)(add)
    # the tuned layer as start-up sets it from a file: x's bucket (numel 4) keeps the order
    # of `three`, every other bucket prefers "third"
    per_bucket = [["third", "second"]] * SIZE_BUCKETS
    per_bucket[bucket_of(x.numel())] = ["picky", "second", "third"]
    sized.priorities.set_tuned(["third", "second"], per_bucket)
    assert sized.priority_source() == "tuned" and sized.dispatch(x, y).provider == "second"
    assert sized.dispatch(torch.ones(64), y).provider == "third"

    # what enable_torch_wrap(False) routes each op's calls to
    eager_one, eager_three = one.eager, three.eager
    cases: dict[str, Callable[[], Any]] = {
        "plain call": lambda: add(x, y),
        "Library.define/impl op": lambda: bare(x, y),
        "Library.define/impl op, predicate inside": lambda: bare_picky(x, y),
        "torch.library.custom_op": lambda: co_add(x, y),
        "opmux wrap on, 1 provider": lambda: one(x, y),
        "opmux wrap on, 3 providers": lambda: three(x, y),
        "opmux wrap on, 3 providers, tuned by size": lambda: sized(x, y),
        "opmux wrap off, 1 provider": lambda: eager_one(x, y),
        "opmux wrap off, 3 providers": lambda: eager_three(x, y),
    }
    t = _time_all(cases, ns.number, ns.repeat)

    width = max(map(len, t))
    print(f"{'case':<{width}}  µs/call")
    for name, value in t.items():
        print(f"{name:<{width}}  {value:7.2f}")
    print()
    ratios = [
        ("wrap on, 1 provider / bare define-impl op", "opmux wrap on, 1 provider",
         "Library.define/impl op", 1.10),
        ("wrap on, 3 providers / bare define-impl op", "opmux wrap on, 3 providers",
         "Library.define/impl op", 1.15),
        ("predicate inside / bare define-impl op", "Library.define/impl op, predicate inside",
         "Library.define/impl op", None),
        ("wrap on, 3 providers / predicate inside", "opmux wrap on, 3 providers",
         "Library.define/impl op, predicate inside", None),
        ("wrap on, 3 tuned by size / 3 providers", "opmux wrap on, 3 providers, tuned by size",
         "opmux wrap on, 3 providers", 1.03),
        ("wrap off, 1 provider / plain call", "opmux wrap off, 1 provider", "plain call", 1.5),
        ("wrap off, 3 providers / plain call", "opmux wrap off, 3 providers", "plain call", 1.5),
        ("wrap on, 1 provider / custom_op", "opmux wrap on, 1 provider",
         "torch.library.custom_op", 1.0),
    ]
    width = max(len(r[0]) for r in ratios)
    print(f"{'ratio':<{width}}  value  target")
    for label, num, den, target in ratios:
        value = t[num] / t[den]
        if target is None:  # a reading aid, no budget of its own
            print(f"{label:<{width}}  {value:5.2f}")
            continue
        verdict = "ok" if value <= target else "MISSED"
        print(f"{label:<{width}}  {value:5.2f}  <= {target:.2f} {verdict}")
    registry.destroy()
    lib._destroy()


if __name__ == "__main__":
    main()
