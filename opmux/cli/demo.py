"""``opmux demo``: the main job, end to end, on a checkpoint written here.

A seeded random ``LlamaForCausalLM`` checkpoint (``config.json`` + ``model.safetensors``,
written by :func:`opmux.models.synthetic.write_random_llama`; nothing is downloaded and
``transformers`` is not needed) is loaded by :func:`opmux.models.load_model` and generates
from prompts of different lengths on the paged-cache engine, so every op the model calls
(norms, rotary, cache writes, paged attention, SwiGLU, ``advance_step_flashattn``) goes
through the providers the platform selects. The same generation is then repeated with every
op forced to ``native``: the greedy token streams are compared, and the last-position
logits of each full sequence (prompt + generated tokens, one ragged prefill) must agree
within tolerance. Tokens/s of both runs are reported.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import asdict
from pathlib import Path
from typing import Any, Final, TextIO

import torch

from opmux.cli._option_checks import int_in, run_device
from opmux.cli.strict_json import dumps

__all__ = ["LOGIT_TOLERANCE", "add_arguments", "run"]

LOGIT_TOLERANCE: Final = {torch.float32: 2e-3, torch.bfloat16: 0.25}
"""Max abs logit difference allowed between the selected providers and native."""

_DTYPES: Final = {"float32": torch.float32, "bfloat16": torch.bfloat16,
                  "fp32": torch.float32, "bf16": torch.bfloat16}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the ``demo`` options to ``parser``."""
    parser.add_argument("--layers", type=int_in(1, 1024), default=4, help="decoder layers")
    parser.add_argument("--hidden", type=int_in(1, 1 << 16), default=256, help="hidden size")
    parser.add_argument("--heads", type=int_in(1, 1024), default=8, help="query heads")
    parser.add_argument("--kv-heads", type=int_in(1, 1024), default=2, help="key/value heads")
    parser.add_argument("--vocab", type=int_in(1, 1 << 24), default=1000,
                        help="vocabulary size")
    parser.add_argument("--batch", type=int_in(1, 1024), default=4, help="prompts")
    parser.add_argument("--steps", type=int_in(1, 1 << 16), default=32,
                        help="new tokens per prompt")
    parser.add_argument("--block-size", type=int_in(1, 1 << 16), default=16,
                        help="KV block size")
    parser.add_argument("--dtype", choices=sorted(_DTYPES), default="float32")
    parser.add_argument("--seed", type=int_in(0, 2**63 - 3), default=0)
    parser.add_argument("--device", default=None,
                        help="torch device (default: the detected platform's device)")
    parser.add_argument("--model-dir", default=None,
                        help="write the checkpoint here and keep it (default: a temporary "
                             "directory, removed afterwards); must be new or empty")
    parser.add_argument("--force", action="store_true",
                        help="replace what a non-empty --model-dir holds")
    parser.add_argument("--threads", type=int_in(0, 4096), default=1,
                        help="torch CPU threads during the run (default 1)")
    parser.add_argument("--json", action="store_true", help="print a JSON report")


def prompt_lens(batch: int, low: int = 5, high: int = 24) -> list[int]:
    """Different prompt lengths per sequence, deterministic."""
    span = high - low + 1
    return [low + (7 * i + 11) % span for i in range(batch)]


