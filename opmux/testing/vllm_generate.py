"""Offline vLLM generation in a process of its own, for tests and benchmarks.

``python -m opmux.testing.vllm_generate --model DIR --out FILE.json [--batch 16]
[--max-tokens 128] [--repeat 5] [--compile]`` builds ``vllm.LLM(model=DIR,
dtype="float32", max_model_len=512)`` (eager unless ``--compile``), generates greedily from
``--batch`` fixed prompts (a warm-up request first) ``--repeat`` times and writes
``{"outputs": [[token ids], ...], "tokens_per_s": float, "seconds": float, "tokens": int,
"plugin": [...]}`` (tokens/s and seconds: the median repeat). Whether the opmux plugin is
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

__all__ = ["PROMPTS", "main", "prompts"]

PROMPTS = (
    "The quick brown fox", "A paged attention kernel reads", "Plugins register providers",
    "Tokens are generated one at a time", "Each layer normalises its input",
    "0123456789 + - * / =", "prefill fills the cache", "a priority list picks one",
)
"""Seed prompts; :func:`prompts` extends them to any batch size."""


def prompts(batch: int) -> list[str]:
    """``batch`` distinct prompts built from :data:`PROMPTS`."""
    return [f"{PROMPTS[i % len(PROMPTS)]} #{i}" for i in range(batch)]


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
    ns = parser.parse_args(argv)

    import vllm

    from opmux.core import config
    from opmux.integrations.vllm import registered

    llm = vllm.LLM(model=ns.model, dtype="float32", enforce_eager=not ns.compile,
                   max_model_len=512, seed=0,
                   worker_extension_cls="opmux.integrations.vllm.WorkerExtension")
    params = vllm.SamplingParams(temperature=0.0, max_tokens=ns.max_tokens, ignore_eos=True)
    llm.generate(["warm up"], vllm.SamplingParams(temperature=0.0, max_tokens=4),
                 use_tqdm=False)
    times = []
    for _ in range(max(1, ns.repeat)):
        start = time.perf_counter()
        results = llm.generate(prompts(ns.batch), params, use_tqdm=False)
        times.append(time.perf_counter() - start)
    seconds = statistics.median(times)
    outputs = [list(r.outputs[0].token_ids) for r in results]
    tokens = sum(len(o) for o in outputs)
    if config.trace_path() is not None:
        llm.collective_rpc("opmux_trace_flush")
    report = {"outputs": outputs, "tokens": tokens, "seconds": seconds,
              "tokens_per_s": tokens / seconds, "plugin": registered() or []}
    with open(ns.out, "w") as fh:
        json.dump(report, fh)
    return report


if __name__ == "__main__":
    main()
