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

A kernel's speed here also depends on the process it runs in (where its buffers land
relative to each other; two builds of the same source differ by up to 13% in one process
and are level over many): ``--processes N`` runs the whole measurement in N fresh processes
and prints each cell's speed-up per process, their median and the verdict on the medians.
"""

from __future__ import annotations

import argparse
import functools
import json
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
    worst = float("inf")
    cells: list[dict[str, object]] = []
    for name in args.dtype:
        worst = min(worst, run(args, name, cells))
    print(f"target: the op >= 3x native: {'met' if worst >= 3 else 'MISSED'} (worst {worst:.2f}x)")
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


def run(args: argparse.Namespace, dtype_name: str, cells: list[dict[str, object]]) -> float:
    """Benchmark one dtype (each cell's result appended to ``cells``); returns the op's worst
    speed-up over native."""
    dtype = _DTYPES[dtype_name]
    g = torch.Generator().manual_seed(0)
    e, d, i = args.experts, args.hidden, args.intermediate
    w1 = (torch.randn(e, 2 * i, d, generator=g) * d ** -0.5).to(dtype)
    w2 = (torch.randn(e, d, i, generator=g) * i ** -0.5).to(dtype)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {dtype_name}, "
          f"E={e} top-{args.topk} d={d} I={i}, best (median) of {args.repeats}, ms")
    print(f"{'tokens':>7}{'native':>17}{'grouped':>17}{'cpp':>17}{'op':>17}{'runs':>9}"
          f"{'speed-up':>10}" + (f"{'vLLM':>17}{'vs vLLM':>9}" if args.vllm else ""))
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
        cell: dict[str, object] = {"dtype": dtype_name, "tokens": tokens, "speedup": speedup}
        if args.vllm:
            vllm_best, vllm_med = best["vLLM"]
            line += f"{vllm_best:>9.2f} ({vllm_med:>5.2f}){vllm_best / best['op'][0]:>8.2f}x"
            cell["vs_vllm"] = vllm_best / best["op"][0]
        cells.append(cell)
        print(line)
    return worst


if __name__ == "__main__":
    main()
