"""``opmux generate`` against ``transformers`` generate on a ~100M-parameter random Llama (CPU).

One run writes a seeded random ``LlamaForCausalLM`` checkpoint (``opmux.models.synthetic``;
8 layers, hidden 768, 12/4 heads, intermediate 2048, vocab 32000: 99.6M parameters),
loads it in both, and times greedy generation of ``--new-tokens`` tokens after prompts of
``--prompt-len`` tokens, batch 1 and 16, float32 and bfloat16: opmux's engine (paged KV
cache, providers the platform selects) against ``transformers``' ``generate(do_sample=
False)`` on the same weights (``attn_implementation="sdpa"``, its default). The two
contenders alternate within each repeat; the best of ``--repeats`` is reported as tokens/s
(generated tokens / wall time, prefill included), with the ratio. Both produce the same
greedy tokens in float32 (checked). Goal: >= 3x transformers at batch 16.

Run: ``python benchmarks/generate_cpu.py [--batch 1 16] [--dtype float32 bfloat16]
[--threads N]``;
``--small`` uses a 4-layer, hidden-256 model for a quick look.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

import opmux
from opmux.models import Engine, load_model
from opmux.models.synthetic import LLAMA_100M, LlamaShape, write_random_llama

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
_SHAPES = {
    "100m": LLAMA_100M,
    "small": LlamaShape(layers=4, hidden=256, heads=8, kv_heads=2, intermediate=512,
                        vocab=4000),
}


def best_s(fns: dict[str, Callable[[], object]], repeats: int) -> dict[str, float]:
    """Best wall time per contender; one warm-up each, then alternating repeats."""
    for fn in fns.values():
        fn()
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
    return {name: min(t) for name, t in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--dtype", choices=sorted(_DTYPES), nargs="+",
                        default=["float32", "bfloat16"])
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--small", action="store_true", help="a small model (quick look)")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch CPU threads for both (default 1: on a shared machine "
                             "OpenMP waits cost more than they gain)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    import transformers

    shape = _SHAPES["small" if args.small else "100m"]
    opmux.load_plugins()
    print(f"random Llama, {shape.num_parameters() / 1e6:.1f}M parameters ({shape.layers} "
          f"layers, hidden {shape.hidden}, vocab {shape.vocab}); prompt {args.prompt_len}, "
          f"{args.new_tokens} new tokens; torch threads {torch.get_num_threads()}; "
          f"transformers {transformers.__version__}")
    print(f"{'dtype':<9} {'batch':>5} {'opmux tok/s':>12} {'transformers tok/s':>19} "
          f"{'ratio':>6}")
    worst16 = float("inf")
    with tempfile.TemporaryDirectory(prefix="opmux-bench-") as tmp:
        write_random_llama(Path(tmp), shape, seed=0)
        for dtype_name in args.dtype:
            dtype = _DTYPES[dtype_name]
            ours = Engine(load_model(tmp, dtype), block_size=16)
            hf = transformers.LlamaForCausalLM.from_pretrained(tmp, dtype=dtype).eval()
            g = torch.Generator().manual_seed(1)
            for batch in args.batch:
                ids = torch.randint(0, shape.vocab, (batch, args.prompt_len), generator=g)
                prompts = ids.tolist()
                n = args.new_tokens

                def run_ours(p: list[list[int]] = prompts, n: int = n,
                             e: Engine = ours) -> list[list[int]]:
                    return e.generate(p, n).outputs

                def run_hf(x: torch.Tensor = ids, n: int = n, m: Any = hf) -> list[list[int]]:
                    with torch.inference_mode():
                        out = m.generate(x, attention_mask=torch.ones_like(x),
                                          max_new_tokens=n, min_new_tokens=n,
                                          do_sample=False, pad_token_id=0)
                    rows: list[list[int]] = out[:, x.shape[1]:].tolist()
                    return rows

                if dtype == torch.float32 and run_ours() != run_hf():
                    raise SystemExit("opmux and transformers disagree on the greedy tokens")
                best = best_s({"opmux": run_ours, "transformers": run_hf}, args.repeats)
                tps = {k: batch * n / v for k, v in best.items()}
                ratio = tps["opmux"] / tps["transformers"]
                if batch == 16:
                    worst16 = min(worst16, ratio)
                print(f"{dtype_name:<9} {batch:>5} {tps['opmux']:>12.1f} "
                      f"{tps['transformers']:>19.1f} {ratio:>5.2f}x", flush=True)
    if worst16 != float("inf"):
        print(f"goal >= 3x transformers at batch 16: "
              f"{'met' if worst16 >= 3 else 'MISSED'} (worst {worst16:.2f}x)")


if __name__ == "__main__":
    main()
