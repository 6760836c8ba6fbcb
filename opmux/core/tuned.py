"""Tuned priority tables: what ``opmux tune`` measured on this machine, loaded at start-up.

``opmux tune`` times every supported provider of each op per size bucket and writes
``$OPMUX_CACHE_DIR/tuned/<platform>-<fingerprint>.json``. Start-up loads the file of the
current fingerprint as the ``tuned`` priority layer, between the plugins' defaults and
``OPMUX_PRIORITY`` (which, like code, still wins). The fingerprint covers what the timings
depend on: the CPU model and flags, the machine, the torch thread count, the Python, torch
and opmux versions, the platform, and the set of supported providers. A file of another
fingerprint for this platform is *stale*; a file that does not parse or validate is
*damaged*: both are reported (:func:`tuned_status`, ``opmux info``) and ignored, never
fatal. ``OPMUX_TUNED=0`` turns loading off.

A size bucket is the bit length of the first argument's ``numel()`` (see
:mod:`opmux.core.dispatch`); an op whose buckets disagree gets a per-bucket order, picked on
the hot path by one index. Buckets not measured take the order of the nearest measured one.

File format (``"format": 1``)::

    {"format": 1, "platform": "cpu", "fingerprint": {...}, "fingerprint_id": "…",
     "created": "2026-…Z",
     "ops": {"opmux::rms_norm": {"order": ["cpp", "native"],
                                 "buckets": {"10": {"order": [...], "ms": {...}}}}}}
"""

from __future__ import annotations

import hashlib
import json
import os
import platform as _platform
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final

from opmux.core import config
from opmux.core._cache_json import read_cache_json, warn_ignored
from opmux.core._dist import dist_headers
from opmux.core.dispatch import SIZE_BUCKETS
from opmux.core.priority import NATIVE
from opmux.core.state import runtime

if TYPE_CHECKING:
    from opmux.core.op import Op
    from opmux.core.registry import OpRegistry
    from opmux.platforms.base import Platform

__all__ = ["FORMAT", "TunedStatus", "apply_tuned", "fingerprint", "fingerprint_id",
           "nearest_buckets", "tuned_dir", "tuned_path", "tuned_status", "validate_table"]

FORMAT: Final = 1
"""Version of the tuned file layout."""


@dataclass
class TunedStatus:
    """What start-up did with the tuned table."""

    #: ``"loaded"``, ``"none"`` (no file), ``"disabled"`` (``OPMUX_TUNED=0``),
    #: ``"stale"`` (files of another fingerprint) or ``"damaged"`` (unreadable/invalid).
    state: str = "none"
    #: the file loaded, or the one reported.
    path: str = ""
    #: why a file was ignored, or what was loaded.
    reason: str = ""
    #: ops that got a tuned order.
    ops: int = 0

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def tuned_status() -> TunedStatus:
    """A copy of the last start-up's tuned-table status."""
    status = runtime().tuned
    return TunedStatus(**status.as_dict()) if status is not None else TunedStatus()


def tuned_dir() -> Path:
    """``$OPMUX_CACHE_DIR/tuned``."""
    return config.cache_dir() / "tuned"


def _cpu() -> dict[str, str]:
    """The CPU model and a hash of its feature flags (first processor of /proc/cpuinfo)."""
    model = flags = ""
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                name, _, value = (s.strip() for s in line.partition(":"))
                if name == "model name" and not model:
                    model = value
                elif name in ("flags", "Features") and not flags:
                    flags = hashlib.sha256(" ".join(sorted(value.split())).encode()).hexdigest()
                if model and flags:
                    break
    except OSError:
        pass
    return {"model": model or _platform.processor() or _platform.machine(),
            "flags": flags[:16]}


def fingerprint(registry: OpRegistry, platform: Platform) -> dict[str, Any]:
    """What tuned timings depend on (the name of the file is a hash of it)."""
    import importlib.metadata
    import sys

    import torch

    try:
        version = dist_headers(importlib.metadata.distribution("opmux"))["Version"]
    except importlib.metadata.PackageNotFoundError:
        version = "0+unknown"
    providers = sorted(f"{op.qualname}:{name}" for op in registry.list_ops()
                       for name, impl in op.impls.items() if impl.supported and name != NATIVE)
    python = f"{sys.version_info[0]}.{sys.version_info[1]}"
    return {"platform": platform.name, "machine": _platform.machine(), "cpu": _cpu(),
            "threads": torch.get_num_threads(), "python": python,
            "torch": torch.__version__, "opmux": version,
            "providers": hashlib.sha256("\n".join(providers).encode()).hexdigest()[:16]}


def fingerprint_id(fp: dict[str, Any]) -> str:
    """The 16-hex-digit hash of a fingerprint (part of the file name)."""
    return hashlib.sha256(json.dumps(fp, sort_keys=True).encode()).hexdigest()[:16]


def tuned_path(platform_name: str, fp_id: str) -> Path:
    """``$OPMUX_CACHE_DIR/tuned/<platform>-<fingerprint>.json``."""
    return tuned_dir() / f"{platform_name}-{fp_id}.json"


