"""The linear layers' GEMM on CPU: ``F.linear`` against ``opmux.layers._gemm.dense_linear``.

``dense_linear`` sends float32 calls with 1-64 rows and a weight of 2**20 elements or more to
oneDNN when torch runs more than one thread, and everything else to ``F.linear``; this prints
both per shape, interleaved in one run, with the path ``dense_linear`` took and the ratio
(below 1.0: ``dense_linear`` is faster). The shapes are the projections of the 97.5M-parameter
Llama of ``benchmarks/vllm_cpu.py`` (hidden 1024, 16/4 heads, intermediate 3072; gate and up
fused, as opmux's layers hold them) at decode (1, 16, 64 rows) and prefill (512 rows), and a
small model's (hidden 256) to show the fixed cost that the weight-size rule avoids.

With ``--packed`` it compares instead the Engine's packed weights (``opmux.models``'
``PackedWeight``) at 1-16 rows, float32 and (on CPUs with native bfloat16 compute) bfloat16:
the oneDNN routes against the CPU plugin's row kernels (``csrc/cpu/linear.cpp``: float32 on
the plain weight, bfloat16 on a contiguous copy), which the Engine uses for one and two rows
(ratio below 1.0: the kernel is faster). Run it with ``--threads 1 2``: the kernels' lead
grows with the second thread.

With ``--op`` it times a decode step's linears instead: one pass over the 33 weights of the
100M Llama (8 layers of QKV, output, gate/up and down projections, and the LM head: 290 MB in
float32, so each pass streams them from memory as a decode step does) at 1 and 2 rows,
``F.linear`` against the catalog op ``linear`` (``opmux.ops.linear``: the ``cpp`` provider's
kernel on the plain weight, dispatch included), float32 and bfloat16 (ratio below 1.0: the op
is faster). The ``cpu`` plugin must be loaded (opmux installed).

With ``--huge-pages`` it times the same 33 weights as the Engine's packed weights, float32 and
(on CPUs with native bfloat16 compute) bfloat16, at 1 and 2 rows: the row kernel on the
weights in their own memory (4 KiB pages) against the weights sharing one region on 2 MiB
pages as the Engine places them (``opmux.models._packed.place_row_weights``: bfloat16 copies,
float32 moved; ratio below 1.0: the huge pages are faster).

Run: ``python benchmarks/linear_cpu.py [--threads 1 2] [--rounds 15] [--packed | --op |
--huge-pages]``.
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F
from timing import interleaved_us, require_cpu_plugin
from torch import Tensor

import opmux
from opmux.layers import _gemm
from opmux.models._packed import PackedWeight, place_row_weights

PACKED_SHAPES = [  # (in, out): the linears and LM head of the 100M Llama of llamacpp_cpu.py
    (768, 1280), (768, 768), (768, 4096), (2048, 768), (768, 32000)]

SHAPES = [  # (rows, in, out)
    *((m, k, n) for m in (1, 16, 64) for k, n in
      ((1024, 1536), (1024, 1024), (1024, 6144), (3072, 1024))),
    (512, 1024, 6144), (512, 3072, 1024),
    (1, 256, 1024), (16, 256, 1024),
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--packed", action="store_true",
                        help="the Engine's packed weights: oneDNN against the row kernels")
    parser.add_argument("--op", action="store_true",
                        help="a decode step's linears: F.linear against the catalog op")
    parser.add_argument("--huge-pages", action="store_true",
                        help="a decode step's weights, on 4 KiB and 2 MiB pages")
    args = parser.parse_args()
    if args.huge_pages:
        huge_pages(args.threads, args.rounds)
        return
    if args.packed:
        packed(args.threads, args.rounds)
        return
    if args.op:
        decode_step(args.threads, args.rounds)
        return
    print(f"torch {torch.__version__}, oneDNN op {'found' if _gemm._ONEDNN else 'missing'}")
    print(f"{'threads':>7} {'rows':>5} {'in':>5} {'out':>5} {'F.linear us':>12} "
          f"{'dense_linear us':>16} {'path':>8} {'ratio':>6}")
    for threads in args.threads:
        torch.set_num_threads(threads)
        for rows, k, n in SHAPES:
            x, w = torch.randn(rows, k), torch.randn(n, k)
            with torch.inference_mode():
                calls = max(3, int(2e6 / (rows * k * n / 1e3 + 1e3)))
                t = interleaved_us({"F.linear": lambda x=x, w=w: F.linear(x, w, None),
                                    "dense": lambda x=x, w=w: _gemm.dense_linear(x, w, None)},
                                   calls=calls, rounds=args.rounds)
                path = ("op" if _gemm.takes_linear_op(x, w, None) else
                        "oneDNN" if _gemm.takes_onednn(x, w, None) else "F.linear")
            print(f"{threads:>7} {rows:>5} {k:>5} {n:>5} {t['F.linear']:>12.1f} "
                  f"{t['dense']:>16.1f} {path:>8} {t['dense'] / t['F.linear']:>6.2f}")


def decode_step(threads_list: list[int], rounds: int) -> None:
    require_cpu_plugin()
    op = opmux.get_op("linear")
    print(f"{'dtype':>8} {'threads':>7} {'rows':>5} {'F.linear ms':>12} {'op ms':>8} "
          f"{'ratio':>6} {'op GB/s':>8}  provider")
    for dtype in (torch.float32, torch.bfloat16):
        weights = _step_weights(dtype)
        nbytes = sum(w.numel() * w.element_size() for w in weights)
        for threads in threads_list:
            torch.set_num_threads(threads)
            clock = time.thread_time if threads == 1 else time.perf_counter
            for rows in (1, 2):
                xs = {k: torch.randn(rows, k).to(dtype) for k, _ in PACKED_SHAPES}
                provider = op.dispatch(xs[768], weights[0]).provider
                with torch.inference_mode():
                    t = interleaved_us(
                        {"F.linear": lambda xs=xs, ws=weights: [F.linear(xs[w.shape[1]], w)
                                                                for w in ws],
                         "op": lambda xs=xs, ws=weights: [op(xs[w.shape[1]], w) for w in ws]},
                        calls=1, rounds=rounds, clock=clock)
                print(f"{str(dtype)[6:]:>8} {threads:>7} {rows:>5} {t['F.linear'] / 1e3:>12.2f} "
                      f"{t['op'] / 1e3:>8.2f} {t['op'] / t['F.linear']:>6.2f} "
                      f"{nbytes / t['op'] / 1e3:>8.1f}  {provider}")


def _step_weights(dtype: torch.dtype) -> list[Tensor]:
    """The 33 weights of the 100M Llama's decode step (``PACKED_SHAPES``), random."""
    weights = [torch.randn(n, k).to(dtype) for _ in range(8) for k, n in PACKED_SHAPES[:4]]
    weights.append(torch.randn(PACKED_SHAPES[4][1], PACKED_SHAPES[4][0]).to(dtype))
    return weights


