"""Platform detection: which platform this process runs on, and why.

Each built-in platform has one cheap detector in :data:`BUILTIN_DETECTORS` (tests
monkeypatch this dict). Out-of-tree platforms come from plugins' ``opmux_platforms``
hook (:func:`opmux.core.plugins.discovered_platforms`, which discovers the plugins).
:func:`current_platform` resolves once, lazily, and caches only a success: an unknown
``OPMUX_PLATFORM`` or two claiming platforms raise on every call until fixed.
``OPMUX_PLATFORM`` forces a platform by name.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence

from opmux.core import config, plugins
from opmux.core.errors import PlatformError
from opmux.core.state import runtime
from opmux.platforms.ascend import AscendPlatform, detect_ascend
from opmux.platforms.base import Detection, Platform
from opmux.platforms.builtin import (
    CpuPlatform,
    CudaPlatform,
    RocmPlatform,
    XlaPlatform,
    detect_cuda,
    detect_rocm,
    detect_xla,
)

__all__ = [
    "BUILTIN_DETECTORS",
    "BUILTIN_PLATFORMS",
    "Detection",
    "Platform",
    "current_platform",
    "detections",
    "resolve_platform",
]

#: Detectors of the built-in platforms, in the order they are consulted. The first
#: that claims the machine wins (after out-of-tree platforms); CPU is the fallback.
BUILTIN_DETECTORS: dict[str, Callable[[], Detection]] = {
    "ascend": detect_ascend,
    "xla": detect_xla,
    "rocm": detect_rocm,
    "cuda": detect_cuda,
}

#: Built-in platform classes by name.
BUILTIN_PLATFORMS: dict[str, type[Platform]] = {
    "cpu": CpuPlatform,
    "cuda": CudaPlatform,
    "rocm": RocmPlatform,
    "xla": XlaPlatform,
    "ascend": AscendPlatform,
}

def _detector_failed(what: str, exc: Exception) -> str:
    """The reason a detector that raised gives: fatal in strict mode, else one stderr line
    (detection goes on without that platform)."""
    why = f"{what} raised {type(exc).__name__}: {exc}"
    if config.strict_plugins():
        raise PlatformError(f"platform detection failed: {why} (strict mode: fix the "
                            f"detector, or unset {config.ENV_STRICT_PLUGINS})") from exc
    print(f"opmux: platform detection: {why}; that platform is not chosen (`opmux info` "
          f"lists every detector)", file=sys.stderr)
    return why


def _run_detector(name: str, detector: Callable[[], Detection]) -> Detection:
    try:
        return detector()
    except Exception as exc:  # kept as the reason; detection goes on
        return Detection(name, None, _detector_failed(f"detector {name!r}", exc))


def resolve_platform(oot: Sequence[type[Platform]] = ()) -> tuple[Platform, list[Detection]]:
    """Decide the platform from scratch (no caching) given out-of-tree classes.

    :raises PlatformError: ``OPMUX_PLATFORM`` names no known platform, or several
        out-of-tree platforms claim the machine.
    """
    by_name: dict[str, type[Platform]] = dict(BUILTIN_PLATFORMS)
    for cls in oot:
        by_name[cls.name] = cls
    forced = config.platform_override()
    if forced:
        forced_cls = by_name.get(forced)
        if forced_cls is None:
            raise PlatformError(
                f"{config.ENV_PLATFORM}={forced!r} names no known platform; valid: "
                f"{sorted(by_name)}"
            )
        return forced_cls(), [Detection(
            forced, f"{forced_cls.__module__}.{forced_cls.__qualname__}",
            "forced by OPMUX_PLATFORM")]
    found: list[Detection] = []
    claims: list[type[Platform]] = []
    for cls in oot:
        try:
            ok = bool(cls.is_available())
            why = "is_available() returned " + str(ok)
        except Exception as exc:
            ok, why = False, _detector_failed(
                f"{cls.name!r} ({cls.__module__}.{cls.__qualname__}).is_available()", exc)
        found.append(Detection(cls.name, f"{cls.__module__}.{cls.__qualname__}" if ok else None,
                               f"out-of-tree: {why}"))
        if ok:
            claims.append(cls)
    if len(claims) > 1:
        names = sorted(f"{c.name} ({c.__module__}.{c.__qualname__})" for c in claims)
        raise PlatformError(
            f"several out-of-tree platforms claim this machine: {', '.join(names)}; only one "
            f"may be active: uninstall one, or force one with OPMUX_PLATFORM=<name>"
        )
    chosen: Platform | None = claims[0]() if claims else None
    for name, detector in BUILTIN_DETECTORS.items():
        det = _run_detector(name, detector)
        found.append(det)
        if chosen is None and det.claimed:
            chosen = BUILTIN_PLATFORMS[name]()
    found.append(Detection("cpu", "opmux.platforms.builtin.CpuPlatform",
                           "fallback" if chosen is None else "available (not chosen)"))
    return (chosen if chosen is not None else CpuPlatform()), found


def current_platform() -> Platform:
    """The platform of this process, resolved on first use and cached.

    Out-of-tree platforms of installed plugins take part (their entry modules are
    imported, which is cheap: heavy code loads only in ``opmux_register``).
    """
    rt = runtime()
    cached = rt.platform
    if cached is not None:
        return cached
    # under the plugins' lock: discovering them and resolving is one step
    with rt.plugins.lock:
        oot = plugins.discovered_platforms()
        if rt.platform is None:
            rt.platform, rt.detections = resolve_platform(oot)
        return rt.platform


def detections() -> list[Detection]:
    """Every detector's verdict from the last resolution (resolving if needed)."""
    current_platform()
    return list(runtime().detections)