def validate_table(data: Any, ops: dict[str, Op]) -> list[str]:
    """Problems of a parsed tuned file (empty: usable). ``ops``: qualname -> op."""
    if not isinstance(data, dict):
        return ["the top level is not an object"]
    problems = []
    if data.get("format") != FORMAT:
        problems.append(f"format {str(data.get('format'))[:40]}, expected {FORMAT}")
    if not isinstance(data.get("fingerprint"), dict):
        problems.append("'fingerprint' is not an object")
    table = data.get("ops")
    if not isinstance(table, dict):
        return [*problems, "'ops' is not an object"]
    for qualname, entry in table.items():
        op = ops.get(qualname)
        if op is None:
            problems.append(f"unknown op {qualname!r}")
            continue
        if not isinstance(entry, dict):
            problems.append(f"{qualname}: entry is not an object")
            continue
        orders = [("order", entry.get("order"))]
        buckets = entry.get("buckets", {})
        if not isinstance(buckets, dict):
            problems.append(f"{qualname}: 'buckets' is not an object")
            buckets = {}
        for bits, bucket in buckets.items():
            if not (isinstance(bits, str) and bits.isascii() and bits.isdigit()
                    and int(bits) < SIZE_BUCKETS):
                problems.append(f"{qualname}: bucket {bits[:20]!r} is not "
                                f"0..{SIZE_BUCKETS - 1}")
                continue
            orders.append((f"bucket {bits}", bucket.get("order")
                           if isinstance(bucket, dict) else None))
        for where, order in orders:
            if not (isinstance(order, list) and order
                    and all(isinstance(p, str) for p in order)):
                problems.append(f"{qualname}: {where}: 'order' is not a list of providers")
            elif unknown := [p for p in order if not op.has_provider(p)]:
                problems.append(f"{qualname}: {where}: unknown provider(s) {unknown}")
    return problems


def nearest_buckets(orders: dict[int, list[str]]) -> list[list[str]]:
    """One order per size bucket: each bucket takes the nearest measured one (lower on ties)."""
    measured = sorted(orders)
    return [orders[min(measured, key=lambda m: (abs(m - b), m))] for b in range(SIZE_BUCKETS)]


def _first_is_tensor(op: Op) -> bool:
    return op.schema.startswith("(Tensor ")


def apply_tuned(registry: OpRegistry, platform: Platform, ops: list[Op]) -> TunedStatus:
    """Set every op's ``tuned`` layer from this machine's tuned file (start-up step).

    Never raises for a missing, stale or damaged file: the status says what happened.
    """
    for op in ops:
        if op.priorities.layer("tuned") is not None:
            op.priorities.set_tuned(None)
    status = _load(registry, platform, ops)
    runtime().tuned = status
    return status


def _load(registry: OpRegistry, platform: Platform, ops: list[Op]) -> TunedStatus:
    if not config.tuned_enabled():
        return TunedStatus("disabled", reason=f"{config.ENV_TUNED} turns loading off")
    folder = tuned_dir()
    try:
        names = sorted(n for n in os.listdir(folder)
                       if n.startswith(platform.name + "-") and n.endswith(".json"))
    except OSError:
        names = []
    if not names:
        return TunedStatus("none", reason=f"no tuned table for platform {platform.name!r} in "
                                          f"{folder} (run `opmux tune`)")
    fp = fingerprint(registry, platform)
    path = tuned_path(platform.name, fingerprint_id(fp))
    if path.name not in names:
        return TunedStatus("stale", str(folder / names[-1]), _stale_reason(
            folder / names[-1], fp) + "; run `opmux tune` again")
    data, why = read_cache_json(path)
    if why is not None:
        return _damaged(path, f"cannot read it: {why}")
    by_name = {op.qualname: op for op in ops}
    problems = validate_table(data, by_name)
    if problems:
        return _damaged(path, "; ".join(p[:120] for p in problems[:3]))
    if data.get("fingerprint") != fp:
        return TunedStatus("stale", str(path), _stale_reason(path, fp))
    for qualname, entry in data["ops"].items():
        op = by_name[qualname]
        orders = {int(b): v["order"] for b, v in entry.get("buckets", {}).items()}
        distinct = {tuple(o) for o in orders.values()}
        sized = (nearest_buckets(orders) if len(distinct) > 1 and _first_is_tensor(op)
                 else None)
        op.priorities.set_tuned(entry["order"], sized)
    return TunedStatus("loaded", str(path), f"{len(data['ops'])} op(s) tuned",
                       len(data["ops"]))


def _damaged(path: Path, reason: str) -> TunedStatus:
    """A tuned file that cannot be used: one warning naming it, and the status says why."""
    warn_ignored(path, reason, "tuned table; the plugins' priorities are used (run `opmux "
                               "tune` again to rewrite it)", stacklevel=4)
    return TunedStatus("damaged", str(path), reason)


def _stale_reason(path: Path, fp: dict[str, Any]) -> str:
    data, why = read_cache_json(path)
    old = data.get("fingerprint") if isinstance(data, dict) else None
    if why is not None or not isinstance(old, dict):
        return f"{path.name} is of another fingerprint and unreadable"
    changed = sorted(k for k in fp.keys() | old.keys() if fp.get(k) != old.get(k))
    return f"{path.name} was tuned for another setup (changed: {', '.join(changed) or '?'})"
