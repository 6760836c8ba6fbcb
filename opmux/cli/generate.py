"""``opmux generate``: generate from a Hugging Face checkpoint directory through opmux.

``--tp N`` runs tensor-parallel on N processes: under ``torchrun`` (``WORLD_SIZE`` set) each
process is one rank; otherwise the command starts N copies of itself on this machine
(``RANK``/``WORLD_SIZE`` on a free local port, gloo on CPU) and prints rank 0's output.
Prompts are text (``--prompt``, encoded with the checkpoint's ``tokenizer.json`` through
``tokenizers``) or token ids (``--prompt-ids 1,2,3``), in the order given. The report lists
each op's provider and how many calls each provider served (counted during the run by
:class:`~opmux.core.tally.ProviderTally`; ``tokens_per_s`` includes that cost,
a selection lookup per op call).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
from pathlib import Path
from typing import Any, TextIO

import torch

from opmux.cli._option_checks import finite_float, int_in, utf8_text
from opmux.core.errors import ConfigError

__all__ = ["HELP", "add_arguments", "run"]

HELP = "generate from a Hugging Face checkpoint directory"

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
_DIST_TIMEOUT_S = 120.0
_MAX_INT = 2**31 - 1
_MAX_TP = 1024
# the Engine's own limits (opmux.models._value_checks), repeated so that parsing the command
# line imports no model code
MAX_BLOCK_SIZE = 1 << 16
MAX_SEED = 2**63 - 1
_TORCHRUN_ENV = ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


def _text(s: str) -> tuple[str, str]:
    return ("text", utf8_text(s))


def _ids(s: str) -> tuple[str, str]:
    try:
        ids = [int(x, 10) for x in s.split(",")]
    except ValueError:
        ids = [-1]
    if not ids or min(ids) < 0 or max(ids) > _MAX_INT:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated token ids (integers >= 0), got {s[:40]!r}")
    return ("ids", s)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the ``generate`` options to ``parser``."""
    parser.add_argument("--model", required=True, help="Hugging Face checkpoint directory")
    parser.add_argument("--prompt", dest="prompts", action="append", type=_text,
                        help="a text prompt (needs tokenizer.json); repeat for a batch")
    parser.add_argument("--prompt-ids", dest="prompts", action="append", type=_ids,
                        help="a prompt as token ids, e.g. 1,2,3; repeat for a batch")
    parser.add_argument("--max-tokens", type=int_in(0, _MAX_INT), required=True,
                        help="new tokens per prompt")
    parser.add_argument("--dtype", choices=sorted(_DTYPES), default="float32")
    parser.add_argument("--tp", type=int_in(1, _MAX_TP), default=1,
                        help="tensor-parallel processes")
    parser.add_argument("--seed", type=int_in(0, MAX_SEED), default=0, help="sampling seed")
    parser.add_argument("--temperature", type=finite_float(0.0, 1e6), default=0.0,
                        help="0: greedy")
    parser.add_argument("--top-k", type=int_in(0, _MAX_INT), default=0, help="0: all tokens")
    parser.add_argument("--top-p", type=finite_float(0.0, 1.0, low_open=True), default=1.0)
    parser.add_argument("--ignore-eos", action="store_true", help="do not stop at EOS")
    parser.add_argument("--block-size", type=int_in(1, MAX_BLOCK_SIZE), default=16,
                        help="KV-cache block size")
    parser.add_argument("--dist-timeout", type=finite_float(0.0, 86400.0, low_open=True),
                        default=_DIST_TIMEOUT_S,
                        help="seconds the tensor-parallel ranks wait for each other "
                             f"(default {_DIST_TIMEOUT_S:g})")
    parser.add_argument("--json", action="store_true", help="print a JSON report")


def _argv(ns: argparse.Namespace) -> list[str]:
    out = ["--model", str(ns.model), "--max-tokens", str(ns.max_tokens), "--dtype", ns.dtype,
           "--tp", str(ns.tp), "--seed", str(ns.seed), "--temperature", str(ns.temperature),
           "--top-k", str(ns.top_k), "--top-p", str(ns.top_p),
           "--block-size", str(ns.block_size), "--dist-timeout", str(ns.dist_timeout)]
    for kind, value in ns.prompts:
        out += ["--prompt" if kind == "text" else "--prompt-ids", value]
    out += ["--ignore-eos"] * ns.ignore_eos + ["--json"] * ns.json
    return out


def _prompts(ns: argparse.Namespace, tokenizer: Any) -> list[list[int]]:
    prompts = []
    for kind, value in ns.prompts:
        if kind == "ids":
            prompts.append([int(x) for x in value.split(",")])
        elif tokenizer is None:
            raise ConfigError(f"opmux generate: --prompt needs {ns.model}/tokenizer.json; "
                              f"pass token ids with --prompt-ids instead")
        else:
            prompts.append(list(tokenizer.encode(value).ids))
    return prompts


