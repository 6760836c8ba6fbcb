"""Decode steps of ``xla_gpu.paged_attention`` vs torch_xla's ``ragged_paged_attention``.

Run in the xla lane: ``PJRT_DEVICE=CPU python benchmarks/xla_paged_attention.py [--steps N]``.

Each scenario runs N decode steps on the XLA device whose ``context_lens`` and ``num_seqs``
change every step (as in serving) under a fixed padded batch bucket, and reports per step
(median ms, wall time of op + ``torch_xla.sync()`` + ``wait_device_ops``) and the number of
XLA compilations over the N steps:

- ``changing``: every step has new lengths. opmux compiles once per bucket; torch_xla's
  non-kernel path (``torch.ops.xla.ragged_paged_attention(use_kernel=False)``) slices by
  length values on the host, so it builds (and mostly compiles) a new graph per step.
- ``steady``: the same step replayed, so both run from the compile cache: execution only
  (the two interleaved, median over ``--steps`` rounds).

Ratios are opmux / torch_xla (lower is better; target <= 1.0). A second bucket checks that
each distinct (batch bucket, max blocks) shape compiles exactly once.
"""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
from timing import int_options

os.environ.setdefault("PJRT_DEVICE", "CPU")


@dataclass
class Shape:
    batch: int
    max_blocks: int
    heads: int
    kv_heads: int
    head_size: int
    block_size: int

    @property
    def num_blocks(self) -> int:
        return self.batch * self.max_blocks


def step_inputs(shape: Shape, step: int) -> dict[str, torch.Tensor]:
    """Host tensors of decode step ``step``: live batch and lengths vary with the step."""
    gen = torch.Generator().manual_seed(step)
    live = 1 + (step * 5) % shape.batch
    span = shape.max_blocks * shape.block_size
    lens = torch.zeros(shape.batch, dtype=torch.int32)
    lens[:live] = torch.randint(span // 2, span + 1, (live,), generator=gen, dtype=torch.int32)
    qsl = torch.full((shape.batch + 1,), live, dtype=torch.int32)
    qsl[: live + 1] = torch.arange(live + 1, dtype=torch.int32)
    return {
        "query": torch.randn(shape.batch, shape.heads, shape.head_size, generator=gen),
        "context_lens": lens,
        "query_start_loc": qsl,
        "num_seqs": torch.tensor([live], dtype=torch.int32),
    }


def compile_count() -> int:
    import torch_xla.debug.metrics as met

    data = met.metric_data("CompileTime")
    return 0 if data is None else int(data[0])


def run_steps(fn: Callable[[dict[str, torch.Tensor]], torch.Tensor], shape: Shape,
              steps: list[int]) -> tuple[float, int]:
    """Median ms per step (first step excluded: it may compile) and compiles over all steps."""
    import torch_xla
    import torch_xla.core.xla_model as xm

    device = torch_xla.device()
    before = compile_count()
    times = []
    for step in steps:
        host = step_inputs(shape, step)
        start = time.perf_counter()
        inputs = {k: v.to(device) for k, v in host.items()}
        out = fn(inputs)
        torch_xla.sync()
        xm.wait_device_ops()
        times.append((time.perf_counter() - start) * 1e3)
        del out
    return statistics.median(times[1:] or times), compile_count() - before


def make_fns(shape: Shape) -> dict[str, Callable[[dict[str, torch.Tensor]], torch.Tensor]]:
    import torch_xla
    import torch_xla.experimental.custom_kernel  # defines torch.ops.xla.*

    import opmux

    opmux.load_plugins()
    device = torch_xla.device()
    gen = torch.Generator().manual_seed(0)
    kv = torch.randn(2, shape.num_blocks, shape.block_size, shape.kv_heads, shape.head_size,
                     generator=gen)
    tables = torch.randperm(shape.num_blocks, generator=gen).to(torch.int32)
    tables = tables.reshape(shape.batch, shape.max_blocks)
    # torch_xla layout: [pages, page_size, 2 * Hkv, D], keys at even combined heads
    pages = torch.stack([kv[0], kv[1]], dim=3).reshape(
        shape.num_blocks, shape.block_size, 2 * shape.kv_heads, shape.head_size)
    kv_d, pages_d, tables_d = kv.to(device), pages.to(device), tables.to(device)
    scale = shape.head_size ** -0.5

    def ours(x: dict[str, torch.Tensor]) -> torch.Tensor:
        return torch.ops.xla_gpu.paged_attention(  # type: ignore[no-any-return]
            x["query"], kv_d, x["context_lens"], tables_d, x["query_start_loc"],
            x["num_seqs"], scale)

    def theirs(x: dict[str, torch.Tensor]) -> torch.Tensor:
        return torch.ops.xla.ragged_paged_attention(  # type: ignore[no-any-return]
            x["query"], pages_d, x["context_lens"], tables_d, x["query_start_loc"],
            x["num_seqs"], sm_scale=scale, use_kernel=False)

    return {"opmux": ours, "torch_xla": theirs}


def main() -> None:
    parser = int_options(__doc__, steps=20, batch=8, max_blocks=32, heads=16, kv_heads=4,
                         head_size=64, block_size=16)
    parser.add_argument("--ref-steps", type=int, default=4,
                        help="steps of torch_xla with changing lengths (each compiles)")
    args = parser.parse_args()
    shape = Shape(args.batch, args.max_blocks, args.heads, args.kv_heads, args.head_size,
                  args.block_size)
    print(f"decode, {shape}, {args.steps} steps; ms/step (median) and compiles over the steps")
    fns = make_fns(shape)
    ours, theirs = fns["opmux"], fns["torch_xla"]
    # changing lengths: torch_xla compiles nearly every step, so it gets fewer steps
    ref_steps = max(2, min(args.steps, args.ref_steps))
    ours_ms, ours_c = run_steps(ours, shape, list(range(1, args.steps + 1)))
    theirs_ms, theirs_c = run_steps(theirs, shape, list(range(1, ref_steps + 1)))
    print(f" changing: opmux {ours_ms:9.3f} ms, {ours_c} compile(s) in {args.steps} steps | "
          f"torch_xla {theirs_ms:9.3f} ms, {theirs_c} compile(s) in {ref_steps} steps | "
          f"ratio {ours_ms / theirs_ms:.3f}x")
    # steady state: one step replayed from the compile cache, the two interleaved
    samples: dict[str, list[float]] = {"opmux": [], "torch_xla": []}
    for _ in range(args.steps):
        for name, fn in fns.items():
            samples[name].append(run_steps(fn, shape, [1, 1])[0])
    s_ours, s_theirs = (statistics.median(samples[k]) for k in ("opmux", "torch_xla"))
    print(f"   steady: opmux {s_ours:9.3f} ms | torch_xla {s_theirs:9.3f} ms | "
          f"ratio {s_ours / s_theirs:.3f}x")
    # each distinct (batch bucket, max blocks) shape compiles exactly once
    for batch, max_blocks in ((args.batch * 2, args.max_blocks // 2),
                              (max(1, args.batch // 2), args.max_blocks * 2)):
        other = Shape(batch, max_blocks, args.heads, args.kv_heads, args.head_size,
                      args.block_size)
        _, compiles = run_steps(make_fns(other)["opmux"], other,
                                list(range(100, 100 + args.steps)))
        print(f"   bucket (batch {batch}, max blocks {max_blocks}): opmux {compiles} "
              f"compile(s) in {args.steps} steps")

if __name__ == "__main__":
    main()