def _check(ns: argparse.Namespace) -> None:
    from opmux.core.errors import ConfigError

    for name in ("layers", "hidden", "heads", "kv_heads", "vocab", "batch", "block_size"):
        if getattr(ns, name) <= 0:
            raise ConfigError(f"opmux demo: --{name.replace('_', '-')} must be positive, got "
                              f"{getattr(ns, name)}")
    if ns.hidden % ns.heads or ns.heads % ns.kv_heads or (ns.hidden // ns.heads) % 2:
        raise ConfigError(f"opmux demo: --hidden ({ns.hidden}) must be a multiple of --heads "
                          f"({ns.heads}) with an even head size, and --heads a multiple of "
                          f"--kv-heads ({ns.kv_heads})")
    if ns.steps < 1:
        raise ConfigError(f"opmux demo: --steps must be >= 1, got {ns.steps}")
    if ns.device is not None:
        run_device(ns.device, "demo")
    if ns.model_dir is not None:
        _check_model_dir(Path(ns.model_dir).expanduser(), ns.force)
    from opmux.models.memory import MemoryNeed, check_fits

    shape = _shape(ns)
    check_fits([MemoryNeed(  # written in float32, then read back: about three copies
        "random checkpoint", shape.num_parameters() * 4 * 3,
        f"--layers {ns.layers}, --hidden {ns.hidden}, --vocab {ns.vocab}",
        "lower --layers, --hidden or --vocab")], "cpu", "opmux demo")


def _check_model_dir(directory: Path, force: bool) -> None:
    """Refuse to put a checkpoint where one would replace something."""
    from opmux.core.errors import ConfigError

    if directory.exists() and not directory.is_dir():
        raise ConfigError(f"opmux demo: --model-dir {directory} exists and is not a directory; "
                          f"choose a new or empty directory")
    try:
        held = sorted(p.name for p in directory.iterdir()) if directory.is_dir() else []
    except OSError as exc:
        raise ConfigError(f"opmux demo: --model-dir {directory} cannot be read "
                          f"({exc.strerror}); choose another directory") from None
    if held and not force:
        shown = ", ".join(held[:3]) + (", ..." if len(held) > 3 else "")
        raise ConfigError(f"opmux demo: --model-dir {directory} is not empty (holds {shown}); "
                          f"choose a new or empty directory, or pass --force to replace it")


@contextlib.contextmanager
def _new_directory(target: Path) -> Iterator[Path]:
    """A temporary directory beside ``target`` that replaces it whole on success.

    Nothing is left at ``target`` (nor beside it) when the body fails: the checkpoint
    appears complete or not at all. A non-empty ``target`` (``--force``) is moved aside
    first and removed after the new one is in place.
    """
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent))
    try:
        yield tmp
        old = None
        if target.is_dir() and any(target.iterdir()):
            old = Path(tempfile.mkdtemp(prefix=f".{target.name}.", suffix=".old",
                                        dir=target.parent))
            os.replace(target, old)
        os.replace(tmp, target)  # replaces an empty directory in one step
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def run(ns: argparse.Namespace, *, out: TextIO | None = None, err: TextIO | None = None) -> int:
    """Run the demo; 0 when the selected providers agree with native, 1 if not, 2 on bad
    options."""
    import opmux

    out, err = out or sys.stdout, err or sys.stderr
    try:
        _check(ns)
    except opmux.OpmuxError as exc:
        print(str(exc), file=err)
        return 2
    previous = torch.get_num_threads()
    if ns.threads > 0:
        torch.set_num_threads(ns.threads)
    try:
        if ns.model_dir is not None:
            target = Path(ns.model_dir).expanduser()
            with _new_directory(target) as tmp:
                _write(ns, tmp)
            return _run(ns, target, out, err)
        with tempfile.TemporaryDirectory(prefix="opmux-demo-") as tmp:
            _write(ns, Path(tmp))
            return _run(ns, Path(tmp), out, err)
    finally:
        torch.set_num_threads(previous)


def _all_native(names: list[str]) -> contextlib.ExitStack:
    from opmux.core.registry import get_op

    stack = contextlib.ExitStack()
    for name in names:
        stack.enter_context(get_op(name).set_priority(["native"]))
    return stack


def _shape(ns: argparse.Namespace) -> Any:
    from opmux.models.synthetic import LlamaShape

    return LlamaShape(layers=ns.layers, hidden=ns.hidden, heads=ns.heads,
                      kv_heads=ns.kv_heads, intermediate=2 * ns.hidden, vocab=ns.vocab)


def _write(ns: argparse.Namespace, directory: Path) -> None:
    from opmux.models.synthetic import write_random_llama

    write_random_llama(directory, _shape(ns), ns.seed)


