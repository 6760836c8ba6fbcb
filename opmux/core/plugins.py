"""Plugin discovery and loading with pluggy.

Plugins are modules named by entry points in group :data:`PLUGIN_GROUP`. An entry module
is small: it defines hook implementations (marked with :data:`hookimpl`) and imports its
heavy backends inside ``opmux_register``. Loading happens once per process, lazily on
the first op call (or explicitly with :func:`load_plugins`), in spawned workers too.

A plugin that fails to import, raises in a hook, or registers something invalid is
recorded as ``failed`` with its traceback, everything it registered is rolled back, and
the others load; ``OPMUX_STRICT_PLUGINS=1`` makes the failure raise instead.
"""

from __future__ import annotations

import importlib.metadata
import inspect
import os
import threading
import traceback
from dataclasses import asdict, dataclass, field
from types import ModuleType
from typing import TYPE_CHECKING, Any, Final

import pluggy

from opmux.core.config import (
    ENV_PLUGINS,
    ENV_PRIORITY,
    parse_plugin_allow_list,
    parse_priority,
    strict_plugins,
)
from opmux.core.errors import ConfigError, PluginLoadError, UnknownOpError

if TYPE_CHECKING:
    from opmux.core.registry import OpRegistry
    from opmux.platforms.base import Platform

__all__ = ["PLUGIN_GROUP", "PluginRecord", "hookimpl", "hookspec", "load_plugins",
           "plugin_report"]

PROJECT: Final = "opmux"
PLUGIN_GROUP: Final = "opmux.plugins"
"""Entry-point group of opmux plugins, built-in and third-party alike; read on the first
op call of a process (or by :func:`load_plugins`)."""

hookspec = pluggy.HookspecMarker(PROJECT)
#: Marker for plugin hook implementations: ``@opmux.hookimpl``.
hookimpl = pluggy.HookimplMarker(PROJECT)


class _HookSpecs:
    """The hooks a plugin may implement."""

    @hookspec
    def opmux_plugin_info(self) -> dict[str, Any]:  # type: ignore[empty-body]
        """``{"name": str, "platforms": ["cuda", ...]}`` (``"*"`` = any platform).

        Called before the plugin's other hooks; must not import heavy code.
        """

    @hookspec
    def opmux_platforms(self) -> list[type[Platform]]:  # type: ignore[empty-body]
        """Extra (out-of-tree) :class:`~opmux.Platform` classes this plugin contributes."""

    @hookspec
    def opmux_register(self, registry: OpRegistry, platform: Platform) -> None:
        """Register providers (``registry.get_op(name).register_impl(...)``) or new ops."""

    @hookspec
    def opmux_default_priority(self, op_name: str,  # type: ignore[empty-body]
                               platform: Platform) -> list[str] | None:
        """Preferred provider order for ``op_name`` on ``platform``, or ``None``."""


@dataclass
class PluginRecord:
    """What happened to one plugin."""

    #: entry-point name.
    name: str
    #: ``"loaded"``, ``"skipped"``, ``"failed"`` or ``"discovered"`` (not yet activated).
    status: str
    #: why it was skipped or failed (empty when loaded).
    reason: str = ""
    #: the entry point's value, ``module`` or ``module:attr``.
    value: str = ""
    #: distribution providing it, ``name version``.
    dist: str = ""
    #: platforms it serves, from ``opmux_plugin_info``.
    platforms: list[str] = field(default_factory=list)
    #: ``op:provider`` pairs it registered.
    providers: list[str] = field(default_factory=list)
    #: the traceback of a failure.
    traceback: str = ""

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


class _State:
    def __init__(self) -> None:
        self.lock = threading.RLock()
        self.pm = pluggy.PluginManager(PROJECT)
        self.pm.add_hookspecs(_HookSpecs)
        self.records: dict[str, PluginRecord] = {}
        self.modules: dict[str, ModuleType] = {}
        self.platforms: dict[str, list[type[Platform]]] = {}
        self.discovered = False
        self.loaded = False


_STATE: list[_State] = [_State()]


def _entry_points() -> list[importlib.metadata.EntryPoint]:
    """The installed entry points of :data:`PLUGIN_GROUP` (tests monkeypatch this)."""
    return sorted(importlib.metadata.entry_points(group=PLUGIN_GROUP), key=lambda e: e.name)


def _fail(state: _State, rec: PluginRecord, reason: str, exc: BaseException) -> None:
    rec.status, rec.reason = "failed", reason
    rec.traceback = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
    module = state.modules.pop(rec.name, None)
    state.platforms.pop(rec.name, None)
    if module is not None and state.pm.is_registered(module):
        state.pm.unregister(module)
    if strict_plugins():
        raise PluginLoadError(f"plugin {rec.name!r} failed: {reason} (strict mode: "
                              f"unset OPMUX_STRICT_PLUGINS to skip failing plugins)",
                              plugin=rec.name) from exc


