"""Where a decode step of opmux's ``Engine`` goes: time by op and the Python share (CPU).

One run writes a seeded random Llama checkpoint (``100m``: ``LLAMA_100M``; ``tiny``: 2 layers,
hidden 256, vocab 4000, as in ``benchmarks/llamacpp_cpu.py``), and for each batch size
generates ``--new-tokens`` greedy tokens after ``--prompt-len``-token prompts under
``torch.profiler``, recording only decode steps (the prefill step and one decode step left
out). A step's time splits into the **ops** it calls from Python (the top-level profiler
events: catalog ops by name, linear layers by weight shape, and the rest by ATen name) and
**Python**: the step's wall time outside any op (module calls, dispatch, the engine's own
bookkeeping, the profiler's own cost per op included). The unprofiled decode step (the
``Engine``'s ``decode_s`` per step, best of ``--rounds`` alternating runs) is printed beside
it, for the ``Engine`` as built (linear weights laid out for the GEMM libraries,
``opmux.models._packed``, and each decoder layer stepped by its lean layer: at one or two
rows one call of the CPU plugin's ``decoder_layer`` per layer, else catalog ops and packed
weights called without module calls), for one whose lean layers make the op calls at every
row count ("op calls, not one call per layer"), for one with the packed weights but every
layer through its forward ("without the lean layers"), and for one built with
``pack_weights=False`` (every linear through its layer), each on its own copy of the model.

Run: ``python benchmarks/decode_profile.py [--size 100m|tiny] [--dtype float32|bfloat16]
[--threads N] [--batch 1 16] [--top 12]``.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import torch
from timing import require_cpu_plugin
from torch.profiler import ProfilerActivity, profile, schedule

from opmux.models import Engine, load_model
from opmux.models.synthetic import LLAMA_100M, LlamaShape, write_random_llama
from opmux.testing.vllm_generate import token_prompts

_SHAPES = {
    "100m": LLAMA_100M,
    "tiny": LlamaShape(layers=2, hidden=256, heads=8, kv_heads=2, intermediate=512,
                       vocab=4000),
}
_LINEARS = ("aten::linear", "mkldnn::_linear_pointwise", "aten::mm", "aten::addmm",
            "aten::matmul")


def _label(name: str, shapes: list[list[int]]) -> str:
    if name in _LINEARS and len(shapes) > 1 and len(shapes[1]) == 2:
        out, inp = shapes[1] if name != "aten::mm" else shapes[1][::-1]
        return f"linear {out}x{inp}"
    return name


def profile_decode(engine: Engine, prompts: list[list[int]], new_tokens: int
                   ) -> tuple[float, dict[str, tuple[int, float]], int]:
    """(wall seconds of the recorded decode steps, {op: (calls, seconds)}, steps recorded)."""
    active = new_tokens - 3
    stamps: list[float] = []
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True,
                 schedule=schedule(wait=1, warmup=1, active=active)) as prof:

        def step(done: int) -> None:
            stamps.append(time.perf_counter())
            prof.step()

        engine.generate(prompts, new_tokens, progress=step)
    wall = stamps[1 + active] - stamps[1]
    ops: dict[str, list[float]] = defaultdict(lambda: [0, 0.0])
    for ev in prof.events():
        parent = ev.cpu_parent
        if ev.name.startswith("ProfilerStep") or (
                parent is not None and not parent.name.startswith("ProfilerStep")):
            continue
        if ev.device_type == torch.autograd.DeviceType.CPU:
            acc = ops[_label(ev.name, ev.input_shapes or [])]
            acc[0] += 1
            acc[1] += ev.cpu_time_total / 1e6
    return wall, {k: (int(v[0]), v[1]) for k, v in ops.items()}, active


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--size", default="100m", choices=list(_SHAPES))
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--batch", nargs="+", type=int, default=[1, 16])
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=24)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--top", type=int, default=12, help="ops listed (the rest summed)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    require_cpu_plugin()
    shape = _SHAPES[args.size]
    dtype = getattr(torch, args.dtype)
    with tempfile.TemporaryDirectory(prefix="opmux-profile-") as tmp:
        write_random_llama(Path(tmp), shape, seed=0)
        engine = Engine(load_model(tmp, dtype), block_size=16)
        layers = Engine(load_model(tmp, dtype), block_size=16, pack_weights=False)
        op_calls = Engine(load_model(tmp, dtype), block_size=16)
        for step in op_calls.model._lean or []:
            step.kernel = None  # lean layers, each through its op calls
        no_lean = Engine(load_model(tmp, dtype), block_size=16)
        no_lean.model._lean = None  # packed weights, but every layer through its forward
    print(f"{args.size} ({shape.num_parameters() / 1e6:.1f}M parameters), {args.dtype}, "
          f"{torch.get_num_threads()} thread(s), torch {torch.__version__}")
    for batch in args.batch:
        prompts = token_prompts(batch, args.prompt_len, shape.vocab)
        runs = {"packed": engine, "op_calls": op_calls, "no_lean": no_lean, "layers": layers}
        best = dict.fromkeys(runs, float("inf"))
        for e in runs.values():
            e.generate(prompts, 4)
        for r in range(args.rounds):
            for name in (list(runs) if r % 2 == 0 else list(runs)[::-1]):
                out = runs[name].generate(prompts, args.new_tokens)
                best[name] = min(best[name], out.decode_s / out.steps)
        wall, ops, steps = profile_decode(engine, prompts, args.new_tokens)
        in_ops = sum(s for _, s in ops.values())
        print(f"\nbatch {batch}: decode step {best['packed'] * 1e3:.2f} ms unprofiled "
              f"(op calls, not one call per layer: {best['op_calls'] * 1e3:.2f} ms, "
              f"{best['op_calls'] / best['packed']:.2f}x; "
              f"without the lean layers: {best['no_lean'] * 1e3:.2f} ms, "
              f"{best['no_lean'] / best['packed']:.2f}x; pack_weights=False: "
              f"{best['layers'] * 1e3:.2f} ms, {best['layers'] / best['packed']:.2f}x), "
              f"{wall / steps * 1e3:.2f} ms profiled ({steps} steps)")
        print(f"  {'op':<36} {'calls/step':>10} {'us/step':>9} {'share':>6}")
        ranked = sorted(ops.items(), key=lambda kv: -kv[1][1])
        rest = ranked[args.top:]
        rows = [(name, c / steps, s) for name, (c, s) in ranked[:args.top]]
        if rest:
            rows.append((f"({len(rest)} other ops)", sum(c for _, (c, _) in rest) / steps,
                         sum(s for _, (_, s) in rest)))
        rows.append(("Python outside ops", 0.0, wall - in_ops))
        for name, calls, s in rows:
            print(f"  {name:<36} {calls:>10.1f} {s / steps * 1e6:>9.0f} {100 * s / wall:>5.1f}%")


if __name__ == "__main__":
    main()