def _packed_dtypes() -> list[torch.dtype]:
    """float32, and bfloat16 where the CPU computes in it (the dtypes the Engine packs)."""
    bf16 = bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    return [torch.float32, torch.bfloat16] if bf16 else [torch.float32]


def huge_pages(threads_list: list[int], rounds: int) -> None:
    require_cpu_plugin()
    dtypes = _packed_dtypes()
    print(f"{'dtype':>8} {'threads':>7} {'rows':>5} {'own ms':>8} {'huge pages ms':>14} "
          f"{'ratio':>6} {'GB/s':>6}")
    for dtype in dtypes:
        weights = _step_weights(dtype)
        nbytes = sum(w.numel() * w.element_size() for w in weights)
        own = [PackedWeight(w, None) for w in weights]
        shared = [PackedWeight(w.clone(), None) for w in weights]  # float32: moved
        place_row_weights(shared)
        for threads in threads_list:
            torch.set_num_threads(threads)
            clock = time.thread_time if threads == 1 else time.perf_counter
            for rows in (1, 2):
                xs = {k: torch.randn(rows, k).to(dtype) for k, _ in PACKED_SHAPES}
                with torch.inference_mode():
                    t = interleaved_us(
                        {name: lambda packs=packs, xs=xs: [p(xs[p.weight.shape[1]])
                                                           for p in packs]
                         for name, packs in (("own", own), ("shared", shared))},
                        calls=1, rounds=rounds, clock=clock)
                print(f"{str(dtype)[6:]:>8} {threads:>7} {rows:>5} {t['own'] / 1e3:>8.2f} "
                      f"{t['shared'] / 1e3:>14.2f} {t['shared'] / t['own']:>6.2f} "
                      f"{nbytes / t['shared'] / 1e3:>6.1f}")


def packed(threads_list: list[int], rounds: int) -> None:
    dtypes = _packed_dtypes()
    print(f"{'dtype':>8} {'threads':>7} {'rows':>5} {'in':>5} {'out':>6} {'oneDNN us':>10} "
          f"{'kernel us':>11} {'ratio':>6}")
    for dtype in dtypes:
        for threads in threads_list:
            torch.set_num_threads(threads)
            # wall time: with two threads the work is not all on the calling thread
            clock = time.thread_time if threads == 1 else time.perf_counter
            for rows in (1, 2, 4, 16):
                for k, n in PACKED_SHAPES:
                    w, x = torch.randn(n, k).to(dtype), torch.randn(rows, k).to(dtype)
                    onednn = PackedWeight(w, None, row_kernel=False)
                    kernel = PackedWeight(w, None)
                    with torch.inference_mode():
                        calls = max(3, int(2e5 / (k * n / 1e3 + 1e2)))
                        t = interleaved_us({"onednn": lambda x=x, p=onednn: p(x),
                                            "kernel": lambda x=x, p=kernel: p(x)},
                                           calls=calls, rounds=rounds, clock=clock)
                    print(f"{str(dtype)[6:]:>8} {threads:>7} {rows:>5} {k:>5} {n:>6} "
                          f"{t['onednn']:>10.1f} {t['kernel']:>11.1f} "
                          f"{t['kernel'] / t['onednn']:>6.2f}")


if __name__ == "__main__":
    main()