def _discover(state: _State) -> None:
    """Import each allowed entry module, validate its hooks, read its info and platforms."""
    if state.discovered:
        return
    state.discovered = True
    allow = parse_plugin_allow_list(os.environ.get(ENV_PLUGINS))
    for ep in _entry_points():
        dist = getattr(ep, "dist", None)
        rec = PluginRecord(ep.name, "discovered", value=ep.value,
                           dist=f"{dist.name} {dist.version}" if dist is not None else "")
        state.records[ep.name] = rec
        if allow is not None and ep.name not in allow:
            rec.status, rec.reason = "skipped", f"not in {ENV_PLUGINS}={','.join(sorted(allow))}"
            continue
        if ep.name in state.modules:
            rec.status, rec.reason = "skipped", "another entry point has the same name"
            continue
        try:
            module = ep.load()
        except Exception as exc:
            _fail(state, rec, f"import of {ep.value!r} raised {type(exc).__name__}: {exc}", exc)
            continue
        try:
            state.pm.register(module, name=ep.name)
            state.modules[ep.name] = module
            info = _call_own(module, "opmux_plugin_info")
            if (not isinstance(info, dict) or not isinstance(info.get("platforms"), list)
                    or not all(isinstance(p, str) for p in info["platforms"])):
                raise TypeError(
                    f"opmux_plugin_info() must return {{'name': str, 'platforms': [str, ...]}}, "
                    f"got {info!r}")
            rec.platforms = list(info["platforms"])
            extra = _call_own(module, "opmux_platforms") if hasattr(
                module, "opmux_platforms") else None
            if extra:
                state.platforms[ep.name] = list(extra)
        except Exception as exc:
            _fail(state, rec, f"{type(exc).__name__}: {exc}", exc)


def _call_own(module: ModuleType, hook: str, **kwargs: Any) -> Any:
    fn = getattr(module, hook, None)
    if fn is None:
        if hook == "opmux_plugin_info":
            raise TypeError(f"plugin module {module.__name__!r} does not define "
                            f"opmux_plugin_info(); every plugin must")
        return None
    accepted = inspect.signature(fn).parameters  # pluggy lets a hookimpl take a subset
    return fn(**{k: v for k, v in kwargs.items() if k in accepted})


def _discovered_platforms() -> list[type[Platform]]:
    state = _STATE[0]
    with state.lock:
        _discover(state)
        return [cls for classes in state.platforms.values() for cls in classes]


def _load_into(registry: OpRegistry) -> None:
    """Activate every discovered plugin for the current platform (the global loader)."""
    from opmux.platforms import current_platform

    state = _STATE[0]
    with state.lock:
        if state.loaded:
            return
        _discover(state)
        platform = current_platform()
        registry.list_ops()  # the catalog exists before plugins look ops up
        for name, module in list(state.modules.items()):
            rec = state.records[name]
            if "*" not in rec.platforms and platform.name not in rec.platforms:
                rec.status = "skipped"
                rec.reason = (f"platform mismatch: serves {rec.platforms}, current platform is "
                              f"{platform.name!r}")
                state.pm.unregister(module)
                del state.modules[name]
                continue
            registry._begin_journal()
            try:
                _call_own(module, "opmux_register", registry=registry, platform=platform)
            except Exception as exc:
                registry._end_journal(rollback=True)
                _fail(state, rec, f"opmux_register raised {type(exc).__name__}: {exc}", exc)
                continue
            rec.providers = registry._end_journal(rollback=False)
            rec.status = "loaded"
        state.loaded = True
        _apply_priorities(state, registry, platform)


def _apply_priorities(state: _State, registry: OpRegistry, platform: Platform) -> None:
    """Compose priority defaults: platform → plugins → ``OPMUX_PRIORITY`` (code wins later)."""
    for op in registry.list_ops():
        # catalog ops are asked for by bare name, ops of other namespaces by qualname
        name = op.name if op.namespace == "opmux" else op.qualname
        op._set_layer("platform", platform.default_priority(name) or None, strict=False)
        merged: list[str] = []
        for result in state.pm.hook.opmux_default_priority(op_name=name, platform=platform):
            if result:
                merged.extend(p for p in result if p != "native" and p not in merged)
        op._set_layer("plugins", merged or None, strict=False)
    text = os.environ.get(ENV_PRIORITY, "")
    for op_name, providers in parse_priority(text).items():
        try:
            op = registry.get_op(op_name)
        except UnknownOpError as exc:
            raise ConfigError(f"{ENV_PRIORITY}: unknown op {op_name!r} in {text!r}; known ops: "
                              f"{sorted(o.name for o in registry.list_ops())}") from exc
        unknown = [p for p in providers if p not in op._impls]
        if unknown:
            raise ConfigError(f"{ENV_PRIORITY}: op {op_name!r}: unknown provider(s) {unknown}; "
                              f"registered: {sorted(op._impls)}")
        op._set_layer("env", providers)


def load_plugins() -> list[PluginRecord]:
    """Load plugins into the global registry (idempotent, thread-safe); return the report."""
    from opmux.core.registry import global_registry

    global_registry()._ensure_loaded()
    return plugin_report()


def plugin_report() -> list[PluginRecord]:
    """Every plugin seen, with its status and why (a snapshot)."""
    state = _STATE[0]
    with state.lock:
        return [PluginRecord(**r.as_dict()) for r in state.records.values()]


def plugin_manager() -> pluggy.PluginManager:
    """The pluggy manager (for ``enable_tracing`` and other pluggy tooling)."""
    return _STATE[0].pm


def _reset_for_tests() -> None:
    """Forget loaded plugins and start from a fresh plugin manager."""
    _STATE[0] = _State()
