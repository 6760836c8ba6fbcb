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

Where ``vllm`` is installed (the vllm lane), vLLM is a third contender: for each dtype and
batch a fresh process runs ``opmux.testing.vllm_generate`` on the same checkpoint and the
same token-id prompts (``OPMUX_VLLM=0``: vLLM's own kernels; eager; its CPU threads bound
to as many cores as ``--threads``), one warm-up request, then ``--repeats`` timed
generations, best reported; ``--vllm-plugin`` adds a vLLM + opmux column. In float32 the
script prints how many of vLLM's greedy rows equal opmux's.

Run: ``python benchmarks/generate_cpu.py [--batch 1 16] [--dtype float32 bfloat16]
[--threads N] [--no-vllm] [--vllm-plugin]``;
``--small`` uses a 4-layer, hidden-256 model for a quick look; ``--hidden H --layers L``
the random Llama of ``benchmarks/vllm_cpu.py`` at that size (heads of 32 up to hidden 256
and of 64 above, a quarter as many kv heads, intermediate 2x hidden up to 256 and 3x
above, vocabulary 512): ``--hidden 256 --layers 4 --new-tokens 128`` and ``--hidden 1024
--layers 8 --new-tokens 64`` are the two sizes of the vLLM model-scale check.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

import opmux
from opmux.models import Engine, load_model
from opmux.models.synthetic import LLAMA_100M, LlamaShape, write_random_llama
from opmux.testing.vllm_generate import token_prompts

ROOT = Path(__file__).resolve().parents[1]

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
_SHAPES = {
    "100m": LLAMA_100M,
    "small": LlamaShape(layers=4, hidden=256, heads=8, kv_heads=2, intermediate=512,
                        vocab=4000),
}


def shape_for(hidden: int, layers: int) -> LlamaShape:
    """The random Llama of ``benchmarks/vllm_cpu.py`` at ``hidden`` x ``layers``."""
    heads = hidden // (32 if hidden <= 256 else 64)
    return LlamaShape(layers=layers, hidden=hidden, heads=heads, kv_heads=max(1, heads // 4),
                      intermediate=(2 if hidden <= 256 else 3) * hidden, vocab=512)


def run_vllm(model: Path, work: Path, *, dtype: str, batch: int, prompt_len: int,
             new_tokens: int, repeats: int, threads: int, plugin: bool) -> dict[str, Any]:
    """One fresh vLLM process (``opmux.testing.vllm_generate``); its JSON report."""
    out = work / f"vllm-{dtype}-{batch}-{int(plugin)}.json"
    env = dict(os.environ, OPMUX_VLLM="1" if plugin else "0", VLLM_CPU_KVCACHE_SPACE="1",
               VLLM_CACHE_ROOT=str(work / "vllm-cache"),
               VLLM_CPU_OMP_THREADS_BIND=f"0-{threads - 1}",
               PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    cmd = [sys.executable, "-m", "opmux.testing.vllm_generate", "--model", str(model),
           "--out", str(out), "--batch", str(batch), "--max-tokens", str(new_tokens),
           "--prompt-len", str(prompt_len), "--dtype", dtype, "--repeat", str(repeats)]
    proc = subprocess.run(cmd, env=env, cwd=work, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"vLLM failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}")
    report: dict[str, Any] = json.loads(out.read_text())
    return report


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
    parser.add_argument("--hidden", type=int, default=0,
                        help="with --layers: the vllm_cpu.py random Llama of this size")
    parser.add_argument("--layers", type=int, default=0)
    parser.add_argument("--no-vllm", action="store_true", help="leave vLLM out")
    parser.add_argument("--vllm-plugin", action="store_true",
                        help="also time vLLM with the opmux plugin on")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch CPU threads for both (default 1: on a shared machine "
                             "OpenMP waits cost more than they gain)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    import transformers

    if args.hidden or args.layers:
        if not (args.hidden and args.layers):
            parser.error("--hidden and --layers go together")
        shape = shape_for(args.hidden, args.layers)
    else:
        shape = _SHAPES["small" if args.small else "100m"]
    with_vllm = not args.no_vllm and importlib.util.find_spec("vllm") is not None
    peers = ["transformers"] + (["vLLM"] if with_vllm else []) + (
        ["vLLM+opmux"] if with_vllm and args.vllm_plugin else [])
    opmux.load_plugins()
    print(f"random Llama, {shape.num_parameters() / 1e6:.1f}M parameters ({shape.layers} "
          f"layers, hidden {shape.hidden}, vocab {shape.vocab}); prompt {args.prompt_len}, "
          f"{args.new_tokens} new tokens; torch threads {torch.get_num_threads()}; "
          f"transformers {transformers.__version__}")
    print(f"{'dtype':<9} {'batch':>5} {'opmux tok/s':>12} "
          + " ".join(f"{p + ' tok/s':>18} {'ratio':>6}" for p in peers)
          + (f" {'vLLM rows = opmux':>17}" if with_vllm else ""))
    worst16 = float("inf")
    with tempfile.TemporaryDirectory(prefix="opmux-bench-") as tmp:
        write_random_llama(Path(tmp), shape, seed=0)
        # vLLM loads the checkpoint in its own processes; it needs no tokenizer (token ids)
        work = Path(tmp) / "work"
        work.mkdir()
        for dtype_name in args.dtype:
            dtype = _DTYPES[dtype_name]
            ours = Engine(load_model(tmp, dtype), block_size=16)
            hf = transformers.LlamaForCausalLM.from_pretrained(tmp, dtype=dtype).eval()
            for batch in args.batch:
                prompts = token_prompts(batch, args.prompt_len, shape.vocab)
                ids = torch.tensor(prompts)
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

                ours_rows = run_ours()
                if dtype == torch.float32 and ours_rows != run_hf():
                    raise SystemExit("opmux and transformers disagree on the greedy tokens")
                best = best_s({"opmux": run_ours, "transformers": run_hf}, args.repeats)
                tps = {k: batch * n / v for k, v in best.items()}
                ratio = tps["opmux"] / tps["transformers"]
                if batch == 16:
                    worst16 = min(worst16, ratio)
                same = ""
                for peer in peers[1:]:
                    rep = run_vllm(Path(tmp), work, dtype=dtype_name, batch=batch,
                                   prompt_len=args.prompt_len, new_tokens=n,
                                   repeats=args.repeats, threads=args.threads,
                                   plugin=peer != "vLLM")
                    tps[peer] = float(rep["best_tokens_per_s"])
                    if peer == "vLLM":
                        rows = sum(a == b for a, b in zip(rep["outputs"], ours_rows, strict=True))
                        same = f"{rows}/{batch}" if dtype == torch.float32 else "-"
                print(f"{dtype_name:<9} {batch:>5} {tps['opmux']:>12.1f} "
                      + " ".join(f"{tps[p]:>18.1f} {tps['opmux'] / tps[p]:>5.2f}x"
                                 for p in peers)
                      + (f" {same:>17}" if with_vllm else ""), flush=True)
    if worst16 != float("inf"):
        print(f"goal >= 3x transformers at batch 16: "
              f"{'met' if worst16 >= 3 else 'MISSED'} (worst {worst16:.2f}x)")


if __name__ == "__main__":
    main()
