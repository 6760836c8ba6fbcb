"""Per-call time of ``advance_step_flashattn``: MindSpore op, DLPack bridge, ``cpp``, native.

Run in the mindspore lane: ``python benchmarks/advance_step.py [--iters N]``. Columns (us per
call, median of repeats):

- ``ms_async``: the MindSpore custom op on MindSpore tensors, asynchronous PyNative dispatch
  (the call returns before the op ran);
- ``ms_op``: the same op with ``pynative_synchronize`` on, followed by the pipeline barrier:
  its results are written when the call returns, which is what the bridge guarantees to torch;
- ``bridge``: provider ``mindspore`` on torch tensors (cached DLPack views, flag toggled around
  the call, barrier);
- ``cpp``: opmux's C++ CPU provider, when it builds here;
- ``native``: the pure PyTorch reference.

``overhead`` is ``bridge - ms_op``: the price of serving torch tensors (target <= 10 us).
Waiting for the asynchronous pipeline instead (``ms_async`` + ``_pynative_executor.sync()``)
is far slower on a loaded machine: ``--with-sync`` adds that column; it
runs last because once MindSpore's pipeline has gone asynchronous in a process, the flag no
longer makes ops inline (see opmux.plugins.ascend.dlpack_provider).
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from timing import interleaved_us

SIZES = (1, 16, 256, 1024, 4096)
BLOCK_SIZE = 32
MAX_BLOCKS = 128


def _state(num_seqs: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(num_seqs)
    return {
        "input_tokens": np.zeros(num_seqs, np.int64),
        "sampled_token_ids": rng.integers(0, 32000, (num_seqs, 1), dtype=np.int64),
        "input_positions": np.zeros(num_seqs, np.int64),
        # low enough that every timed step still fits the block table
        "seq_lens": rng.integers(0, 1024, num_seqs, dtype=np.int32),
        "slot_mapping": np.zeros(num_seqs, np.int64),
        "block_tables": rng.integers(0, 100_000, (num_seqs, MAX_BLOCKS), dtype=np.int32),
    }


ORDER = ("input_tokens", "sampled_token_ids", "input_positions", "seq_lens", "slot_mapping",
         "block_tables")


def _time(fn: Callable[[], Any], iters: int, repeats: int = 5) -> float:
    """Median microseconds per call over ``repeats`` samples of ``iters`` calls."""
    return interleaved_us({"fn": fn}, calls=iters, rounds=repeats, warmup=min(iters, 50))["fn"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iters", type=int, default=400, help="calls per timing repeat")
    parser.add_argument("--with-sync", action="store_true",
                        help="also time the asynchronous op followed by a pipeline barrier")
    args = parser.parse_args()

    import mindspore as ms

    import opmux
    from opmux.plugins.ascend import _custom_ops, dlpack_provider

    ms.set_device("CPU")
    kernel = _custom_ops.kernel()
    flag = dlpack_provider._bind_mindspore()
    native = opmux.get_op("advance_step_flashattn").impls["native"]
    cpp: Callable[..., None] | None = None
    try:
        from opmux.plugins.cpu import build as cpu_build
        from opmux.plugins.cpu import cpp_ops

        if cpu_build.build_status()[0]:
            cpp = cpp_ops.OPS["advance_step_flashattn"][0]
    except Exception as exc:  # reported, the other columns still run
        print(f"cpp provider unavailable: {type(exc).__name__}: {exc}")

    print(f"advance_step_flashattn, block size {BLOCK_SIZE}, {MAX_BLOCKS} blocks per sequence, "
          f"{torch.get_num_threads()} torch threads; us per call (median)")
    header = ("num_seqs", "ms_op", "bridge", "overhead", "cpp", "native")
    print("".join(f"{h:>12}" for h in header))
    for n in SIZES:
        row = _measure(n, args.iters, ms, kernel, flag, dlpack_provider, cpp, native)
        print(f"{n:>12}" + "".join(f"{v:>12.1f}" for v in row))
    # asynchronous dispatch last: afterwards MindSpore keeps its pipeline asynchronous
    async_header = ("num_seqs", "ms_async", *(("async+sync",) if args.with_sync else ()),
                    "bridge")
    print("".join(f"{h:>12}" for h in async_header))
    for n in SIZES:
        row = _measure_async(n, args.iters, ms, kernel, flag[2], args.with_sync)
        t = [torch.from_numpy(v.copy()) for v in _state(n).values()]
        bridge = _time(lambda: dlpack_provider.advance_step_flashattn(n, n, BLOCK_SIZE, *t),  # noqa: B023
                       max(args.iters // 10, 5), repeats=3)
        print(f"{n:>12}" + "".join(f"{v:>12.1f}" for v in (*row, bridge)))


def _measure(n: int, iters: int, ms: Any, kernel: Callable[..., Any], flag: Any,
             bridge_module: Any, cpp: Callable[..., None] | None,
             native: Callable[..., None]) -> tuple[float, ...]:
    """One table row; every column starts from a fresh state (each step grows seq_lens)."""
    _, set_, key = flag[1]
    barrier = flag[2]

    def fresh_torch() -> list[torch.Tensor]:
        return [torch.from_numpy(v.copy()) for v in _state(n).values()]

    def fresh_ms() -> list[Any]:
        return [ms.Tensor(v.copy()) for v in _state(n).values()]

    m = fresh_ms()
    set_(key, True)
    try:
        ms_inline = _time(lambda: (kernel(n, n, BLOCK_SIZE, *m), barrier()), iters)
    finally:
        set_(key, False)
    t = fresh_torch()
    bridge = _time(lambda: bridge_module.advance_step_flashattn(n, n, BLOCK_SIZE, *t), iters)
    cpp_us = float("nan")
    if cpp is not None:
        tc = fresh_torch()
        cpp_us = _time(lambda: cpp(n, n, BLOCK_SIZE, *tc), iters)
    tn = fresh_torch()
    native_us = _time(lambda: native(n, n, BLOCK_SIZE, *tn), iters)
    row: tuple[float, ...] = (ms_inline, bridge, bridge - ms_inline, cpp_us, native_us)
    return row


def _measure_async(n: int, iters: int, ms: Any, kernel: Callable[..., Any],
                   barrier: Callable[[], None], with_sync: bool) -> tuple[float, ...]:
    m = [ms.Tensor(v.copy()) for v in _state(n).values()]
    row: tuple[float, ...] = (_time(lambda: kernel(n, n, BLOCK_SIZE, *m), iters),)
    barrier()
    if with_sync:
        m = [ms.Tensor(v.copy()) for v in _state(n).values()]
        row += (_time(lambda: (kernel(n, n, BLOCK_SIZE, *m), barrier()),
                      max(iters // 10, 5), repeats=3),)
    return row


if __name__ == "__main__":
    main()
