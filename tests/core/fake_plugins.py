"""Plugin modules built in ``sys.modules`` and served as entry points (no installation)."""

from __future__ import annotations

import importlib.metadata
import sys
import types
from collections.abc import Callable
from typing import Any

import pytest
import torch

import opmux
from opmux.core import plugins


class FakePlugins:
    """Builds plugin modules in ``sys.modules`` and serves them as entry points."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.eps: list[importlib.metadata.EntryPoint] = []
        self.monkeypatch = monkeypatch
        real = importlib.metadata.entry_points

        def entry_points(**selection: Any) -> Any:
            """Only these plugins in opmux's group; every other group as installed."""
            if selection.get("group") == plugins.PLUGIN_GROUP:
                return importlib.metadata.EntryPoints(self.eps)
            return real(**selection)

        monkeypatch.setattr(importlib.metadata, "entry_points", entry_points)

    def add(self, name: str, *, platforms: list[str] | None = None,
            register: Callable[..., None] | None = None, info: Any = None,
            module_value: str | None = None, extra: dict[str, Any] | None = None) -> None:
        modname = f"_opmux_test_plugin_{name}"
        if module_value is None:
            mod = types.ModuleType(modname)

            @opmux.hookimpl
            def opmux_plugin_info() -> Any:
                return info if info is not None else {"name": name,
                                                      "platforms": platforms or ["*"]}

            mod.opmux_plugin_info = opmux_plugin_info  # type: ignore[attr-defined]
            if register is not None:
                mod.opmux_register = opmux.hookimpl(register)  # type: ignore[attr-defined]
            for key, value in (extra or {}).items():
                setattr(mod, key, value)
            self.monkeypatch.setitem(sys.modules, modname, mod)
        self.eps.append(importlib.metadata.EntryPoint(
            name, module_value or modname, plugins.PLUGIN_GROUP))


def provider(op: opmux.Op, name: str, delta: float) -> Callable[..., None]:
    """An ``opmux_register`` adding provider ``name`` (returns ``x + delta``) to ``op``."""
    def register(registry: opmux.OpRegistry, platform: opmux.Platform) -> None:
        def impl(x: torch.Tensor) -> torch.Tensor:
            return x + delta

        registry.get_op(op.qualname).register_impl(name, dispatch_key="CPU")(impl)

    return register


def report() -> dict[str, opmux.PluginRecord]:
    return {r.name: r for r in opmux.plugin_report()}
