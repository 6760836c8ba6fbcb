"""GPU kernel benchmark of the CUDA plugin (providers ``triton`` and ``cuda_c``).

Per op it prints the median time, the achieved memory bandwidth and its share of the
device's peak, and the speed of opmux relative to the native reference (torch eager), to
``torch.compile`` of the native reference, and to the peers that are installed: vLLM's CUDA
kernels (``vllm._C``), Liger-Kernel (rms_norm, SwiGLU) and FlashInfer (paged decode).
Ratios are ``baseline time / opmux time``: above 1 means opmux is faster. Everything runs in
this one process, on the same inputs.

Usage::

    python benchmarks/gpu_kernels.py [--ops rms_norm,paged_attention] [--no-compile]
    python benchmarks/gpu_kernels.py --check [--out DIR]     # also: make gpu-check

``--check`` is the device check (see ``gpu_check.py``): conformance of providers ``triton`` and
``cuda_c`` on the GPU, then this benchmark, into one JSON + Markdown report. Without a GPU
either prints one line saying so and exits 0.
"""

from __future__ import annotations

import argparse
import functools
import statistics
import sys
from collections.abc import Callable
from typing import Any

import torch

Fn = Callable[[], Any]

#: published peak HBM bandwidth (GB/s) by device-name fragment, for when torch lacks clocks
_PEAK_GBPS = {"H200": 4800.0, "H100 SXM": 3350.0, "H100 PCIe": 2000.0, "H100": 3350.0,
              "A100-SXM4-80GB": 2039.0, "A100": 1555.0, "L40S": 864.0, "A10G": 600.0,
              "MI300X": 5300.0, "MI250": 3277.0}


def peak_gbps() -> tuple[float, str]:
    """The device's peak memory bandwidth and where the number came from."""
    props = torch.cuda.get_device_properties(0)
    clock_khz = getattr(props, "memory_clock_rate", 0)
    bus_bits = getattr(props, "memory_bus_width", 0)
    if clock_khz and bus_bits:
        return 2 * clock_khz * 1e3 * bus_bits / 8 / 1e9, "memory clock x bus width"
    for fragment, gbps in _PEAK_GBPS.items():
        if fragment in props.name:
            return gbps, f"datasheet ({fragment})"
    return float("nan"), "unknown"


