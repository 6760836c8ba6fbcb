"""``opmux bench``: time every supported provider of each op against native, here.

It runs each op's conformance cases (the kit's seeded inputs, small shapes: the figures show
per-call cost including overhead, not peak bandwidth; the scripts in ``benchmarks/`` measure
LLM sizes) and prints, per op and provider, the median time of one pass over the cases and
the speed-up over native, all measured in the same run with the providers interleaved.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any, Final

from opmux.cli._option_checks import int_in, run_device
from opmux.cli.strict_json import dumps
from opmux.cli.table import format_table

__all__ = ["HELP", "add_arguments", "run"]

HELP: Final = "time each supported provider against native here"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the ``bench`` options to ``parser``."""
    parser.add_argument("--op", action="append", default=[], metavar="OP",
                        help="only this op (repeatable; 'ns::name' for other namespaces)")
    parser.add_argument("--repeat", type=int_in(1, 100_000), default=15,
                        help="timed rounds (default 15)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--json", action="store_true", help="print JSON (strict: non-finite "
                                                            "numbers as \"inf\" or \"nan\")")


def _time_providers(op: Any, providers: list[str], device: str,
                    repeat: int) -> dict[str, float]:
    from opmux.testing.cases import cases_for

    cases = cases_for(op.qualname)
    # only the cases every provider accepts, so each one does the same work
    accepted = []
    for case in cases:
        args, kwargs = case.materialize(device)
        preds = [op.impls[p].supports_args for p in providers]
        if all(pred is None or pred(*args, **kwargs) for pred in preds):
            accepted.append(case)
    samples: dict[str, list[float]] = {name: [] for name in providers}
    for round_ in range(repeat + 1):
        for name in providers:
            fn = op.impls[name].fn
            # fresh inputs each round (outside the timer): mutating ops change them
            inputs = [case.materialize(device) for case in accepted]
            start = time.perf_counter()
            for args, kwargs in inputs:
                fn(*args, **kwargs)
            if round_:  # the first round warms up
                samples[name].append(time.perf_counter() - start)
    return {name: statistics.median(v) * 1e3 for name, v in samples.items()}


def run(ns: argparse.Namespace) -> int:
    """Run ``opmux bench`` with parsed options; returns the exit status."""
    from opmux.cli.check import select_ops
    from opmux.testing.cases import has_cases

    run_device(ns.device, "bench")
    ops = select_ops(ns.op, "bench")
    if ops is None:
        return 2
    rows: list[dict[str, Any]] = []
    for op in ops:
        providers = [p for p, impl in op.impls.items() if impl.supported]
        if len(providers) < 2 or not has_cases(op.qualname):
            continue
        providers = [p for p in providers if p != "native"] + ["native"]
        times = _time_providers(op, providers, ns.device, ns.repeat)
        for name in providers:
            rows.append({"op": op.qualname, "provider": name, "ms": times[name],
                         "speedup_vs_native": times["native"] / times[name]})
    if ns.json:
        print(dumps(rows))
        return 0
    print(format_table([(r["op"], r["provider"], f"{r['ms']:.3f}",
                         f"{r['speedup_vs_native']:.2f}x") for r in rows],
                       ("op", "provider", "ms/pass", "vs native")))
    print(f"\none pass = every conformance case the providers accept, on {ns.device}; "
          f"median of {ns.repeat} interleaved rounds")
    return 0
