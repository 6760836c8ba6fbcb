"""all_reduce latency and bandwidth on gloo: the opmux op against plain ``dist.all_reduce``.

Two ranks on this machine (the script starts them itself with the environment torchrun
sets; under ``torchrun --nproc-per-node 2`` it runs as the rank it is given). For each
size from 4 KiB to 64 MiB (fp32), in the same run and interleaved:

* ``dist``     : ``torch.distributed.all_reduce(t)`` on the world group (in place);
* ``clone+dist``: ``t.clone()`` then the same (what any functional all-reduce costs);
* ``opmux``    : ``opmux.ops.all_reduce(t, "tp")`` (the torch.distributed provider,
  through the torch dispatcher; returns a new tensor, leaves ``t`` untouched);
* ``opmux_``   : ``opmux.ops.all_reduce_(t, "tp")`` (in place, as the layers call it).

Each contender runs a batch of back-to-back calls (the collectives keep the ranks in
step); batches take turns so load from other processes hits every contender alike, and
the turn order rotates between rounds (median of the rounds' medians).
Printed: median µs per call, algorithm bandwidth (bytes / time; equal to the bus
bandwidth for 2 ranks) and the ratios opmux / clone+dist (the functional op against the
same work done by hand) and opmux_ / dist (the in-place op against plain dist).
Target: opmux op overhead <= 1.10 for sizes >= 1 MiB.

Run: ``python benchmarks/all_reduce_gloo.py [--quick]``.
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import subprocess
import sys
from collections.abc import Callable
from typing import Any

import torch
from timing import interleaved_ms

SIZES = [4 << 10, 16 << 10, 64 << 10, 256 << 10, 1 << 20, 4 << 20, 16 << 20, 64 << 20]
QUICK_SIZES = [4 << 10, 1 << 20]


def _fmt_size(n: int) -> str:
    return f"{n >> 20} MiB" if n >= 1 << 20 else f"{n >> 10} KiB"


def _batch(fn: Callable[[], Any], calls: int) -> Callable[[], None]:
    def run() -> None:
        for _ in range(calls):
            fn()

    return run


def rank_main(quick: bool) -> None:
    import torch.distributed as dist

    import opmux
    import opmux.distributed as od

    torch.set_num_threads(1)  # two ranks share this machine's cores
    tp = od.init_tensor_parallel()
    all_reduce, all_reduce_ = opmux.ops.all_reduce, opmux.ops.all_reduce_
    rows = []
    for size in QUICK_SIZES if quick else SIZES:
        t = torch.randn(size // 4, generator=torch.Generator().manual_seed(tp.rank))
        check = t.clone()
        dist.all_reduce(check)
        assert torch.equal(all_reduce(t, "tp"), check)
        t.zero_()  # timed in-place sums stay finite (the cost does not depend on values)
        # batches of roughly 8 MiB of traffic (at least one call, at most 64)
        calls = max(1, min(64, (8 << 20) // size))
        fns = {
            "dist": _batch(lambda t=t: dist.all_reduce(t), calls),
            "clone+dist": _batch(lambda t=t: dist.all_reduce(t.clone()), calls),
            "opmux": _batch(lambda t=t: all_reduce(t, "tp"), calls),
            "opmux_": _batch(lambda t=t: all_reduce_(t, "tp"), calls),
        }
        # rotate the order between rounds: no contender always runs right after the barrier
        names = list(fns)
        medians: dict[str, list[float]] = {name: [] for name in names}
        for shift in range(len(names) * (1 if quick else 3)):
            order = names[shift % len(names):] + names[:shift % len(names)]
            dist.barrier()
            for name, value in interleaved_ms({n: fns[n] for n in order}, iters=5).items():
                medians[name].append(value)
        per_call = {k: statistics.median(v) / calls for k, v in medians.items()}
        rows.append((size, per_call))
    if tp.rank == 0:
        load = ", ".join(f"{v:.1f}" for v in os.getloadavg())
        print(f"gloo all_reduce, {tp.world_size} ranks, fp32, torch {torch.__version__}, "
              f"{os.cpu_count()} CPUs, load average {load} (1/5/15 min)")
        print("| size | dist µs | opmux_ µs | clone+dist µs | opmux µs | dist GB/s | "
              "opmux_ GB/s | opmux_ / dist | opmux / clone+dist | opmux / dist |")
        print("|" + " --- |" * 10)
        for size, t_ms in rows:
            us = {k: v * 1e3 for k, v in t_ms.items()}
            gbps = {k: size / (v * 1e-3) / 1e9 for k, v in t_ms.items()}
            print(f"| {_fmt_size(size)} | {us['dist']:.0f} | {us['opmux_']:.0f} | "
                  f"{us['clone+dist']:.0f} | {us['opmux']:.0f} | {gbps['dist']:.2f} | "
                  f"{gbps['opmux_']:.2f} | {us['opmux_'] / us['dist']:.2f} | "
                  f"{us['opmux'] / us['clone+dist']:.2f} | {us['opmux'] / us['dist']:.2f} |")
    od.destroy_tensor_parallel()


def launch(quick: bool) -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = []
    for rank in range(2):
        env = {**os.environ, "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": "2",
               "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
        args = [sys.executable, os.path.abspath(__file__), *(["--quick"] if quick else [])]
        procs.append(subprocess.Popen(args, env=env))
    return max(p.wait(timeout=1800) for p in procs)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="two sizes, fewer repeats")
    ns = parser.parse_args()
    if "RANK" not in os.environ:
        return launch(ns.quick)
    rank_main(ns.quick)
    return 0


if __name__ == "__main__":
    sys.exit(main())
