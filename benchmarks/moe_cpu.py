"""``fused_moe`` on the CPU: the op (as the ``cpu`` plugin dispatches it) against native.

The contenders run in this process on the same inputs (top-k softmax routing of random
logits): native, the ``grouped`` provider, the ``cpp`` kernel called directly, and the op,
which runs ``cpp`` and hands large float32 batches to ``grouped`` (``cpp``'s
``supports_args``). The script checks they agree, then prints the best-of-N and median time
of each, the provider the op chose and the op's speed-up over native, for float32 and
bfloat16. Target: the op >= 3x native.
Where vLLM's CPU kernel library loads (``--vllm-lib``, default the installed ``vllm``
package's library for this CPU; never a dependency), its
``_C::cpu_fused_moe`` (weights prepacked once with ``_C::prepack_moe_weight``, with the ISA
vLLM picks: ``amx`` for bf16 on CPUs with AMX tiles, ``vec`` otherwise) runs in the same
loop; the ``vs vLLM`` column is vLLM's best time over the op's (above 1: opmux is faster).
Run: ``python benchmarks/moe_cpu.py [--dtype fp32] [--tokens 64] [--processes N]``.

Beside each time the script prints the machine's roofline for the cell, measured in the same
run: the weights of the experts that received tokens at a large copy's bandwidth (a buffer
four times the last-level cache, read and written), and the FLOPs of the routed pairs
(``2 * tokens * top_k * (2 * d * I + I * d)``) at the rate of a 1024^3 ``torch.mm``; the
roofline time is the larger of the two, and the columns ``/roof`` are ``cpp``'s, ``grouped``'s
and the op's time over it. For bfloat16 both mm rates are printed and the roofline takes the
faster: a kernel can widen bf16 to fp32 and run fp32 FMAs (``cpp``'s vector path does), so the
fp32 rate is within reach whatever torch's bf16 GEMM does (slow on AVX2 without AVX-512
BF16), and on CPUs with AMX tiles the bf16 rate is the higher one. Goal: the op
<= 1.5x the roofline in every cell.

A kernel's speed here also depends on the process it runs in (where its buffers land
relative to each other; two builds of the same source can differ in one process and are
level over many): ``--processes N`` runs the whole measurement in N fresh processes
and prints each cell's speed-up per process, their median and the verdict on the medians.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import subprocess
import sys
from collections.abc import Callable

import torch
from timing import load_vllm, samples, vllm_moe_isa

import opmux
from opmux.ops.moe import fused_moe, topk_softmax
from opmux.plugins.cpu import cpp_moe
from opmux.plugins.cpu.moe_ops import fused_moe_grouped

_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def _load_vllm_moe(path: str) -> bool:
    """Load vLLM's CPU kernels if a library loads and has the MoE op; say why not otherwise."""
    loaded = load_vllm(path)
    if loaded is None:
        print(f"vLLM kernels: {path or 'no installed vllm library'} did not load; "
              "comparing with native only")
        return False
    try:
        torch.ops._C.cpu_fused_moe  # noqa: B018  (raises if the op is absent)
    except (RuntimeError, AttributeError) as exc:
        print(f"vLLM kernels: {loaded} has no cpu_fused_moe ({type(exc).__name__}: {exc})")
        return False
    return True


def vllm_call(x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor,
              ids: torch.Tensor) -> Callable[[], torch.Tensor]:
    """``_C::cpu_fused_moe`` on weights prepacked once (as vLLM does after loading), with the
    ISA vLLM picks for this dtype here."""
    isa = vllm_moe_isa(x.dtype)
    packed = []
    for w in (w1, w2):
        out = torch.empty_like(w)
        torch.ops._C.prepack_moe_weight(w, out, isa)
        packed.append(out)
    w13p, w2p = packed
    weights32, ids32 = weights.float().contiguous(), ids.to(torch.int32).contiguous()

    def call() -> torch.Tensor:
        out = torch.empty_like(x)
        torch.ops._C.cpu_fused_moe(out, x, w13p, w2p, None, None, weights32, ids32, False,
                                   "silu", isa)
        return out

    return call


ROOFLINE_GOAL = 1.5
"""The op's time over the roofline time that the goal allows, in every cell."""


def _best_s(fn: Callable[[], object], repeats: int = 10) -> float:
    """Best seconds of ``repeats`` calls after two warm-up calls (the machine's capability)."""
    return min(samples({"fn": fn}, rounds=repeats)["fn"])


