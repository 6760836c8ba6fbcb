"""CPU benchmark of the state-space ops: ``cpp`` vs the native reference (eager) vs
``torch.compile`` of the native reference, in one process.

Shapes are Mamba-130m's mixer (``intermediate 1536``, ``dstate 16``, conv width 4) over
``--tokens`` packed tokens (default 2048) in ``--seqs`` sequences, continuing from cached
states. Decode rows time one step of ``--batch`` sequences. ``torch.compile`` compiles the
native reference as written (its per-sequence loop reads the offsets, so Dynamo specialises
on them and unrolls the per-token recurrence of each chunk): the compile time is printed
separately and excluded from the timings. Ratios are ``cpp`` speed-ups over each baseline.

Run from the repository root: ``python benchmarks/ssm_cpu.py [--tokens N] [--quick]``.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable
from typing import Any

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from timing import int_options, interleaved_ms

import opmux
from opmux.testing.ssm_cases import make_scan_inputs

Fn = Callable[[], Any]


def _batch(tokens: int, seqs: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    cuts = torch.linspace(0, tokens, seqs + 1).round().to(torch.int32)
    return cuts, torch.arange(seqs, dtype=torch.int32), torch.ones(seqs, dtype=torch.bool)


def cases(tokens: int, seqs: int, batch: int, dim: int, dstate: int, width: int,
          dtype: torch.dtype) -> list[tuple[str, Callable[..., Any], tuple[Any, ...]]]:
    """(label, op name, args) rows; every row's args are reused across calls (states are
    overwritten with the same values each time)."""
    g = torch.Generator().manual_seed(0)
    qsl, idx, init = _batch(tokens, seqs)
    x = torch.randn(tokens, dim, generator=g).to(dtype)
    w = torch.randn(dim, width, generator=g).to(dtype)
    b = torch.randn(dim, generator=g).to(dtype)
    conv_states = torch.randn(max(seqs, batch), dim, width - 1, generator=g).to(dtype)
    p = make_scan_inputs(g, tokens, dim, dstate, dtype)
    ssm = torch.randn(max(seqs, batch), dim, dstate, generator=g)
    d = make_scan_inputs(g, batch, dim, dstate, dtype)
    didx = torch.arange(batch, dtype=torch.int32)
    return [
        (f"causal_conv1d prefill {tokens}x{dim} w{width}", "causal_conv1d",
         (x, w, b, conv_states, qsl, idx, init, "silu")),
        (f"causal_conv1d_update {batch}x{dim}", "causal_conv1d_update",
         (x[:batch], conv_states, w, b, "silu", didx)),
        (f"selective_scan prefill {tokens}x{dim} n{dstate}", "selective_scan",
         (p["u"], ssm, p["delta"], p["A"], p["B"], p["C"], p["D"], p["z"], p["delta_bias"],
          True, qsl, idx, init)),
        (f"selective_state_update {batch}x{dim} n{dstate}", "selective_state_update",
         (ssm, d["u"], d["delta"], d["A"], d["B"], d["C"], d["D"], d["z"], d["delta_bias"],
          True, didx)),
    ]


def main() -> None:
    parser = int_options(__doc__, tokens=2048, seqs=4, batch=32, dim=1536, dstate=16, iters=5)
    parser.add_argument("--quick", action="store_true", help="small shapes, no compile")
    args = parser.parse_args()
    if args.quick:
        args.tokens, args.dim, args.iters = 128, 128, 3
    opmux.load_plugins()
    from opmux.plugins.cpu import cpp_ssm

    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    for dtype in (torch.float32, torch.bfloat16):
        print(f"\n{dtype}: median ms (ratios: cpp speed-up)")
        for label, name, op_args in cases(args.tokens, args.seqs, args.batch, args.dim,
                                          args.dstate, 4, dtype):
            native = opmux.get_op(name).native
            contenders: dict[str, Fn] = {
                "cpp": lambda n=name, a=op_args: cpp_ssm.OPS[n][0](*a),
                "native eager": lambda f=native, a=op_args: f(*a),
            }
            if not args.quick:
                torch._dynamo.reset()
                compiled = torch.compile(native, dynamic=False)
                t0 = time.perf_counter()
                compiled(*op_args)
                print(f"  ({label}: torch.compile took {time.perf_counter() - t0:.1f} s)")
                contenders["torch.compile(native)"] = lambda f=compiled, a=op_args: f(*a)
            ms = interleaved_ms(contenders, args.iters)
            ratios = ", ".join(f"{ms[k] / ms['cpp']:.1f}x vs {k}" for k in ms if k != "cpp")
            cols = "  ".join(f"{k} {v:.2f}" for k, v in ms.items())
            print(f"  {label:44s} {cols}  |  {ratios}")


if __name__ == "__main__":
    main()