def bench(fn: Fn, reps: int = 50) -> float:
    """Median milliseconds of ``fn`` over ``reps`` runs after warm-up (CUDA events)."""
    for _ in range(5):
        fn()
    torch.cuda.synchronize()
    cache_flush = torch.empty(256 * 1024 * 1024 // 4, dtype=torch.int32, device="cuda")
    times = []
    for _ in range(reps):
        cache_flush.zero_()  # keep L2 cold between runs, as in a model step
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def _try(label: str, make: Callable[[], Fn | None]) -> Fn | str:
    """``make()`` or the reason it failed (printed instead of a number)."""
    try:
        fn = make()
    except ImportError as exc:
        return f"not installed ({exc.name})"
    except Exception as exc:  # a peer's API changed: report it, keep benchmarking
        return f"{label} failed: {type(exc).__name__}: {exc}"[:120]
    return fn if fn is not None else "n/a"


def _vllm() -> Any:
    import vllm._C  # noqa: F401  (registers torch.ops._C*)

    return torch.ops


class Case:
    """One op at one shape: the opmux providers, the baselines and the peers."""

    def __init__(self, op: str, shape: str, nbytes: int, args: tuple[Any, ...],
                 peers: dict[str, Callable[[], Fn | None]]) -> None:
        self.op, self.shape, self.nbytes, self.args, self.peers = op, shape, nbytes, args, peers


def _bytes(*ts: torch.Tensor) -> int:
    return sum(t.numel() * t.element_size() for t in ts)


def cases() -> list[Case]:
    import opmux.ops
    from opmux.ops.rotary import make_cos_sin_cache

    dev, bf = "cuda", torch.bfloat16
    out: list[Case] = []

    x = torch.randn(4096, 2 * 11008, device=dev, dtype=bf)
    o = torch.empty(4096, 11008, device=dev, dtype=bf)

    def liger_swiglu() -> Fn:
        from liger_kernel.ops.swiglu import LigerSiLUMulFunction

        a, b = x[:, :11008].contiguous(), x[:, 11008:].contiguous()
        return lambda: LigerSiLUMulFunction.apply(a, b)

    out.append(Case("silu_and_mul", "4096x2*11008 bf16", _bytes(x, o), (x,), {
        "vllm": lambda: (lambda ops: lambda: ops._C.silu_and_mul(o, x))(_vllm()),
        "liger": liger_swiglu,
    }))
    out.append(Case("gelu_and_mul", "4096x2*11008 bf16", _bytes(x, o), (x, "tanh"), {
        "vllm": lambda: (lambda ops: lambda: ops._C.gelu_tanh_and_mul(o, x))(_vllm()),
    }))

    h = torch.randn(8192, 8192, device=dev, dtype=bf)
    w = torch.randn(8192, device=dev, dtype=bf)
    res = torch.randn_like(h)

    def liger_rms() -> Fn:
        from liger_kernel.ops.rms_norm import LigerRMSNormFunction

        return lambda: LigerRMSNormFunction.apply(h, w, 1e-6, 0.0, "llama")

    out.append(Case("rms_norm", "8192x8192 bf16", 2 * _bytes(h), (h, w, 1e-6), {
        "vllm": lambda: (lambda ops, y: lambda: ops._C.rms_norm(y, h, w, 1e-6))(
            _vllm(), torch.empty_like(h)),
        "liger": liger_rms,
    }))
    out.append(Case("fused_add_rms_norm", "8192x8192 bf16", 4 * _bytes(h), (h, res, w, 1e-6), {
        # vLLM's kernel is in place: it rewrites its inputs each run (same traffic)
        "vllm": lambda: (lambda ops, a, r: lambda: ops._C.fused_add_rms_norm(a, r, w, 1e-6))(
            _vllm(), h.clone(), res.clone()),
    }))

    tokens, heads, kv_heads, d = 8192, 32, 8, 128
    pos = torch.randint(0, 8192, (tokens,), device=dev)
    q = torch.randn(tokens, heads * d, device=dev, dtype=bf)
    k = torch.randn(tokens, kv_heads * d, device=dev, dtype=bf)
    cos_sin = make_cos_sin_cache(8192, d, dtype=bf, device=dev)
    out.append(Case("rotary_embedding", "8192 tok 32/8 heads d128 bf16", 2 * _bytes(q, k),
                    (pos, q, k, cos_sin, d, True), {
        "vllm": lambda: (lambda ops, qq, kk: lambda: ops._C.rotary_embedding(
            pos, qq, kk, d, cos_sin, True))(_vllm(), q.clone(), k.clone()),
    }))

    blocks, bs = 4096, 16
    kc = torch.zeros(blocks, bs, kv_heads, d, device=dev, dtype=bf)
    vc = torch.zeros_like(kc)
    kv = torch.randn(tokens, kv_heads, d, device=dev, dtype=bf)
    slots = torch.randperm(blocks * bs, device=dev)[:tokens]
    out.append(Case("reshape_and_cache", "8192 tok 8x128 bf16 bs16", 4 * _bytes(kv),
                    (kv, kv, kc, vc, slots), {
        "vllm": lambda: (lambda ops, one: lambda: ops._C_cache_ops.reshape_and_cache_flash(
            kv, kv, kc, vc, slots, "auto", one, one))(_vllm(), torch.ones((), device=dev)),
    }))

    seqs, ctx, page = 64, 4096, 16
    pages = ctx // page
    kcache = torch.randn(seqs * pages, page, kv_heads, d, device=dev, dtype=bf)
    vcache = torch.randn_like(kcache)
    table = torch.randperm(seqs * pages, device=dev, dtype=torch.int32).view(seqs, pages)
    lens = torch.full((seqs,), ctx, device=dev, dtype=torch.int32)
    qsl = torch.arange(seqs + 1, device=dev, dtype=torch.int32)
    qd = torch.randn(seqs, heads, d, device=dev, dtype=bf)

    def flashinfer_decode() -> Fn:
        import flashinfer

        ws = torch.empty(128 * 1024 * 1024, dtype=torch.uint8, device=dev)
        wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(ws, "NHD")
        indptr = torch.arange(seqs + 1, device=dev, dtype=torch.int32) * pages
        last = torch.full((seqs,), page, device=dev, dtype=torch.int32)
        wrapper.plan(indptr, table.flatten().contiguous(), last, heads, kv_heads, d, page,
                     data_type=bf)
        return lambda: wrapper.run(qd, (kcache, vcache))

    out.append(Case("paged_attention", f"decode {seqs}x{ctx} 32/8 heads d128 bf16",
                    _bytes(kcache, vcache, qd), (qd, kcache, vcache, table, lens, qsl, d ** -0.5),
                    {"flashinfer": flashinfer_decode}))

    num = 256
    step_args = (num, num, 16, torch.zeros(num, dtype=torch.int64, device=dev),
                 torch.randint(0, 1000, (num, 1), device=dev),
                 torch.zeros(num, dtype=torch.int64, device=dev),
                 torch.full((num,), 100, dtype=torch.int32, device=dev),
                 torch.zeros(num, dtype=torch.int64, device=dev),
                 torch.arange(num * 64, dtype=torch.int32, device=dev).view(num, 64))
    out.append(Case("advance_step_flashattn", f"{num} seqs (launch bound)", num * 36, step_args,
                    {}))
    assert {c.op for c in out} <= {op.name for op in opmux.list_ops()}
    return out


def run(selected: set[str] | None, compile_native: bool) -> dict[str, Any]:
    """Benchmark every case (printing as it goes); returns the device facts and one row per
    op x contender: ``{"op", "shape", "contender", "kind", "ms", "gbps", "peak_share",
    "speedup", "note"}`` (``kind``: ``opmux`` for a provider, ``baseline`` otherwise;
    ``speedup`` = baseline ms / best opmux ms)."""
    import opmux
    from opmux.plugins.cuda import cuda_c, triton_ops

    registry = opmux.OpRegistry()
    names = ("silu_and_mul", "gelu_and_mul", "rms_norm", "fused_add_rms_norm",
             "rotary_embedding", "reshape_and_cache", "paged_attention",
             "advance_step_flashattn")
    ops = {n: registry.register_op(getattr(opmux.ops, n).native, name=n, namespace="opmux_bench",
                                   mutates_args=getattr(opmux.ops, n).mutates_args)
           for n in names}
    triton_ops.register(registry, "CUDA")
    cuda_c.register(registry, "CUDA")
    peak, source = peak_gbps()
    device = torch.cuda.get_device_name(0)
    print(f"device: {device}; peak memory bandwidth {peak:.0f} GB/s ({source}); "
          f"torch {torch.__version__}")
    print("ratios are baseline_ms / opmux_ms (above 1: opmux faster)")
    rows: list[dict[str, Any]] = []

    def row(case: Case, contender: str, kind: str, ms: float | None = None,
            note: str = "", speedup: float | None = None) -> None:
        gbps = case.nbytes / ms / 1e6 if ms else None
        rows.append({"op": case.op, "shape": case.shape, "contender": contender, "kind": kind,
                     "ms": ms, "gbps": gbps, "peak_share": gbps / peak if gbps else None,
                     "speedup": speedup, "note": note})

    for case in cases():
        if selected and case.op not in selected:
            continue
        op = ops[case.op]
        native = op.native
        print(f"\n== {case.op} [{case.shape}]")
        results: dict[str, float] = {}
        for provider in ("triton", "cuda_c"):
            impl = op.impls.get(provider)
            if impl is None or not impl.supported:
                why = impl.reason if impl is not None else "not registered for this op"
                print(f"  {provider:<12} n/a: {why}")
                row(case, provider, "opmux", note=f"n/a: {why}")
                continue
            ms = bench(functools.partial(impl.fn, *case.args))
            results[provider] = ms
            row(case, provider, "opmux", ms)
            gbps = case.nbytes / ms / 1e6
            print(f"  {provider:<12} {ms:9.4f} ms  {gbps:8.1f} GB/s  {100 * gbps / peak:5.1f}% "
                  f"of peak")
        best = min(results.values()) if results else float("nan")
        baselines: dict[str, Fn | str] = {"eager": functools.partial(native, *case.args)}
        if compile_native:
            baselines["compile"] = functools.partial(torch.compile(native), *case.args)
        for peer, make in case.peers.items():
            baselines[peer] = _try(peer, make)
        for label, fn in baselines.items():
            if isinstance(fn, str):
                print(f"  {label:<12} {fn}")
                row(case, label, "baseline", note=fn)
                continue
            try:
                ms = bench(fn, reps=20)
            except Exception as exc:
                note = f"failed: {type(exc).__name__}: {exc}"[:140]
                print(f"  {label:<12} {note}")
                row(case, label, "baseline", note=note)
                continue
            row(case, label, "baseline", ms, speedup=ms / best)
            print(f"  {label:<12} {ms:9.4f} ms  opmux speed-up x{ms / best:6.2f}")
    return {"device": device, "peak_gbps": peak, "peak_source": source,
            "torch": torch.__version__, "rows": rows}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ops", default="", help="comma-separated op names (default: all)")
    parser.add_argument("--no-compile", action="store_true",
                        help="skip the torch.compile baseline (saves the compile time)")
    parser.add_argument("--check", action="store_true",
                        help="the device check: conformance of triton and cuda_c on the GPU "
                             "first, then the benchmark; writes gpu-check.json and .md")
    parser.add_argument("--out", default=".",
                        help="folder of the --check report (default: the current one)")
    args = parser.parse_args(argv)
    if args.check:  # a bad --out is refused before the run, not after it
        import gpu_check

        try:
            gpu_check.check_out(args.out)
        except ValueError as exc:
            print(f"gpu_kernels: error: {exc}", file=sys.stderr)
            return 2
    if not torch.cuda.is_available():
        print("gpu_kernels: no CUDA/ROCm GPU is available (torch.cuda.is_available() is False); "
              "nothing to " + ("check" if args.check else "benchmark"))
        return 0
    selected = {s for s in args.ops.split(",") if s} or None
    if args.check:
        import gpu_check

        return gpu_check.device_check(args.out, lambda: run(selected, not args.no_compile))
    run(selected, not args.no_compile)
    return 0


if __name__ == "__main__":
    sys.exit(main())
