"""Mamba-2 SSD scan on the CPU: ``cpp`` vs native eager vs ``torch.compile`` of native.

Prefill of ``--tokens`` tokens (default 2048) packed into ``--seqs`` sequences (continuing
nonzero states), and a decode step of ``--batch`` sequences, with Mamba-2 shapes (``--heads``
heads of ``--head-dim`` channels, ``--state`` state size, ``--groups`` groups). Contenders
are timed round-robin in the same process; ratios are against native eager. Each contender
gets its own copy of the state cache (the scans update it in place).

Run from this folder: ``python ssd_cpu.py [--tokens 2048] [--dtype bf16]``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from timing import int_options, interleaved_ms

import opmux
from opmux.ops.ssd import ssd_chunk_scan, ssd_state_update


def _inputs(tokens: int, seqs: int, heads: int, head_dim: int, state: int, groups: int,
            dtype: torch.dtype) -> dict[str, Any]:
    g = torch.Generator().manual_seed(0)
    lens = [tokens // seqs] * seqs
    lens[-1] += tokens - sum(lens)
    qsl = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
    return {
        "x": torch.randn(tokens, heads, head_dim, generator=g).to(dtype),
        "dt": (torch.randn(tokens, heads, generator=g) * 0.5).to(dtype),
        "A": -torch.rand(heads, generator=g) - 0.2,
        "B": torch.randn(tokens, groups, state, generator=g).to(dtype),
        "C": torch.randn(tokens, groups, state, generator=g).to(dtype),
        "D": torch.randn(heads), "dt_bias": torch.randn(heads) * 0.3,
        "state": torch.randn(seqs + 1, heads, head_dim, state, generator=g) * 0.5,
        "idx": torch.arange(1, seqs + 1, dtype=torch.int32), "qsl": qsl,
        "init": torch.ones(seqs, dtype=torch.bool),
    }


def _contenders(op: opmux.Op, args: Callable[[torch.Tensor], tuple[Any, ...]],
                state: torch.Tensor) -> dict[str, Callable[[], Any]]:
    native, cpp = op.impls["native"].fn, op.impls["cpp"].fn
    compiled = torch.compile(native, dynamic=False)
    states = {name: state.clone() for name in ("native", "compile", "cpp")}
    return {
        "native eager": lambda: native(*args(states["native"])),
        "torch.compile(native)": lambda: compiled(*args(states["compile"])),
        "cpp": lambda: cpp(*args(states["cpp"])),
    }


def main() -> None:
    parser = int_options(__doc__, tokens=2048, seqs=4, batch=32, heads=32, head_dim=64,
                         state=128, groups=1, chunk=256, iters=5)
    parser.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32")
    a = parser.parse_args()
    dtype = torch.float32 if a.dtype == "fp32" else torch.bfloat16
    opmux.load_plugins()
    print(f"threads={torch.get_num_threads()} dtype={a.dtype} heads={a.heads} "
          f"head_dim={a.head_dim} state={a.state} groups={a.groups}")

    i = _inputs(a.tokens, a.seqs, a.heads, a.head_dim, a.state, a.groups, dtype)

    def prefill(state: torch.Tensor) -> tuple[Any, ...]:
        return (i["x"], i["dt"], i["A"], i["B"], i["C"], state, i["idx"], i["qsl"], i["init"],
                i["D"], None, i["dt_bias"], True, 0.0, None, a.chunk)

    d = _inputs(a.batch, a.batch, a.heads, a.head_dim, a.state, a.groups, dtype)

    def decode(state: torch.Tensor) -> tuple[Any, ...]:
        return (d["x"], d["dt"], d["A"], d["B"], d["C"], state, d["idx"], d["D"], None,
                d["dt_bias"], True)

    for label, fn, args, state in (
            (f"ssd_chunk_scan prefill {a.tokens} tokens / {a.seqs} seqs", ssd_chunk_scan,
             prefill, i["state"]),
            (f"ssd_state_update decode batch {a.batch}", ssd_state_update, decode,
             d["state"])):
        ms = interleaved_ms(_contenders(fn, args, state), a.iters)
        base = ms["native eager"]
        print(f"\n{label}")
        for name, t in ms.items():
            print(f"  {name:24s} {t:9.3f} ms   x{base / t:6.2f} vs native eager")


if __name__ == "__main__":
    main()