def _progress(total: int, err: TextIO) -> tuple[Any, Any]:
    """``(callback, closer)`` of a tqdm bar when stderr is a terminal, else ``(None, None)``."""
    if not err.isatty() or total < 2:
        return None, None
    try:
        from tqdm import tqdm
    except ImportError:
        def line(done: int) -> None:
            err.write(f"\r  decode {done}/{total}")
            err.flush()

        return line, lambda: err.write("\n")
    bar = tqdm(total=total, desc="decode", unit="step", file=err)

    def update(done: int) -> None:
        bar.update(done - bar.n)

    return update, bar.close


def run(ns: argparse.Namespace, *, out: TextIO | None = None, err: TextIO | None = None) -> int:
    """Run ``opmux generate``; returns the exit code.

    :raises opmux.ConfigError: bad options or a bad checkpoint config.
    :raises opmux.models.CheckpointError: tensors that do not fit the config.
    """
    out, err = out or sys.stdout, err or sys.stderr
    if not ns.prompts:
        raise ConfigError("opmux generate: give at least one --prompt or --prompt-ids")
    if ns.tp < 1:
        raise ConfigError(f"opmux generate: --tp must be >= 1, got {ns.tp}")
    world = os.environ.get("WORLD_SIZE")
    if world is not None and world.strip() != str(ns.tp):
        # a leftover torchrun environment would wait in the rendezvous for ranks that
        # never come
        held = " ".join(f"{v}={os.environ[v]}" for v in _TORCHRUN_ENV if v in os.environ)
        raise ConfigError(
            f"opmux generate: the environment holds {held} (left over from torchrun or "
            f"another launcher?) but --tp is {ns.tp}; unset {', '.join(_TORCHRUN_ENV)} to "
            f"run here (--tp N starts its own ranks), or pass --tp {world.strip()} under "
            f"that launcher")
    if ns.tp > 1 and world is None:
        from opmux.cli._tp_launch import launch

        return launch(ns.tp, _argv(ns), out, err)
    import opmux
    from opmux import distributed
    from opmux.models import Engine, ProviderTally, SamplingParams, load_model

    sampling = SamplingParams(ns.temperature, ns.top_k, ns.top_p, ns.seed, ns.ignore_eos)
    tokenizer = None
    if (Path(ns.model) / "tokenizer.json").is_file():
        from tokenizers import Tokenizer

        try:
            tokenizer = Tokenizer.from_file(str(Path(ns.model) / "tokenizer.json"))
        except Exception as exc:  # tokenizers raises its own Exception for a bad file
            first = (str(exc).splitlines() or [type(exc).__name__])[0][:160]
            raise ConfigError(f"{Path(ns.model) / 'tokenizer.json'}: not a tokenizers file "
                              f"({first}); fix or remove it and pass --prompt-ids") from None
    prompts = _prompts(ns, tokenizer)
    if ns.tp > 1 or "WORLD_SIZE" in os.environ:
        group = distributed.init_tensor_parallel(
            tensor_parallel_size=ns.tp,
            timeout=datetime.timedelta(seconds=ns.dist_timeout))
    else:
        group = None
    try:
        opmux.load_plugins()
        model = load_model(ns.model, _DTYPES[ns.dtype])
        engine = Engine(model, ns.block_size)
        if ns.max_tokens:  # warm up: kernels load on first use
            engine.generate([prompts[0][:-1] or prompts[0]], 1, sampling)
        callback, close = _progress(ns.max_tokens - 1, err) if not ns.json else (None, None)
        names = [op.name for op in opmux.list_ops() if op.namespace == "opmux"]
        with ProviderTally(names) as tally:
            result = engine.generate(prompts, ns.max_tokens, sampling, callback)
        if close is not None:
            close()
    finally:
        if group is not None:
            distributed.destroy_tensor_parallel()
    if group is not None and group.rank != 0:
        return 0
    report: dict[str, Any] = {
        "model": str(ns.model), "architecture": model.config.architecture, "dtype": ns.dtype,
        "tp": ns.tp, "outputs": result.outputs, "providers": tally.providers(),
        "calls": tally.calls(), "tokens_per_s": result.tokens_per_s,
        "prefill_s": result.prefill_s, "decode_s": result.decode_s}
    if tokenizer is not None:
        report["text"] = [tokenizer.decode(o, skip_special_tokens=True)
                          for o in result.outputs]
    if ns.json:
        print(json.dumps(report, indent=2), file=out)
        return 0
    for i, ids in enumerate(result.outputs):
        shown = report["text"][i] if tokenizer is not None else " ".join(map(str, ids))
        print(f"[{i}] {shown}", file=out)
    width = max((len(n) for n in report["calls"]), default=0)
    print(f"\n{model.config.architecture}, {ns.dtype}, tp {ns.tp}: "
          f"{result.tokens_per_s:.1f} tokens/s", file=out)
    for name, calls in sorted(report["calls"].items()):
        counts = ", ".join(f"{p} x{n}" for p, n in sorted(calls.items()))
        print(f"  {name:<{width}}  {counts}", file=out)
    return 0