def copy_bandwidth() -> float:
    """Bytes per second of a copy (read + write) of a float32 buffer four times the last-level
    cache (at least 64 MiB), so that neither side stays in cache."""
    try:
        llc = os.sysconf("SC_LEVEL3_CACHE_SIZE")
    except (ValueError, OSError):
        llc = 0
    src = torch.randn(max(4 * llc, 64 << 20) // 4)
    dst = torch.empty_like(src)
    return 2 * src.numel() * 4 / _best_s(lambda: dst.copy_(src))


def mm_rate(dtype: torch.dtype) -> float:
    """FLOP per second of a 1024^3 ``torch.mm`` in ``dtype``."""
    a, b = torch.randn(1024, 1024).to(dtype), torch.randn(1024, 1024).to(dtype)
    return 2 * 1024 ** 3 / _best_s(lambda: torch.mm(a, b))


def roofline_s(ids: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor, bandwidth: float,
               rate: float) -> tuple[float, float]:
    """``(memory, compute)`` seconds of one call at the machine's limits: the weights of the
    experts that received tokens at ``bandwidth``, the routed pairs' FLOPs at ``rate``."""
    experts = int(torch.unique(ids).numel())
    weight_bytes = experts * (w1[0].numel() + w2[0].numel()) * w1.element_size()
    d, inter = w2.shape[1], w2.shape[2]
    flops = 2 * ids.numel() * (2 * d * inter + inter * d)
    return weight_bytes / bandwidth, flops / rate


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
    parser.add_argument("--vllm-lib", default="",
                        help="vLLM kernel library; default: the installed vllm's for this CPU")
    parser.add_argument("--processes", type=int, default=1,
                        help="run the measurement in this many fresh processes; print medians")
    parser.add_argument("--json", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.processes > 1:
        across_processes(args)
        return
    args.vllm = _load_vllm_moe(args.vllm_lib)
    opmux.load_plugins()
    if not fused_moe.impls["cpp"].supported:
        raise SystemExit(f"the cpp kernels are not available: {fused_moe.impls['cpp'].reason}")
    args.bandwidth = copy_bandwidth()
    args.rates = {name: mm_rate(_DTYPES[name]) for name in {"fp32", *args.dtype}}
    print(f"roofline: copy {args.bandwidth / 1e9:.1f} GB/s (a buffer over the last-level "
          "cache), 1024^3 torch.mm " + ", ".join(f"{name} {rate / 1e9:.1f} GFLOP/s"
                                                  for name, rate in sorted(args.rates.items())))
    worst = float("inf")
    cells: list[dict[str, object]] = []
    for name in args.dtype:
        worst = min(worst, run(args, name, cells))
    print(f"target: the op >= 3x native: {'met' if worst >= 3 else 'MISSED'} (worst {worst:.2f}x)")
    roof = max(float(str(c["roofline"])) for c in cells)
    print(f"goal: the op <= {ROOFLINE_GOAL}x the roofline: "
          f"{'met' if roof <= ROOFLINE_GOAL else 'MISSED'} (worst {roof:.2f}x)")
    if args.json:
        print("JSON " + json.dumps(cells))


def across_processes(args: argparse.Namespace) -> None:
    """Run the benchmark in ``args.processes`` fresh processes; print each cell's speed-ups."""
    forward = ["--tokens", *map(str, args.tokens), "--experts", str(args.experts),
               "--topk", str(args.topk), "--hidden", str(args.hidden),
               "--intermediate", str(args.intermediate), "--dtype", *args.dtype,
               "--repeats", str(args.repeats), "--vllm-lib", args.vllm_lib, "--json"]
    runs: list[list[dict[str, object]]] = []
    for i in range(args.processes):
        out = subprocess.run([sys.executable, __file__, *forward], check=True,
                             capture_output=True, text=True).stdout
        runs.append(json.loads(next(line[5:] for line in out.splitlines()
                                    if line.startswith("JSON "))))
        print(f"process {i + 1}/{args.processes} done", flush=True)
    print(f"op speed-up over native (best of {args.repeats} per process), "
          f"{args.processes} processes")
    worst = float("inf")
    for cell in range(len(runs[0])):
        dtype, tokens = runs[0][cell]["dtype"], runs[0][cell]["tokens"]
        ups = [float(str(r[cell]["speedup"])) for r in runs]
        med = statistics.median(ups)
        worst = min(worst, med)
        line = (f"{dtype:>5} {tokens:>6} tokens: median {med:5.2f}x  "
                f"(per process {' '.join(f'{u:.2f}' for u in ups)})")
        if "vs_vllm" in runs[0][cell]:
            vs = statistics.median(float(str(r[cell]["vs_vllm"])) for r in runs)
            line += f"  vs vLLM median {vs:.2f}x"
        print(line)
    print(f"target: the op >= 3x native (medians): {'met' if worst >= 3 else 'MISSED'} "
          f"(worst {worst:.2f}x)")
    roofs = [statistics.median(float(str(r[cell]["roofline"])) for r in runs)
             for cell in range(len(runs[0]))]
    for cell, med in enumerate(roofs):
        print(f"{runs[0][cell]['dtype']:>5} {runs[0][cell]['tokens']:>6} tokens: op / roofline "
              f"median {med:.2f}x")
    print(f"goal: the op <= {ROOFLINE_GOAL}x the roofline (medians): "
          f"{'met' if max(roofs) <= ROOFLINE_GOAL else 'MISSED'} (worst {max(roofs):.2f}x)")


def run(args: argparse.Namespace, dtype_name: str, cells: list[dict[str, object]]) -> float:
    """Benchmark one dtype (each cell's result appended to ``cells``); returns the op's worst
    speed-up over native."""
    dtype = _DTYPES[dtype_name]
    g = torch.Generator().manual_seed(0)
    e, d, i = args.experts, args.hidden, args.intermediate
    w1 = (torch.randn(e, 2 * i, d, generator=g) * d ** -0.5).to(dtype)
    w2 = (torch.randn(e, d, i, generator=g) * i ** -0.5).to(dtype)
    rate_name = max(("fp32", dtype_name), key=lambda name: args.rates[name])
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {dtype_name}, "
          f"E={e} top-{args.topk} d={d} I={i}, best (median) of {args.repeats}, ms; roofline "
          f"at the {rate_name} mm rate ({args.rates[rate_name] / 1e9:.1f} GFLOP/s)")
    print(f"{'tokens':>7}{'native':>17}{'grouped':>17}{'cpp':>17}{'op':>17}{'runs':>9}"
          f"{'speed-up':>10}{'roofline (mem, flop)':>24}{'/roof: grouped':>16}{'cpp':>6}"
          f"{'op':>6}" + (f"{'vLLM':>17}{'vs vLLM':>9}" if args.vllm else ""))
    worst = float("inf")
    for tokens in args.tokens:
        x = torch.randn(tokens, d, generator=g).to(dtype)
        weights, ids = topk_softmax(torch.randn(tokens, e, generator=g), args.topk, True)
        call = (x, w1, w2, weights, ids)
        tol = 1e-4 if dtype == torch.float32 else 3e-2
        want = fused_moe.native(*call)
        fns: dict[str, Callable[[], object]] = {
            name: functools.partial(fn, *call)
            for name, fn in (("native", fused_moe.native), ("grouped", fused_moe_grouped),
                             ("cpp", cpp_moe.fused_moe), ("op", fused_moe))}
        if args.vllm:
            fns["vLLM"] = vllm_call(*call)
        for name, fn in fns.items():
            torch.testing.assert_close(fn(), want, atol=tol, rtol=tol, msg=name)
        times = time_ms(list(fns.values()), repeats=args.repeats)
        best = dict(zip(fns, times, strict=True))
        speedup = best["native"][0] / best["op"][0]
        worst = min(worst, speedup)
        line = f"{tokens:>7}" + "".join(f"{b:>9.2f} ({m:>5.2f})" for b, m in times[:4])
        line += f"{fused_moe.dispatch(*call).provider:>9}{speedup:>9.2f}x"
        mem_s, flop_s = roofline_s(ids, w1, w2, args.bandwidth, args.rates[rate_name])
        roof_ms = max(mem_s, flop_s) * 1e3
        line += f"{roof_ms:>9.2f} ({mem_s * 1e3:5.2f}, {flop_s * 1e3:5.2f})"
        ratios = [best[name][0] / roof_ms for name in ("grouped", "cpp", "op")]
        line += f"{ratios[0]:>15.2f}x{ratios[1]:>5.2f}x{ratios[2]:>5.2f}x"
        cell: dict[str, object] = {"dtype": dtype_name, "tokens": tokens, "speedup": speedup,
                                   "roofline": ratios[2]}
        if args.vllm:
            vllm_best, vllm_med = best["vLLM"]
            line += f"{vllm_best:>9.2f} ({vllm_med:>5.2f}){vllm_best / best['op'][0]:>8.2f}x"
            cell["vs_vllm"] = vllm_best / best["op"][0]
        cells.append(cell)
        print(line)
    return worst


if __name__ == "__main__":
    main()