def _run(ns: argparse.Namespace, directory: Path, out: TextIO, err: TextIO) -> int:
    import opmux
    from opmux.models import Engine, ProviderTally, load_model
    from opmux.models.decoder import AttentionBatch

    dtype = _DTYPES[ns.dtype]
    shape = _shape(ns)
    opmux.load_plugins()
    device = torch.device(ns.device or opmux.current_platform().device_type)
    model = load_model(directory, dtype, device)
    engine = Engine(model, ns.block_size, device)
    g = torch.Generator().manual_seed(ns.seed + 2)
    lens = prompt_lens(ns.batch)
    prompts = [torch.randint(0, ns.vocab, (n,), generator=g).tolist() for n in lens]
    names = [op.name for op in opmux.list_ops() if op.namespace == "opmux"]
    engine.generate(prompts, 2)  # warm up both paths: kernels load on first use
    with _all_native(names):
        engine.generate(prompts, 2)
    with ProviderTally(names) as tally:
        engine.generate(prompts[:1], 2)
    selected = engine.generate(prompts, ns.steps)
    with _all_native(names):
        native = engine.generate(prompts, ns.steps)

    def last_logits(seqs: list[list[int]]) -> torch.Tensor:
        n = [len(x) for x in seqs]
        blocks = [(k + ns.block_size - 1) // ns.block_size for k in n]
        tables = torch.zeros(len(seqs), max(blocks), dtype=torch.int32)
        slots, start = [], 0
        for i, (k, b) in enumerate(zip(n, blocks, strict=True)):
            tables[i, :b] = torch.arange(start, start + b, dtype=torch.int32)
            slots.append(start * ns.block_size + torch.arange(k))
            start += b
        cache = model.new_kv_cache(start, ns.block_size, device)
        qsl = torch.tensor([0, *torch.tensor(n).cumsum(0).tolist()], dtype=torch.int32)
        meta = AttentionBatch(torch.cat(slots).to(device), tables.to(device),
                              torch.tensor(n, dtype=torch.int32, device=device),
                              qsl.to(device))
        positions = torch.cat([torch.arange(k) for k in n]).to(device)
        flat = torch.tensor([t for x in seqs for t in x], device=device)
        return engine.forward_step(flat, positions, cache, meta).cpu()

    full = [p + o for p, o in zip(prompts, selected.outputs, strict=True)]
    mine = last_logits(full)
    with _all_native(names):
        ref = last_logits(full)
    diff = float((mine - ref).abs().max())
    tol = LOGIT_TOLERANCE[dtype]
    agree = sum(a == b for x, y in zip(selected.outputs, native.outputs, strict=True)
                for a, b in zip(x, y, strict=False))
    total = sum(len(x) for x in selected.outputs)
    ok = diff <= tol
    report: dict[str, Any] = {
        "ok": ok, "platform": opmux.current_platform().name, "device": str(device),
        "threads": torch.get_num_threads(), "model": asdict(shape),
        "parameters": shape.num_parameters(), "dtype": ns.dtype, "prompt_lens": lens,
        "providers": tally.providers(), "calls": tally.calls(), "max_abs_diff": diff,
        "tolerance": tol, "tokens_agree": agree, "tokens_total": total,
        "tokens_per_s": {"selected": selected.tokens_per_s, "native": native.tokens_per_s},
        "speedup": selected.tokens_per_s / max(native.tokens_per_s, 1e-9),
        "outputs": selected.outputs,
    }
    if ns.json:
        print(dumps(report), file=out)
    else:
        print(f"opmux demo: random LlamaForCausalLM checkpoint written to {directory} "
              f"({shape.num_parameters() / 1e6:.2f}M parameters: {shape.layers} layers, "
              f"hidden {shape.hidden}, {shape.heads}/{shape.kv_heads} heads, vocab "
              f"{shape.vocab}), {ns.dtype}", file=out)
        print(f"platform {report['platform']}, torch threads {report['threads']}, batch "
              f"{ns.batch}, prompt lengths {lens}, {ns.steps} new tokens each\n", file=out)
        width = max(len(n) for n in report["providers"])
        for name, provider in sorted(report["providers"].items()):
            print(f"  {name:<{width}}  {provider}", file=out)
        verdict = "OK" if ok else "MISMATCH"
        print(f"\nlogits vs all-native: max abs diff {diff:.3g} (tolerance {tol:g}) {verdict}; "
              f"native greedy tokens agree on {agree}/{total}", file=out)
        print(f"throughput: native {native.tokens_per_s:.1f} tokens/s, selected "
              f"{selected.tokens_per_s:.1f} tokens/s ({report['speedup']:.2f}x)", file=out)
    if not ok:
        print("opmux demo: the selected providers' logits differ from native beyond "
              "tolerance; run `opmux check` to find the provider", file=err)
    return 0 if ok else 1
