"""Offline vLLM generation in a process of its own, for tests and benchmarks.

``python -m opmux.testing.vllm_generate --model DIR --out FILE.json [--batch 16]
[--max-tokens 128] [--repeat 5] [--compile] [--dtype float32] [--prompt-len N]`` builds
``vllm.LLM(model=DIR, dtype=DTYPE, max_model_len=512)`` (eager unless ``--compile``),
generates greedily (EOS ignored) from ``--batch`` fixed prompts -- text, or with
``--prompt-len`` seeded token ids of that length (:func:`token_prompts`; then vLLM runs
without a tokenizer, ``skip_tokenizer_init``, and the checkpoint needs none) -- (a warm-up
request first) ``--repeat`` times and writes
``{"outputs": [[token ids], ...], "tokens_per_s": float, "best_tokens_per_s": float,
"seconds": float, "tokens": int, "plugin": [...]}`` (tokens/s and seconds: the median
repeat; ``best_tokens_per_s``: the fastest). Whether the opmux plugin is
active is up to the environment (``OPMUX_VLLM=0`` turns it off); the ``plugin`` entry lists
what it replaced in this process (empty when off). vLLM spawns its engine process, so this
module keeps its work under ``if __name__ == "__main__":``. The workers carry
:class:`opmux.integrations.vllm.WorkerExtension`; under ``OPMUX_TRACE`` they write their
counts before the engine shuts down (vLLM may kill them before their exit hooks run).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any

__all__ = ["PROMPTS", "main", "prompts", "token_prompts"]

PROMPTS = (
    "The quick brown fox", "A paged attention kernel reads", "Plugins register providers",
    "Tokens are generated one at a time", "Each layer normalises its input",
    "0123456789 + - * / =", "prefill fills the cache", "a priority list picks one",
)
"""Seed prompts; :func:`prompts` extends them to any batch size."""


def prompts(batch: int) -> list[str]:
    """``batch`` distinct prompts built from :data:`PROMPTS`."""
    return [f"{PROMPTS[i % len(PROMPTS)]} #{i}" for i in range(batch)]


def token_prompts(batch: int, length: int, vocab: int, seed: int = 0) -> list[list[int]]:
    """``batch`` prompts of ``length`` token ids below ``vocab`` (seeded, the same every
    run), none of them id 0 (the tiny checkpoints' BOS/EOS)."""
    import random

    rng = random.Random(seed)
    return [[rng.randrange(1, vocab) for _ in range(length)] for _ in range(batch)]


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--repeat", type=int, default=5,
                        help="timed generations; tokens/s is their median (one is < 1 s here)")
    parser.add_argument("--compile", action="store_true",
                        help="torch.compile mode (vLLM's default); eager otherwise")
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"),
                        help="the model's dtype in vLLM")
    parser.add_argument("--prompt-len", type=int, default=0,
                        help="prompts of this many seeded token ids (0: the text prompts)")
    ns = parser.parse_args(argv)

    import vllm

    from opmux.core import config
    from opmux.integrations.vllm import registered

    ids_only = ns.prompt_len > 0  # token ids in and out: no tokenizer needed
    llm = vllm.LLM(model=ns.model, dtype=ns.dtype, enforce_eager=not ns.compile,
                   max_model_len=512, seed=0, skip_tokenizer_init=ids_only,
                   worker_extension_cls="opmux.integrations.vllm.WorkerExtension")
    params = vllm.SamplingParams(temperature=0.0, max_tokens=ns.max_tokens, ignore_eos=True,
                                 detokenize=not ids_only)
    batch: list[Any]
    warm_up: list[Any]
    if ids_only:
        vocab = llm.llm_engine.model_config.get_vocab_size()
        batch = [{"prompt_token_ids": ids}
                 for ids in token_prompts(ns.batch, ns.prompt_len, vocab)]
        warm_up = [{"prompt_token_ids": token_prompts(1, 4, vocab, seed=1)[0]}]
    else:
        batch, warm_up = prompts(ns.batch), ["warm up"]
    llm.generate(warm_up, vllm.SamplingParams(temperature=0.0, max_tokens=4,
                                              detokenize=not ids_only), use_tqdm=False)
    times = []
    for _ in range(max(1, ns.repeat)):
        start = time.perf_counter()
        results = llm.generate(batch, params, use_tqdm=False)
        times.append(time.perf_counter() - start)
    seconds = statistics.median(times)
    best = min(times)
    outputs = [list(r.outputs[0].token_ids) for r in results]
    tokens = sum(len(o) for o in outputs)
    if config.trace_path() is not None:
        llm.collective_rpc("opmux_trace_flush")
    report = {"outputs": outputs, "tokens": tokens, "seconds": seconds,
              "tokens_per_s": tokens / seconds, "best_tokens_per_s": tokens / best,
              "plugin": registered() or []}
    with open(ns.out, "w") as fh:
        json.dump(report, fh)
    return report


if __name__ == "__main__":
    main()
