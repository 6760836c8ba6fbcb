"""``opmux explain OP --shape ...``: which provider would run for such arguments, and why."""

from __future__ import annotations

import argparse
import inspect
import json
from typing import Any, Final

__all__ = ["HELP", "add_arguments", "op_args", "run"]

HELP: Final = "which provider would run for such arguments, and why"

_DTYPES: Final = {"float32": "float32", "fp32": "float32", "float16": "float16",
                  "fp16": "float16", "bfloat16": "bfloat16", "bf16": "bfloat16",
                  "float64": "float64", "int32": "int32", "int64": "int64", "bool": "bool",
                  "int8": "int8", "uint8": "uint8"}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the ``explain`` options to ``parser``."""
    parser.add_argument("op")
    parser.add_argument("--shape", action="append", default=[],
                        help="shape of each Tensor argument in order, e.g. 4,256 (repeat)")
    parser.add_argument("--dtype", action="append", default=[],
                        help="dtype of each Tensor argument (one value applies to the rest)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--arg", action="append", default=[],
                        help="non-tensor argument name=value")
    parser.add_argument("--json", action="store_true")


def _parse_value(text: str) -> Any:
    low = text.lower()
    if low in ("none", "null"):
        return None
    if low in ("true", "false"):
        return low == "true"
    for conv in (int, float):
        try:
            return conv(text)
        except ValueError:
            pass
    return text


def _explain_args(ns: argparse.Namespace) -> tuple[Any, list[Any]]:
    """The op and zero-filled arguments of the requested shapes and dtypes."""
    import opmux
    from opmux.core.errors import ConfigError

    op = opmux.get_op(ns.op)
    shapes = [parse_shape(s, ",", f"--shape {s!r}") for s in ns.shape]
    extra = {}
    for item in ns.arg:
        name, sep, value = str(item).partition("=")
        if not sep:
            raise ConfigError(f"--arg {item!r}: expected name=value")
        extra[name] = _parse_value(value)
    return op, op_args(op, shapes, ns.dtype, extra, _device(ns.device))


_MAX_NUMEL: Final = 1 << 31


def parse_shape(text: str, sep: str, where: str) -> tuple[int, ...]:
    """A tensor shape written as integers >= 0 joined by ``sep`` (``"4,256"``).

    :param where: the option and value, for the message.
    :raises ConfigError: not integers, a negative size, or more than 2**31 elements.
    """
    from opmux.core.errors import ConfigError

    try:
        dims = tuple(int(d, 10) for d in text.split(sep) if d.strip())
    except ValueError:
        dims = (-1,)
    numel = 1
    for d in dims:
        numel *= max(d, 0)
    if any(d < 0 for d in dims) or numel > _MAX_NUMEL:
        raise ConfigError(f"{where}: a shape is sizes >= 0 joined by {sep!r} (at most "
                          f"{_MAX_NUMEL} elements), e.g. 4{sep}256")
    return dims


def _device(text: str) -> str:
    """``text`` when it names a torch device that exists here."""
    import torch

    from opmux.core.errors import ConfigError

    try:
        dev = torch.device(text)
    except (RuntimeError, ValueError):
        raise ConfigError(f"--device {text!r} is not a torch device; use e.g. cpu or cuda"
                          ) from None
    module = getattr(torch, dev.type, None)
    available = dev.type in ("cpu", "meta") or (
        module is not None and hasattr(module, "is_available") and module.is_available())
    if not available:
        raise ConfigError(f"--device {text!r}: no {dev.type} device here; use --device cpu")
    return text


def op_args(op: Any, shapes: list[tuple[int, ...]], dtype_names: list[str],
            extra: dict[str, Any], device: str) -> list[Any]:
    """Zero-filled arguments of ``op``: one shape per Tensor parameter, in order; ``extra``
    gives non-tensor values by name, defaults fill the rest (``explain`` and ``tune``).

    :raises ConfigError: a missing shape or value, an unknown dtype or parameter name.
    """
    import torch

    from opmux.core.errors import ConfigError

    dtypes = [_DTYPES.get(d.lower()) for d in dtype_names] or ["float32"]
    if None in dtypes:
        raise ConfigError(f"--dtype: unknown dtype in {dtype_names}; valid: {sorted(_DTYPES)}")
    extra = dict(extra)
    args: list[Any] = []
    tensor_i = 0
    for param in op.signature.parameters.values():
        if param.name in extra:
            args.append(extra.pop(param.name))
        elif param.annotation in (torch.Tensor, "Tensor", "torch.Tensor"):
            if tensor_i >= len(shapes):
                raise ConfigError(
                    f"op {op.qualname!r} takes Tensor {param.name!r}: give one --shape per "
                    f"Tensor argument, in order; signature {op.schema}")
            dtype = getattr(torch, str(dtypes[min(tensor_i, len(dtypes) - 1)]))
            args.append(torch.zeros(shapes[tensor_i], dtype=dtype, device=device))
            tensor_i += 1
        elif param.default is not inspect.Parameter.empty:
            args.append(param.default)
        else:
            raise ConfigError(f"op {op.qualname!r}: give --arg {param.name}=VALUE "
                              f"(signature {op.schema})")
    if extra:
        raise ConfigError(f"op {op.qualname!r} has no parameter(s) {sorted(extra)}")
    return args


def run(ns: argparse.Namespace) -> int:
    """Print the explanation (or JSON); returns the exit status."""
    from opmux.core.errors import ConfigError, OpmuxError

    op, args = _explain_args(ns)
    chosen = op.dispatch(*args)
    try:  # a provider is "chosen" only for arguments the op takes
        op(*args)
    except (OpmuxError, ValueError, TypeError, RuntimeError) as exc:
        first = (str(exc).splitlines() or [type(exc).__name__])[0]
        raise ConfigError(f"opmux explain: {op.qualname} rejects these arguments: {first}"
                          ) from None
    fmt = _kv_cache_format_line(op, args)
    if ns.json:
        data = {"op": op.qualname, "chosen": chosen.provider,
                "dispatch_key": chosen.dispatch_key, "priority": op.priority(),
                "explanation": op.explain(*args).splitlines()}
        if fmt is not None:
            data["kv_cache_format"] = fmt
        print(json.dumps(data, indent=2))
    else:
        print(op.explain(*args))
        if fmt is not None:
            print(fmt)
    return 0


def _kv_cache_format_line(op: Any, args: list[Any]) -> str | None:
    """For the paged-cache ops: the format :func:`opmux.kv_cache_format` tells an engine to
    allocate for these caches (canonical shapes given), and which provider prefers it."""
    if op.qualname not in ("opmux::paged_attention", "opmux::reshape_and_cache"):
        return None
    from opmux.ops.kv_formats import kv_cache_format_report

    cache = args[2] if op.qualname == "opmux::reshape_and_cache" else args[1]
    if cache.dim() != 4:
        return None
    _, block_size, kv_heads, head_size = cache.shape
    return kv_cache_format_report(cache.device, cache.dtype, head_size, kv_heads, block_size)
