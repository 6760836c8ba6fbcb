"""The ``opmux`` command: ``info``, ``explain``, ``check``, ``bench``, ``demo``, ``build``.

Errors exit non-zero with one line on stderr, no traceback (``OPMUX_DEBUG=1`` shows it).
"""

from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import json
import os
import sys
from collections.abc import Sequence
from typing import Any

__all__ = ["main"]

_STACKS = ("torch", "pluggy", "triton", "torch_xla", "mindspore", "torch_npu", "numpy")


def _versions() -> dict[str, str | None]:
    out: dict[str, str | None] = {}
    for dist in _STACKS:
        if importlib.util.find_spec(dist) is None:
            out[dist] = None
            continue
        try:
            out[dist] = importlib.metadata.version(dist.replace("_", "-"))
        except importlib.metadata.PackageNotFoundError:
            try:
                out[dist] = importlib.metadata.version(dist)
            except importlib.metadata.PackageNotFoundError:
                out[dist] = "installed"
    return out


def _table(rows: Sequence[Sequence[object]], header: Sequence[str]) -> str:
    cells = [[str(c) for c in header]] + [[str(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip()
             for r in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def info_data() -> dict[str, Any]:
    """Everything ``opmux info`` shows, as plain data."""
    import opmux
    from opmux.core.custom_op import custom_op_settings
    from opmux.platforms import detections

    opmux.load_plugins()
    platform = opmux.current_platform()
    ops = []
    for op in opmux.list_ops():
        order = op.priority()
        providers = []
        for name, impl in op.impls.items():
            providers.append({
                "provider": name, "dispatch_key": impl.dispatch_key,
                "supported": impl.supported, "reason": impl.reason,
                "rank": order.index(name) + 1 if name in order else None,
            })
        ops.append({"op": op.qualname, "schema": op.schema, "priority": order,
                    "priority_source": op.priority_source(), "providers": providers})
    return {
        "platform": platform.describe(),
        "detectors": [d.as_dict() for d in detections()],
        "plugins": [r.as_dict() for r in opmux.plugin_report()],
        "ops": ops,
        "custom_ops": opmux.custom_op_counts(),
        "custom_op_settings": custom_op_settings(),
        "versions": _versions(),
    }


def _cmd_info(ns: argparse.Namespace) -> int:
    data = info_data()
    if ns.json:
        print(json.dumps(data, indent=2, default=str))
        return 0
    p = data["platform"]
    print(f"platform: {p['name']} (device {p['device_type']}, dispatch key {p['dispatch_key']})")
    print()
    print(_table([(d["name"], "yes" if d["claimed"] else "no", d["reason"])
                  for d in data["detectors"]], ("detector", "claims", "reason")))
    print()
    print(_table([(r["name"], r["status"], ",".join(r["platforms"]) or "-",
                   r["reason"].splitlines()[0] if r["reason"] else "") for r in data["plugins"]],
                 ("plugin", "status", "platforms", "reason")))
    print()
    rows = []
    for op in data["ops"]:
        for pr in sorted(op["providers"], key=lambda x: (x["rank"] is None, x["rank"] or 0)):
            rows.append((op["op"], pr["provider"], pr["dispatch_key"],
                         "yes" if pr["supported"] else f"no: {pr['reason'] or ''}".strip(),
                         pr["rank"] or "-", op["priority_source"]))
    print(_table(rows, ("op", "provider", "key", "supported", "rank", "priority from")))
    counts, cfg = data["custom_ops"], data["custom_op_settings"]
    print(f"\ncustom ops: base {cfg['base']} ({cfg['source']}), overrides "
          f"{cfg['overrides'] or '-'}, compile mode {cfg['compile_mode']}")
    names = sorted(set(counts["enabled"]) | set(counts["disabled"]) | set(cfg["layers"]))
    print(_table([(n, "yes" if cfg["layers"].get(n, False) else "no",
                   counts["enabled"].get(n, 0), counts["disabled"].get(n, 0)) for n in names],
                 ("custom op layer", "enabled now", "built enabled", "built disabled")))
    print()
    print("versions: " + ", ".join(f"{k} {v or '-'}" for k, v in data["versions"].items()))
    return 0


_DTYPES = {"float32": "float32", "fp32": "float32", "float16": "float16", "fp16": "float16",
           "bfloat16": "bfloat16", "bf16": "bfloat16", "float64": "float64",
           "int32": "int32", "int64": "int64", "bool": "bool", "int8": "int8", "uint8": "uint8"}


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
    import inspect

    import torch

    import opmux
    from opmux.core.errors import ConfigError

    op = opmux.get_op(ns.op)
    shapes = [tuple(int(d) for d in s.split(",") if d.strip()) for s in ns.shape]
    dtypes = [_DTYPES.get(d.lower()) for d in ns.dtype] or ["float32"]
    if None in dtypes:
        raise ConfigError(f"--dtype: unknown dtype in {ns.dtype}; valid: {sorted(_DTYPES)}")
    extra = {}
    for item in ns.arg:
        name, sep, value = str(item).partition("=")
        if not sep:
            raise ConfigError(f"--arg {item!r}: expected name=value")
        extra[name] = _parse_value(value)
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
            args.append(torch.zeros(shapes[tensor_i], dtype=dtype, device=ns.device))
            tensor_i += 1
        elif param.default is not inspect.Parameter.empty:
            args.append(param.default)
        else:
            raise ConfigError(f"op {op.qualname!r}: give --arg {param.name}=VALUE "
                              f"(signature {op.schema})")
    if extra:
        raise ConfigError(f"op {op.qualname!r} has no parameter(s) {sorted(extra)}")
    return op, args


def _cmd_explain(ns: argparse.Namespace) -> int:
    op, args = _explain_args(ns)
    chosen = op.dispatch(*args)
    if ns.json:
        print(json.dumps({"op": op.qualname, "chosen": chosen.provider,
                          "dispatch_key": chosen.dispatch_key, "priority": op.priority(),
                          "explanation": op.explain(*args).splitlines()}, indent=2))
    else:
        print(op.explain(*args))
    return 0


def _cmd_build(ns: argparse.Namespace) -> int:
    from opmux.plugins.cpu import _build

    ok, message = _build.build_status(verbose=ns.verbose)
    print(("built: " if ok else "build failed: ") + message)
    return 0 if ok else 1


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="opmux", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("info", help="platform, detectors, plugins, ops, providers, versions")
    p.add_argument("--json", action="store_true")
    p.set_defaults(run=_cmd_info)
    p = sub.add_parser("explain", help="which provider would run for such arguments, and why")
    p.add_argument("op")
    p.add_argument("--shape", action="append", default=[],
                   help="shape of each Tensor argument in order, e.g. 4,256 (repeat)")
    p.add_argument("--dtype", action="append", default=[],
                   help="dtype of each Tensor argument (one value applies to the rest)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--arg", action="append", default=[], help="non-tensor argument name=value")
    p.add_argument("--json", action="store_true")
    p.set_defaults(run=_cmd_explain)
    if importlib.util.find_spec("opmux.testing.check_cli") is not None:
        from opmux.testing import check_cli

        p = sub.add_parser("check", help="conformance of providers against native")
        check_cli.add_arguments(p)
        p.set_defaults(run=check_cli.run)
    if importlib.util.find_spec("opmux.testing.bench_cli") is not None:
        from opmux.testing import bench_cli

        p = sub.add_parser("bench", help="time each supported provider against native here")
        bench_cli.add_arguments(p)
        p.set_defaults(run=bench_cli.run)
    if importlib.util.find_spec("opmux.demo") is not None:
        from opmux import demo

        p = sub.add_parser("demo", help="a random Llama checkpoint via opmux, checked vs native")
        demo.add_arguments(p)
        p.set_defaults(run=demo.run)
    if importlib.util.find_spec("opmux.models") is not None:
        from opmux.models import generate_cli

        p = sub.add_parser("generate", help="generate from a Hugging Face checkpoint directory")
        generate_cli.add_arguments(p)
        p.set_defaults(run=generate_cli.run)
    p = sub.add_parser("build", help="prebuild the CPU C++ kernels")
    p.add_argument("--verbose", action="store_true")
    p.set_defaults(run=_cmd_build)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``opmux`` console script."""
    from opmux.core.errors import OpmuxError

    ns = _parser().parse_args(argv)
    try:
        return int(ns.run(ns))
    except (OpmuxError, ValueError, KeyError) as exc:
        if os.environ.get("OPMUX_DEBUG"):
            raise
        message = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        print(f"opmux: error: {message}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
