"""Plain ``transformers`` against ``transformers`` + opmux (``opmux.integrations.transformers``)
on random Llama checkpoints (CPU).

One run writes seeded random ``LlamaForCausalLM`` checkpoints (``opmux.models.synthetic``):
``tiny`` (2 layers, hidden 256, 8/2 heads, intermediate 512, vocab 4000) and ``100m``
(8 layers, hidden 768, 12/4 heads, intermediate 2048, vocab 32000: 99.6M parameters), loads
each with ``AutoModelForCausalLM.from_pretrained`` (``sdpa`` attention, transformers'
default) and times greedy ``generate`` of ``--new-tokens`` tokens after prompts of
``--prompt-len`` tokens, batch 1 and 16, float32 and bfloat16, with the model plain and after
``enable(model)`` (the same weights; ``enable``/``disable`` toggle between the rounds). The
contenders alternate within every round (``timing.samples``); the medians are printed as
tokens/s (generated tokens / time, prefill included) with the ratio opmux / plain; the time
is wall time, or with ``--clock thread --threads 1`` the main thread's CPU time (steadier on
a shared machine).
In float32 both produce the same greedy tokens (checked).

Run: ``python benchmarks/transformers_cpu.py [--models tiny 100m] [--batch 1 16]
[--dtype float32 bfloat16] [--rounds 3] [--threads N] [--clock wall|thread]``.
"""

from __future__ import annotations

import argparse
import functools
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from timing import samples

from opmux.integrations import transformers as otf
from opmux.models.synthetic import LLAMA_100M, LlamaShape, write_random_llama

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
_SHAPES = {
    "tiny": LlamaShape(layers=2, hidden=256, heads=8, kv_heads=2, intermediate=512,
                       vocab=4000),
    "100m": LLAMA_100M,
}


def _load(directory: Path, dtype: torch.dtype) -> Any:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(directory, dtype=dtype)
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model.eval()


def _generate(model: Any, ids: torch.Tensor, new_tokens: int, opmux: bool) -> torch.Tensor:
    (otf.enable if opmux else otf.disable)(model)
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                             do_sample=False)
    return out[:, ids.shape[1]:]


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--models", nargs="+", default=list(_SHAPES), choices=list(_SHAPES))
    parser.add_argument("--batch", nargs="+", type=int, default=[1, 16])
    parser.add_argument("--dtype", nargs="+", default=list(_DTYPES), choices=list(_DTYPES))
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=0)
    parser.add_argument("--clock", choices=("wall", "thread"), default="wall",
                        help="thread: the main thread's CPU time, steadier on a shared "
                             "machine (needs --threads 1)")
    args = parser.parse_args()
    if args.clock == "thread" and args.threads != 1:
        parser.error("--clock thread needs --threads 1 (other threads' work is not counted)")
    clock = time.thread_time if args.clock == "thread" else time.perf_counter
    if args.threads:
        torch.set_num_threads(args.threads)
    import transformers

    print(f"torch {torch.__version__}, transformers {transformers.__version__}, "
          f"{torch.get_num_threads()} threads; prompt {args.prompt_len}, "
          f"{args.new_tokens} new tokens, median of {args.rounds} alternating rounds, "
          f"{args.clock} clock")
    print(f"{'model':>6} {'dtype':>9} {'batch':>5} {'plain tok/s':>12} {'opmux tok/s':>12} "
          f"{'opmux/plain':>11}  tokens")
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.models:
            directory = write_random_llama(Path(tmp) / name, _SHAPES[name], seed=0)
            for dtype_name in args.dtype:
                model = _load(directory, _DTYPES[dtype_name])
                for batch in args.batch:
                    gen = torch.Generator().manual_seed(batch)
                    ids = torch.randint(1, _SHAPES[name].vocab, (batch, args.prompt_len),
                                        generator=gen)
                    plain = _generate(model, ids, args.new_tokens, False)
                    opmux = _generate(model, ids, args.new_tokens, True)
                    same = "equal" if torch.equal(plain, opmux) else "differ"
                    times = samples({
                        "plain": functools.partial(_generate, model, ids, args.new_tokens, False),
                        "opmux": functools.partial(_generate, model, ids, args.new_tokens, True),
                    }, rounds=args.rounds, warmup=0, clock=clock)
                    rate = {k: batch * args.new_tokens / statistics.median(v)
                            for k, v in times.items()}
                    print(f"{name:>6} {dtype_name:>9} {batch:>5} {rate['plain']:>12.1f} "
                          f"{rate['opmux']:>12.1f} {rate['opmux'] / rate['plain']:>10.2f}x  "
                          f"{same}", flush=True)
                otf.disable(model)


if __name__ == "__main__":
    main()
