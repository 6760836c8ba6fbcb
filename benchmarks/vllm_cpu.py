"""vLLM offline generation tokens/s with the opmux plugin off and on (vllm lane).

``python benchmarks/vllm_cpu.py [--model DIR] [--hidden 256] [--layers 4] [--dtype float32]
[--batch 16] [--prompt-len 32] [--max-tokens 128] [--repeat 5] [--modes eager,compile]
[--rounds 1]``: one checkpoint (a random Llama written here with ``transformers`` unless
``--model``: hidden ``--hidden``, ``--layers`` layers, heads of 32 up to hidden 256 and of
64 above, a quarter as many kv heads, intermediate 2x hidden up to 256 and 3x above, the
512-token vocabulary of :mod:`opmux.testing.tiny_models`; the defaults are its tiny Llama),
the same process pattern for every run -- a fresh process running
``opmux.testing.vllm_generate`` (engine start, one warm-up request, then ``--batch`` prompts
of ``--prompt-len`` token ids x ``--max-tokens`` greedy tokens, EOS ignored, timed
``--repeat`` times, median) -- with ``OPMUX_VLLM=0`` (vLLM's own
kernels) and with the plugin on, in eager mode (``enforce_eager=True``) and torch.compile
mode (vLLM's default compilation). Runs alternate off/on within each mode. Prints tokens/s
per run, the ratio on/off per mode (the mean, and the median and range of the per-round
ratios), and checks that both produced the same tokens. Odd rounds run "on" before "off".

The two sizes of the model-scale check: ``--hidden 256 --layers 4 --max-tokens 128`` (2.5M
parameters) and ``--hidden 1024 --layers 8 --max-tokens 64`` (97.5M), each in ``--dtype
float32`` and ``bfloat16``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def shape_for(hidden: int, layers: int) -> dict[str, int]:
    """The :func:`opmux.testing.tiny_models.write_tiny_model` overrides for a size."""
    head = 32 if hidden <= 256 else 64
    heads = hidden // head
    return {"hidden_size": hidden, "num_hidden_layers": layers,
            "num_attention_heads": heads, "num_key_value_heads": max(1, heads // 4),
            "intermediate_size": (2 if hidden <= 256 else 3) * hidden}


def run_once(model: Path, work: Path, *, plugin: bool, compile_mode: bool, batch: int,
             max_tokens: int, dtype: str, prompt_len: int, repeat: int,
             tag: str) -> dict[str, object]:
    out = work / f"{tag}.json"
    env = dict(os.environ)
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    env.setdefault("VLLM_CACHE_ROOT", str(work / "vllm-cache"))
    env["OPMUX_VLLM"] = "1" if plugin else "0"
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    cmd = [sys.executable, "-m", "opmux.testing.vllm_generate", "--model", str(model),
           "--out", str(out), "--batch", str(batch), "--max-tokens", str(max_tokens),
           "--dtype", dtype, "--prompt-len", str(prompt_len), "--repeat", str(repeat)]
    if compile_mode:
        cmd.append("--compile")
    proc = subprocess.run(cmd, env=env, cwd=work, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"{tag} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}")
    return json.loads(out.read_text())  # type: ignore[no-any-return]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, default=None)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--repeat", type=int, default=5,
                        help="timed generations per process (their median)")
    parser.add_argument("--modes", default="eager,compile")
    parser.add_argument("--rounds", type=int, default=1)
    ns = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="opmux-vllm-bench-") as tmp:
        work = Path(tmp)
        model = ns.model
        if model is None:
            from opmux.testing.tiny_models import write_tiny_model

            shape = shape_for(ns.hidden, ns.layers)
            model = write_tiny_model(work / "llama", "llama", **shape)
            print("random Llama " + ", ".join(f"{k} {v}" for k, v in shape.items()))
        print(f"model {model}  {ns.dtype}  batch {ns.batch} x {ns.prompt_len}-token prompts x "
              f"{ns.max_tokens} new tokens  {os.cpu_count()} cpus")
        print(f"{'mode':8} {'round':>5} {'plugin off tok/s':>17} {'plugin on tok/s':>16} "
              f"{'on/off':>7} {'same tokens':>12}")
        for mode in ns.modes.split(","):
            compile_mode = mode == "compile"
            off_total = on_total = 0.0
            ratios: list[float] = []
            for r in range(ns.rounds):
                res: dict[bool, dict[str, object]] = {}
                # odd rounds run "on" first, so a drift of the machine does not favour one
                for plugin in (False, True) if r % 2 == 0 else (True, False):
                    res[plugin] = run_once(model, work, plugin=plugin, compile_mode=compile_mode,
                                           batch=ns.batch, max_tokens=ns.max_tokens,
                                           dtype=ns.dtype, prompt_len=ns.prompt_len,
                                           repeat=ns.repeat,
                                           tag=f"{mode}-{'on' if plugin else 'off'}-{r}")
                off, on = res[False], res[True]
                off_tps, on_tps = float(off["tokens_per_s"]), float(on["tokens_per_s"])
                off_total += off_tps
                on_total += on_tps
                ratios.append(on_tps / off_tps)
                print(f"{mode:8} {r:>5} {off_tps:>17.1f} {on_tps:>16.1f} "
                      f"{on_tps / off_tps:>6.2f}x {on['outputs'] == off['outputs']!s:>12}",
                      flush=True)
            if ns.rounds > 1:
                print(f"{mode:8} {'mean':>5} {off_total / ns.rounds:>17.1f} "
                      f"{on_total / ns.rounds:>16.1f} {on_total / off_total:>6.2f}x")
                print(f"{mode:8} on/off per round: median {statistics.median(ratios):.2f}x, "
                      f"range {min(ratios):.2f}x to {max(ratios):.2f}x")

if __name__ == "__main__":
    main()
