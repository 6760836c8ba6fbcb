"""Elementwise/norm ops on CPU: opmux ``cpp`` against baselines measured in the same run.

For rms_norm, fused_add_rms_norm, silu_and_mul, gelu_and_mul, rotary_embedding,
apply_rotary_emb, dual_chunk_rotary_embedding, gemma_rms_norm, gemma_fused_add_rms_norm,
rms_norm_gated, quant_fp8 (per-token and per-group) and the activations of
``ops_cpu_activation.py`` it times:
opmux ``native`` eager, ``torch.compile`` of native, the ``cpp`` provider as an op call (it
allocates its outputs), the ``cpp`` kernel writing into preallocated outputs, and vLLM's CPU
kernel (in place / into a preallocated output, as vLLM calls it) when ``vllm`` is importable.
vLLM's kernel library is loaded with ``torch.ops.load_library``; it is never a dependency.

    python benchmarks/ops_cpu.py              # 1024 tokens x 4096 (quick)
    python benchmarks/ops_cpu.py --full       # 4096 x 4096, silu/gelu 4096 x 2*11008
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any

import torch
from timing import interleaved_ms, load_vllm, median_ms

Fn = Callable[[], Any]


def native_fn(name: str, fallback: Callable[..., Any]) -> Callable[..., Any]:
    try:
        import opmux

        return opmux.get_op(name).impls["native"].fn  # type: ignore[no-any-return]
    except (ImportError, KeyError, AttributeError):
        return fallback


def cases(tokens: int, hidden: int, inter: int, dtype: torch.dtype,
          has_vllm: bool) -> list[tuple[str, tuple[Any, ...], dict[str, Fn]]]:
    """(op name, native args, {label: callable}) per op; callables exclude native rows."""
    from opmux.plugins.cpu import cpp_ops

    k = torch.ops.opmux_cpu
    torch.manual_seed(0)
    x = torch.randn(tokens, hidden, dtype=dtype)
    res = torch.randn(tokens, hidden, dtype=dtype)
    w = torch.randn(hidden, dtype=dtype)
    out = torch.empty_like(x)
    res_out = torch.empty_like(x)
    g = torch.randn(tokens, 2 * inter, dtype=dtype)
    g_out = torch.empty(tokens, inter, dtype=dtype)
    heads, kv_heads, d = hidden // 128, max(1, hidden // 512), 128
    pos = torch.randint(0, 4096, (tokens,))
    q = torch.randn(tokens, heads * d, dtype=dtype)
    kk = torch.randn(tokens, kv_heads * d, dtype=dtype)
    inv = 1.0 / (10000 ** (torch.arange(0, d, 2).float() / d))
    freqs = torch.arange(4096).float()[:, None] * inv[None, :]
    cache = torch.cat([freqs.cos(), freqs.sin()], -1).to(dtype)
    q_out, k_out = torch.empty_like(q), torch.empty_like(kk)
    # apply_rotary_emb: a vision-encoder call, x [1, T, H, D] with per-position tables
    xr = q.view(1, tokens, heads, d)
    xr_out = torch.empty_like(xr)
    cos_t, sin_t = cache[:tokens, : d // 2], cache[:tokens, d // 2:]
    # dual_chunk_rotary_embedding: chunk 8192, local 1024 (Qwen2.5-1M's config), pos < 4096
    from opmux.ops.rotary import make_dual_chunk_caches

    dc = make_dual_chunk_caches(8192, 1024, 4096, d, dtype=dtype)
    dq_out = torch.empty(tokens, 5 * heads * d, dtype=dtype)
    result: list[tuple[str, tuple[Any, ...], dict[str, Fn]]] = [
        ("rms_norm", (x, w, 1e-6), {
            "cpp": lambda: cpp_ops.rms_norm(x, w, 1e-6),
            "cpp kernel (out given)": lambda: k.rms_norm_out(out, x, w, 1e-6),
        }),
        ("fused_add_rms_norm", (x, res, w, 1e-6), {
            "cpp": lambda: cpp_ops.fused_add_rms_norm(x, res, w, 1e-6),
            "cpp kernel (out given)": lambda: k.fused_add_rms_norm_out(out, res_out, x, res, w,
                                                                       1e-6),
        }),
        ("silu_and_mul", (g,), {
            "cpp": lambda: cpp_ops.silu_and_mul(g),
            "cpp kernel (out given)": lambda: k.silu_and_mul_out(g_out, g),
        }),
        ("gelu_and_mul", (g, "none"), {
            "cpp": lambda: cpp_ops.gelu_and_mul(g, "none"),
            "cpp kernel (out given)": lambda: k.gelu_and_mul_out(g_out, g, "none"),
        }),
        ("rotary_embedding", (pos, q, kk, cache, d, True), {
            "cpp": lambda: cpp_ops.rotary_embedding(pos, q, kk, cache, d, True),
            "cpp kernel (out given)": lambda: k.rotary_embedding_out(q_out, k_out, pos, q, kk,
                                                                     cache, d, True),
        }),
        ("apply_rotary_emb", (xr, cos_t, sin_t, True, False), {
            "cpp": lambda: cpp_ops.apply_rotary_emb(xr, cos_t, sin_t, True, False),
            "cpp kernel (out given)": lambda: k.apply_rotary_emb_out(xr_out, xr, cos_t, sin_t,
                                                                     True),
        }),
        ("dual_chunk_rotary_embedding", (pos, q, kk, *dc, d, True), {
            "cpp": lambda: cpp_ops.dual_chunk_rotary_embedding(pos, q, kk, *dc, d, True),
            "cpp kernel (out given)": lambda: k.dual_chunk_rotary_embedding_out(
                dq_out, k_out, pos, q, kk, *dc, d, True, None),
        }),
    ]
    # gemma / gated norms, fp8 quantisation (an op name, then the mode after a space)
    z = res
    q8 = torch.empty(tokens, hidden, dtype=torch.float8_e4m3fn)
    s_tok = torch.empty(tokens, 1)
    s_grp = torch.empty(tokens, hidden // 128)
    result += [
        ("gemma_rms_norm", (x, w, 1e-6), {
            "cpp": lambda: cpp_ops.gemma_rms_norm(x, w, 1e-6),
            "cpp kernel (out given)": lambda: k.gemma_rms_norm_out(out, x, w, 1e-6),
        }),
        ("gemma_fused_add_rms_norm", (x, res, w, 1e-6), {
            "cpp": lambda: cpp_ops.gemma_fused_add_rms_norm(x, res, w, 1e-6),
            "cpp kernel (out given)": lambda: k.gemma_fused_add_rms_norm_out(out, res_out, x,
                                                                             res, w, 1e-6),
        }),
        ("rms_norm_gated", (x, w, z, 1e-5, 512, False, "swish"), {
            "cpp": lambda: cpp_ops.rms_norm_gated(x, w, z, 1e-5, 512, False, "swish"),
            "cpp kernel (out given)": lambda: k.rms_norm_gated_out(out, x, w, z, 1e-5, 512,
                                                                   False, False),
        }),
        ("quant_fp8 per-token", (x, None, True), {
            "cpp": lambda: cpp_ops.quant_fp8(x, None, True),
            "cpp kernel (out given)": lambda: k.quant_fp8_dynamic_out(q8, s_tok, x, True, None),
        }),
        ("quant_fp8 group128", (x, None, False, None, 128), {
            "cpp": lambda: cpp_ops.quant_fp8(x, None, False, None, 128),
            "cpp kernel (out given)": lambda: k.quant_fp8_group_out(q8, s_grp, x, 128, False),
        }),
    ]
    if has_vllm:
        c = torch.ops._C
        xi, ri = x.clone(), res.clone()
        qi, ki = q.clone(), kk.clone()
        extra = {
            "rms_norm": lambda: c.rms_norm(out, x, w, 1e-6),
            # in place on scratch copies (values drift between calls; the time does not)
            "fused_add_rms_norm": lambda: c.fused_add_rms_norm(xi, ri, w, 1e-6),
            "silu_and_mul": lambda: c.silu_and_mul(g_out, g),
            "gelu_and_mul": lambda: c.gelu_and_mul(g_out, g),
            "rotary_embedding": lambda: c.rotary_embedding(pos, qi, ki, d, cache, True),
            # vLLM runs ApplyRotaryEmb natively on CPU; its rotary kernel does the same math
            # with positions 0..T-1 (in place, no key)
            "apply_rotary_emb": lambda: c.rotary_embedding(seq_pos, qr, None, d, cache, True),
        }
        seq_pos, qr = torch.arange(tokens), q.clone()
        # GemmaRMSNorm on vLLM's CPU path: its rms_norm kernels with weight 1 + w (formed
        # once here, in x's dtype); vLLM has no CPU kernel for dual_chunk_rotary_embedding,
        # rms_norm_gated or fp8 quant
        w1 = (w.float() + 1.0).to(dtype)
        extra["gemma_rms_norm"] = lambda: c.rms_norm(out, x, w1, 1e-6)
        extra["gemma_fused_add_rms_norm"] = lambda: c.fused_add_rms_norm(xi, ri, w1, 1e-6)
        for name, _, fns in result:
            if name in extra:
                fns["vLLM kernel"] = extra[name]
    from ops_cpu_activation import activation_cases

    result += activation_cases(tokens, inter, dtype, has_vllm)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--full", action="store_true", help="LLM sizes (4096 tokens)")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--iters", type=int, default=0)
    parser.add_argument("--no-compile", action="store_true", help="skip torch.compile rows")
    parser.add_argument("--ops", default="", help="comma-separated subset of ops")
    parser.add_argument("--vllm-lib", default="", help="vLLM kernel library (.so) to load "
                        "(default: the installed vllm's library for this CPU)")
    args = parser.parse_args()
    tokens, hidden, inter = (4096, 4096, 11008) if args.full else (1024, 4096, 4096)
    dtype = getattr(torch, args.dtype)
    iters = args.iters or (10 if args.full else 20)

    from opmux.plugins.cpu import build

    ok, message = build.build_status()
    if not ok:
        raise SystemExit(f"opmux cpp kernels unavailable: {message}")
    has_vllm = load_vllm(args.vllm_lib) is not None
    src = torch.randn(32 * 1024 * 1024)
    dst = torch.empty_like(src)
    gbps = 2 * src.numel() * 4 / median_ms(lambda: dst.copy_(src), 10) / 1e6
    print(f"{tokens} tokens, hidden {hidden}, intermediate {inter}, {args.dtype}, "
          f"{torch.get_num_threads()} threads; large copy {gbps:.1f} GB/s (read + write); "
          f"vLLM {'loaded' if has_vllm else 'not installed'}")
    wanted = set(filter(None, args.ops.split(",")))
    header = f"{'op':28s} {'contender':26s} {'ms':>9s} {'cpp speedup':>12s}"
    print(header)
    print("-" * len(header))
    for name, nargs, fns in cases(tokens, hidden, inter, dtype, has_vllm):
        if wanted and name.split(" ")[0] not in wanted:
            continue
        native = native_fn(name.split(" ")[0], fns["cpp"])
        contenders: dict[str, Fn] = {"native (eager)": lambda f=native, a=nargs: f(*a)}
        if not args.no_compile:
            try:
                compiled = torch.compile(native)
                compiled(*nargs)
                contenders["native (torch.compile)"] = lambda f=compiled, a=nargs: f(*a)
            except Exception as exc:  # shown, and the other rows still print
                print(f"{name}: torch.compile failed: {type(exc).__name__}: {str(exc)[:160]}")
        contenders.update(fns)
        rows = list(interleaved_ms(contenders, iters).items())
        cpp_ms = dict(rows)["cpp"]
        for label, ms in rows:
            print(f"{name:28s} {label:26s} {ms:9.3f} {ms / cpp_ms:11.2f}x")
        print()


if __name__ == "__main__":
    main()
