"""Timing helpers shared by the benchmarks (run them as scripts from this folder).

Every benchmark times through :func:`samples`: contenders take turns within each round, so
load from other processes on a shared machine hits all of them alike and the ratios printed
against a baseline of the same run stay meaningful. ``xla_paged_attention.py`` (a step includes
the host-to-device copy, the device sync and a compile count) and ``gpu_kernels.py`` (CUDA
events with a cold L2 before each run) time their own way; ``startup.py`` times fresh
interpreters.
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import os
import statistics
import time
from collections.abc import Callable, Mapping
from typing import Any

import torch


def samples(fns: Mapping[str, Callable[[], Any]], *, rounds: int, calls: int = 1,
            warmup: int = 2, clock: Callable[[], float] = time.perf_counter
            ) -> dict[str, list[float]]:
    """Seconds per call of each contender, one sample per round.

    :param fns: contender name -> a call taking no arguments.
    :param rounds: samples per contender; the contenders alternate within every round, in
        reverse order every other round (so none always runs just after another).
    :param calls: calls per sample (many for microsecond calls, one for long ones).
    :param warmup: untimed calls of each contender first.
    :param clock: wall time by default; ``time.thread_time`` counts only the calling
        thread's CPU time, which other processes on a shared machine do not inflate (right
        only when all the work runs on that thread, e.g. ``torch.set_num_threads(1)``).
    """
    for fn in fns.values():
        for _ in range(warmup):
            fn()
    out: dict[str, list[float]] = {name: [] for name in fns}
    order = list(fns.items())
    enabled = gc.isenabled()
    gc.disable()  # as timeit does: a collection is no contender's cost
    try:
        for r in range(rounds):
            for name, fn in (order if r % 2 == 0 else order[::-1]):
                start = clock()
                for _ in range(calls):
                    fn()
                out[name].append((clock() - start) / calls)
    finally:
        if enabled:
            gc.enable()
    return out


def interleaved_us(fns: Mapping[str, Callable[[], Any]], *, calls: int, rounds: int,
                   warmup: int = 2, clock: Callable[[], float] = time.perf_counter
                   ) -> dict[str, float]:
    """Median microseconds per call of each contender (see :func:`samples`)."""
    return {name: statistics.median(v) * 1e6 for name, v in
            samples(fns, rounds=rounds, calls=calls, warmup=warmup, clock=clock).items()}


def median_ms(fn: Callable[[], Any], iters: int, warmup: int = 2) -> float:
    """Median milliseconds of one call over ``iters`` calls."""
    return statistics.median(samples({"fn": fn}, rounds=iters, warmup=warmup)["fn"]) * 1e3


def interleaved_ms(fns: Mapping[str, Callable[[], Any]], iters: int) -> dict[str, float]:
    """Median milliseconds per contender over ``iters`` interleaved rounds."""
    return {name: statistics.median(v) * 1e3
            for name, v in samples(fns, rounds=iters).items()}


def require_cpu_plugin() -> None:
    """Load opmux's plugins and stop unless the built-in ``cpu`` plugin is loaded: without it
    (opmux on ``PYTHONPATH`` but not installed, so no entry points) every op runs native and
    an Engine figure would say nothing about opmux's kernels."""
    import opmux

    opmux.load_plugins()
    cpu = [r for r in opmux.plugin_report() if r.name == "cpu"]
    if not cpu:
        raise SystemExit("opmux's cpu plugin was not found: install opmux into this "
                         "environment (pip install -e .) so its entry points are found")
    if cpu[0].status != "loaded":
        raise SystemExit(f"opmux's cpu plugin is {cpu[0].status}: {cpu[0].reason}")


def copy_gbps() -> float:
    src = torch.randn(32 * 1024 * 1024)  # 128 MiB
    dst = torch.empty_like(src)
    ms = median_ms(lambda: dst.copy_(src), 10)
    return 2 * src.numel() * 4 / ms / 1e6


def load_vllm(path: str = "") -> str | None:
    """Load vLLM's CPU kernel library; returns its path, or None when there is none to load.

    ``path`` names the library; without it the installed ``vllm`` package's library for this
    CPU is taken by vLLM's own rule (``vllm.platforms.cpu``): ``_C`` where torch reports
    AVX-512 with bf16 (that build also carries the AMX kernels), ``_C_AVX512`` where it reports
    AVX-512 only, ``_C_AVX2`` otherwise. A library built for more than the CPU has kills the
    process with an illegal instruction, which no ``except`` can catch.
    """
    if path:
        candidates = [path]
    else:
        spec = importlib.util.find_spec("vllm")
        if spec is None or spec.origin is None:
            return None
        root = os.path.dirname(spec.origin)
        if torch.cpu._is_avx512_supported():
            names = (["_C.abi3.so"] if torch.cpu._is_avx512_bf16_supported()
                     else ["_C_AVX512.abi3.so"])
        else:
            names = ["_C_AVX2.abi3.so"]
        candidates = [os.path.join(root, name) for name in names]
    for candidate in candidates:
        if os.path.exists(candidate):
            try:
                torch.ops.load_library(candidate)
                return candidate
            except OSError:
                continue
    return None


def vllm_attn_isa(dtype: torch.dtype, block_size: int, head_size: int) -> str:
    """The ISA vLLM's CPU attention backend picks for a cache of this kind on this CPU.

    vLLM 0.32's rule (``vllm.v1.attention.backends.cpu_attn``) for x86: ``vec16`` for head
    sizes that are a multiple of 16 but not of 32, ``amx`` for bf16 caches with blocks of a
    multiple of 32 where the CPU has AMX tiles, ``vec`` for other blocks of a multiple of 32,
    else ``vec16``.
    """
    if head_size % 32 != 0 and head_size % 16 == 0:
        return "vec16"
    if block_size % 32 != 0:
        return "vec16"
    if dtype == torch.bfloat16 and torch.cpu._is_amx_tile_supported():
        return "amx"
    return "vec"


def vllm_moe_isa(dtype: torch.dtype) -> str:
    """The ISA vLLM 0.32's unquantized CPU MoE experts use for this dtype on this CPU: ``amx``
    for bf16 where the CPU has AMX tiles (``X86CPUUnquantizedExperts``), else ``vec``."""
    return "amx" if dtype == torch.bfloat16 and torch.cpu._is_amx_tile_supported() else "vec"


def int_options(doc: str | None, **defaults: int) -> argparse.ArgumentParser:
    """A benchmark's parser, described by the first line of ``doc``, with one integer option
    ``--name`` per keyword (underscores become dashes) defaulting to its value."""
    parser = argparse.ArgumentParser(description=(doc or "").split("\n")[0])
    for name, default in defaults.items():
        parser.add_argument(f"--{name.replace('_', '-')}", type=int, default=default)
    return parser
