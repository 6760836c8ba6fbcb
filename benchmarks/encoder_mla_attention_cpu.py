"""CPU benchmark of ``encoder_attention`` and ``mla_attention`` decode.

Contenders, timed round-robin in one process: ``native eager`` (the catalog reference),
``torch.compile(native)`` (Inductor, graph breaks allowed: the reference loops over sequences
in Python) and ``cpp`` (the provider as dispatch calls it: validation, allocation, kernel).
Ratios are against native eager and against the compiled reference.

Shapes (defaults):

- encoder attention: a vision tower's packed batch, 4 images x 576 patches (ViT-L/14 at
  336 px), 16 heads of 64, non-causal;
- MLA decode: DeepSeek-V2-Lite's attention (16 heads, qk_nope 128, rope 64, kv_lora_rank
  512, v_head_dim 128), 8 sequences x 2048 cached tokens, blocks of 64, one query each.

``--small`` runs small shapes (a quick check while developing).

    python benchmarks/encoder_mla_attention_cpu.py [--small] [--dtype float32|bfloat16] [--iters N]
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from timing import interleaved_ms

import opmux

Fn = Callable[[], Any]


def encoder_case(images: int, patches: int, heads: int, head: int,
                 dtype: torch.dtype) -> tuple[str, tuple[Any, ...]]:
    g = torch.Generator().manual_seed(0)
    tokens = images * patches
    qkv = torch.randn(tokens, 3, heads, head, generator=g).to(dtype)
    q, k, v = qkv.unbind(1)
    cu = torch.arange(0, tokens + 1, patches, dtype=torch.int32)
    label = f"encoder_attention {images}x{patches} tokens, {heads} heads x {head}"
    return label, (q, k, v, cu, patches, head ** -0.5)


def mla_decode_case(seqs: int, context: int, heads: int, nope: int, rope: int, lora: int,
                    v_dim: int, block: int, dtype: torch.dtype) -> tuple[str, tuple[Any, ...]]:
    g = torch.Generator().manual_seed(1)
    per_seq = (context + block - 1) // block
    perm = torch.randperm(seqs * per_seq, generator=g).to(torch.int32)
    tables = perm.view(seqs, per_seq)
    cache = torch.randn(seqs * per_seq, block, lora + rope, generator=g).to(dtype)
    q = torch.randn(seqs, heads, nope + rope, generator=g).to(dtype)
    weight = (torch.randn(heads * (nope + v_dim), lora, generator=g) * lora ** -0.5).to(dtype)
    lens = torch.full((seqs,), context, dtype=torch.int32)
    qsl = torch.arange(seqs + 1, dtype=torch.int32)
    label = (f"mla_attention decode {seqs} seqs x {context} ctx, {heads} heads, "
             f"L={lora} R={rope}")
    return label, (q, cache, weight, tables, lens, qsl, (nope + rope) ** -0.5, nope)


def run(label: str, op_name: str, args: tuple[Any, ...], iters: int) -> None:
    op = opmux.get_op(op_name)
    native = op.impls["native"].fn
    cpp = op.impls["cpp"]
    if not (cpp.supported and op.dispatch(*args).provider == "cpp"):
        raise SystemExit(f"{op_name}: the cpp provider does not serve these arguments "
                         f"({op.explain(*args)})")
    compiled = torch.compile(native)
    fns: dict[str, Fn] = {
        "native eager": lambda: native(*args),
        "torch.compile(native)": lambda: compiled(*args),
        "cpp": lambda: cpp.fn(*args),
    }
    want = native(*args).float()
    for name, fn in fns.items():   # every contender computes the same result
        torch.testing.assert_close(fn().float(), want, atol=3e-2, rtol=3e-2, msg=name)
    ms = interleaved_ms(fns, iters)
    print(f"\n{label}")
    print(f"{'contender':<24}{'ms':>10}{'vs eager':>10}{'vs compile':>12}")
    for name, t in ms.items():
        print(f"{name:<24}{t:>10.2f}{ms['native eager'] / t:>9.2f}x"
              f"{ms['torch.compile(native)'] / t:>11.2f}x")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--small", action="store_true", help="small shapes (quick check)")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    parser.add_argument("--iters", type=int, default=10)
    ns = parser.parse_args()
    dtype = getattr(torch, ns.dtype)
    opmux.load_plugins()
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {ns.dtype}")
    with torch.no_grad():
        if ns.small:
            cases = [("encoder_attention", encoder_case(2, 64, 4, 32, dtype)),
                     ("mla_attention", mla_decode_case(2, 128, 4, 32, 16, 64, 32, 16, dtype))]
        else:
            cases = [("encoder_attention", encoder_case(4, 576, 16, 64, dtype)),
                     ("mla_attention", mla_decode_case(8, 2048, 16, 128, 64, 512, 128, 64,
                                                       dtype))]
        for op_name, (label, args) in cases:
            run(label, op_name, args, ns.iters)


if __name__ == "__main__":
    main()
