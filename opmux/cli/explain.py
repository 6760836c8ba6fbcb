"""``opmux explain OP --shape ...``: which provider would run for such arguments, and why.

The arguments are fake tensors (:class:`torch._subclasses.fake_tensor.FakeTensorMode`): they
have the shapes, dtypes and device asked for but no storage, so nothing is allocated however
large the shapes, and the op's fake (its checks, without reading values) decides whether it
takes them. A ``supports_args`` predicate that reads tensor values sees none and declines.
``--device`` must exist here (``meta`` too); one ``--shape`` per Tensor argument, no more.
"""

from __future__ import annotations

import argparse
import contextlib
import inspect
import logging
from collections.abc import Iterator
from typing import Any, Final

from opmux.cli.strict_json import dumps

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
    """The op and fake arguments of the requested shapes and dtypes (call it inside a
    ``FakeTensorMode``)."""
    import opmux
    from opmux.cli._option_checks import run_device
    from opmux.core.errors import ConfigError

    op = opmux.get_op(ns.op)
    shapes = [parse_shape(s, ",", f"--shape {s!r}") for s in ns.shape]
    extra = {}
    for item in ns.arg:
        name, sep, value = str(item).partition("=")
        if not sep:
            raise ConfigError(f"--arg {item!r}: expected name=value")
        extra[name] = _parse_value(value)
    return op, op_args(op, shapes, ns.dtype, extra, run_device(ns.device, "explain", meta=True))


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
    if len(shapes) > tensor_i or len(dtype_names) > tensor_i:
        raise ConfigError(f"op {op.qualname!r} takes {tensor_i} Tensor argument(s): give one "
                          f"--shape (and at most one --dtype) per Tensor argument, got "
                          f"{len(shapes)} --shape and {len(dtype_names)} --dtype; signature "
                          f"{op.schema}")
    return args


def run(ns: argparse.Namespace) -> int:
    """Print the explanation (or JSON); returns the exit status."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from opmux.core.errors import ConfigError, OpmuxError

    with _quiet_fake_tensor_log(), FakeTensorMode(allow_non_fake_inputs=True):
        op, args = _explain_args(ns)
        chosen = op.dispatch(*args)
        try:  # a provider is "chosen" only for arguments the op takes (its fake checks them)
            op(*args)
        except (OpmuxError, ValueError, TypeError, RuntimeError, NotImplementedError) as exc:
            first = (str(exc).splitlines() or [type(exc).__name__])[0]
            raise ConfigError(f"opmux explain: {op.qualname} rejects these arguments: {first}"
                              ) from None
        explanation = op.explain(*args)
        fmt = _kv_cache_format_line(op, args)
    if ns.json:
        data = {"op": op.qualname, "chosen": chosen.provider,
                "dispatch_key": chosen.dispatch_key, "priority": op.priority(),
                "explanation": explanation.splitlines()}
        if fmt is not None:
            data["kv_cache_format"] = fmt
        print(dumps(data))
    else:
        print(explanation)
        if fmt is not None:
            print(fmt)
    return 0


@contextlib.contextmanager
def _quiet_fake_tensor_log() -> Iterator[None]:
    """FakeTensorMode logs a traceback when an op's fake raises; here that is the answer
    (one line), not a fault."""
    log = logging.getLogger("torch._subclasses.fake_tensor")
    level = log.level
    log.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        log.setLevel(level)


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
