"""Timing helpers shared by the CPU benchmarks (run them as scripts from this folder)."""

from __future__ import annotations

import importlib.util
import os
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch


def median_ms(fn: Callable[[], Any], iters: int, warmup: int = 2) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def interleaved_ms(fns: dict[str, Callable[[], Any]], iters: int) -> dict[str, float]:
    """Median ms per contender, timed round-robin so that load from other processes on a
    shared machine hits every contender alike (the ratios stay meaningful)."""
    for fn in fns.values():
        fn()
        fn()
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(iters):
        for name, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
    return {name: statistics.median(t) * 1e3 for name, t in times.items()}


def copy_gbps() -> float:
    src = torch.randn(32 * 1024 * 1024)  # 128 MiB
    dst = torch.empty_like(src)
    ms = median_ms(lambda: dst.copy_(src), 10)
    return 2 * src.numel() * 4 / ms / 1e6


def load_vllm() -> str | None:
    """Load vLLM's CPU kernel library if vllm is installed; returns its path or None."""
    spec = importlib.util.find_spec("vllm")
    if spec is None or spec.origin is None:
        return None
    root = os.path.dirname(spec.origin)
    for name in ("_C_AVX512.abi3.so", "_C_AVX2.abi3.so", "_C.abi3.so"):
        path = os.path.join(root, name)
        if os.path.exists(path):
            try:
                torch.ops.load_library(path)
                return path
            except OSError:
                continue
    return None
