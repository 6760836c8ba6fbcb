"""Start-up cost of opmux over ``import torch``, in fresh subprocesses.

Measures ``import opmux`` + platform detection + plugin discovery and loading, as the
median over fresh interpreters of (time to do that after ``import torch``), and checks that
no heavy stack (triton, torch_xla, mindspore, torch_npu) was imported on a platform that does
not use it. Wall time is the figure of record; the process CPU time and the full (oldest
generation) garbage collections run during the opmux part are printed beside it, with the same
share in CPU time, because on a shared machine wall time mostly measures the other processes
(the CPU-time share is the steadier one there; both have the same target).

    python benchmarks/startup.py [--runs 12] [--against DIR]

``--against DIR`` compares this checkout with another one (e.g. a ``git worktree`` of the
commit before a change): fresh processes alternate between the two, each importing opmux
from its own folder, and the median of the paired differences is printed with its quartiles
(on a shared machine, pairs taken a moment apart see the same load).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

_PROBE = r"""
import gc, json, sys, time
t0 = time.perf_counter()
c0 = time.process_time()
import torch
t1 = time.perf_counter()
c1 = time.process_time()
full = []
gc.callbacks.append(lambda phase, info: full.append(1)
                    if phase == "start" and info["generation"] == 2 else None)
import opmux
opmux.current_platform()
t2 = time.perf_counter()
opmux.load_plugins()
t3 = time.perf_counter()
c3 = time.process_time()
heavy = sorted(m for m in ("triton", "torch_xla", "mindspore", "torch_npu") if m in sys.modules)
print(json.dumps({"torch": t1 - t0, "import_detect": t2 - t1, "plugins": t3 - t2,
                  "torch_cpu": c1 - c0, "cpu": c3 - c1, "full_gc": len(full),
                  "platform": opmux.current_platform().name, "heavy": heavy}))
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=12)
    parser.add_argument("--against", type=Path, default=None,
                        help="another opmux checkout to compare with, in alternating processes")
    ns = parser.parse_args()
    if ns.against is not None:
        compare(ns.against.resolve(), ns.runs)
        return
    # Measure an ordinary installation: bytecode caches on (some shells disable them with
    # PYTHONDONTWRITEBYTECODE, which makes every start compile every module again).
    env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
    subprocess.run([sys.executable, "-c", _PROBE], check=True, capture_output=True, env=env)
    rows = [json.loads(subprocess.run([sys.executable, "-c", _PROBE], check=True, env=env,
                                      capture_output=True, text=True).stdout)
            for _ in range(ns.runs)]
    med = {k: statistics.median(r[k] for r in rows) * 1e3
           for k in ("torch", "import_detect", "plugins", "torch_cpu", "cpu")}
    total = med["import_detect"] + med["plugins"]
    # the budget: opmux's share of import torch's own time in the same process, median
    share = statistics.median((r["import_detect"] + r["plugins"]) / r["torch"] for r in rows)
    print(f"platform: {rows[0]['platform']}, runs: {ns.runs} (medians)")
    print(f"import torch                       {med['torch']:8.1f} ms  (baseline)")
    print(f"import opmux + detection           {med['import_detect']:8.1f} ms")
    print(f"plugin discovery + registration    {med['plugins']:8.1f} ms")
    print(f"opmux over torch                   {total:8.1f} ms  "
          f"({100 * share:.1f} % of import torch in the same process, median; target "
          f"<= 4 %: {'ok' if share <= 0.04 else 'MISSED'})")
    cpu_share = statistics.median(r["cpu"] / r["torch_cpu"] for r in rows)
    print(f"import torch, process CPU time     {med['torch_cpu']:8.1f} ms")
    print(f"opmux over torch, process CPU time {med['cpu']:8.1f} ms  "
          f"({100 * cpu_share:.1f} % of import torch's, median; target <= 4 %: "
          f"{'ok' if cpu_share <= 0.04 else 'MISSED'}; full GC passes in it: "
          f"{sum(r['full_gc'] for r in rows)} over {ns.runs} runs)")
    heavy = sorted({m for r in rows for m in r["heavy"]})
    print(f"heavy stacks imported: {heavy or 'none'}")


def _probe(checkout: Path) -> dict[str, float]:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
    env["PYTHONPATH"] = os.pathsep.join([str(checkout), env.get("PYTHONPATH", "")])
    out = subprocess.run([sys.executable, "-c", _PROBE], check=True, env=env, cwd=checkout,
                         capture_output=True, text=True).stdout
    row: dict[str, float] = json.loads(out)
    return row


def compare(other: Path, runs: int) -> None:
    """Alternate fresh processes of this checkout and ``other``; print paired differences."""
    here = Path(__file__).resolve().parents[1]
    if not (other / "opmux" / "__init__.py").is_file():
        raise SystemExit(f"--against {other}: not an opmux checkout (no opmux/__init__.py)")
    for checkout in (here, other):
        _probe(checkout)  # bytecode caches written, library built, before timing
    pairs = []
    for i in range(runs):
        order = (here, other) if i % 2 == 0 else (other, here)
        got = {checkout: _probe(checkout) for checkout in order}
        pairs.append((got[here], got[other]))
    diffs = sorted((a["import_detect"] + a["plugins"] - b["import_detect"] - b["plugins"]) * 1e3
                   for a, b in pairs)
    quart = statistics.quantiles(diffs, n=4) if len(diffs) > 1 else diffs * 3
    for name, col in (("this checkout", 0), (f"{other}", 1)):
        total = statistics.median((p[col]["import_detect"] + p[col]["plugins"]) * 1e3
                                  for p in pairs)
        print(f"{name:40s} opmux over torch {total:7.1f} ms (median of {runs})")
    print(f"this - other, paired: median {statistics.median(diffs):+.1f} ms "
          f"(quartiles {quart[0]:+.1f} / {quart[2]:+.1f} ms)")


if __name__ == "__main__":
    main()
