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
    python benchmarks/dispatch_overhead.py --instructions [--number 2000]

Many short samples (500 calls each): on a shared machine a preemption spoils a few samples,
which the median drops, instead of a large part of a long one. Where timing is still too
noisy, ``--instructions`` counts instead: the script runs itself once under valgrind's
callgrind (which must be installed), warms every case up, then runs ``--number`` calls of
each case inside its own ``operator.call``; callgrind collects only inside those calls and
writes one profile per case, and the ratios are those of the instructions per call.
"""

from __future__ import annotations

import argparse
import operator
import re
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from timing import interleaved_us

import opmux
from opmux.core.dispatch import SIZE_BUCKETS, bucket_of


def _time_all(cases: dict[str, Callable[[], Any]], number: int, repeat: int) -> dict[str, float]:
    """Median µs/call per case; rounds interleave the cases so load spikes hit all alike."""
    return interleaved_us(cases, calls=number, rounds=repeat, warmup=200)


def _count_here(cases: dict[str, Callable[[], Any]], number: int) -> None:
    """Run under callgrind (see ``--instructions``): each case's calls inside one
    ``operator.call``, the function callgrind collects in and dumps after."""
    for fn in cases.values():
        for _ in range(300):
            fn()
    for fn in cases.values():
        def loop(fn: Callable[[], Any] = fn) -> None:
            for _ in range(number):
                fn()
        operator.call(loop)


def _count(names: list[str], number: int) -> dict[str, float]:
    """Instructions per call of each case, from one run of this script under callgrind."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "callgrind.out"
        subprocess.run(["valgrind", "--tool=callgrind", "--collect-atstart=no",
                        "--toggle-collect=_operator_call", "--dump-after=_operator_call",
                        f"--callgrind-out-file={out}", sys.executable, __file__,
                        "--under-callgrind", "--number", str(number)],
                       check=True, capture_output=True)
        dumps = sorted(Path(tmp).glob("callgrind.out.*"), key=lambda p: int(p.suffix[1:]))
        totals = [int(m.group(1)) for p in dumps
                  if (m := re.search(r"^totals: (\d+)", p.read_text(), re.M))]
    if len(totals) != len(names):
        raise SystemExit(f"callgrind wrote {len(totals)} profiles for {len(names)} cases")
    return {name: total / number for name, total in zip(names, totals, strict=True)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--number", type=int, default=None,
                        help="calls per sample (default 500), or per case with "
                             "--instructions (default 2000)")
    parser.add_argument("--repeat", type=int, default=400)
    parser.add_argument("--instructions", action="store_true",
                        help="count instructions under callgrind instead of timing")
    parser.add_argument("--under-callgrind", action="store_true", help=argparse.SUPPRESS)
    ns = parser.parse_args()
    number = ns.number or (2000 if ns.instructions or ns.under_callgrind else 500)
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
    if ns.under_callgrind:
        _count_here(cases, number)
        return
    if ns.instructions:
        t = _count(list(cases), number)
        unit, fmt = "instructions/call", "{:9.0f}"
    else:
        t = _time_all(cases, number, ns.repeat)
        unit, fmt = "µs/call", "{:7.2f}"

    width = max(map(len, t))
    print(f"{'case':<{width}}  {unit}")
    for name, value in t.items():
        print(f"{name:<{width}}  {fmt.format(value)}")
    print()
    ratios = [
        ("wrap on, 1 provider / bare define-impl op", "opmux wrap on, 1 provider",
         "Library.define/impl op", 1.12),
        ("wrap on, 3 providers / predicate inside", "opmux wrap on, 3 providers",
         "Library.define/impl op, predicate inside", 1.10),
        ("wrap on, 3 providers / bare define-impl op", "opmux wrap on, 3 providers",
         "Library.define/impl op", None),
        ("predicate inside / bare define-impl op", "Library.define/impl op, predicate inside",
         "Library.define/impl op", None),
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
