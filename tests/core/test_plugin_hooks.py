"""Hooks are called through pluggy: tryfirst / trylast, hook wrappers, tracing and
hook-call monitoring behave as pluggy documents, while each plugin still fails alone."""

from __future__ import annotations

from collections.abc import Generator
from typing import Any

import pluggy
import torch
from fake_plugins import FakePlugins
from fake_plugins import report as _report

import opmux
from opmux.core import plugins


def _recorder(calls: list[str], name: str) -> Any:
    def register(registry: opmux.OpRegistry, platform: opmux.Platform) -> None:
        calls.append(name)

    return register


def test_tryfirst_and_trylast_order_the_calls(fake: FakePlugins,
                                              registry: opmux.OpRegistry) -> None:
    calls: list[str] = []
    fake.add("a_last", extra={"opmux_register": opmux.hookimpl(trylast=True)(
        _recorder(calls, "a_last"))})
    fake.add("b_plain", register=_recorder(calls, "b_plain"))
    fake.add("c_plain", register=_recorder(calls, "c_plain"))
    fake.add("z_first", extra={"opmux_register": opmux.hookimpl(tryfirst=True)(
        _recorder(calls, "z_first"))})
    opmux.load_plugins(registry)
    assert calls == ["z_first", "b_plain", "c_plain", "a_last"]
    assert {r.status for r in _report().values()} == {"loaded"}


def test_a_hook_wrapper_wraps_each_plugins_call(fake: FakePlugins, registry: opmux.OpRegistry,
                                                reg_op: opmux.Op) -> None:
    seen: list[str] = []

    @opmux.hookimpl(wrapper=True)
    def opmux_register(registry: opmux.OpRegistry,
                       platform: opmux.Platform) -> Generator[None, Any, Any]:
        seen.append("before")
        try:
            return (yield)
        except RuntimeError as exc:
            seen.append(f"saw {exc}")
            raise
        finally:
            seen.append("after")

    def good(registry: opmux.OpRegistry, platform: opmux.Platform) -> None:
        def plus_ten(x: torch.Tensor) -> torch.Tensor:
            return x + 10

        registry.get_op(reg_op.qualname).register_impl("good", dispatch_key="CPU")(plus_ten)

    def bad(registry: opmux.OpRegistry, platform: opmux.Platform) -> None:
        raise RuntimeError("broken vendor")

    fake.add("a_wrapper", extra={"opmux_register": opmux_register})
    fake.add("b_good", register=good)
    fake.add("c_bad", register=bad)
    opmux.load_plugins(registry)
    assert seen == ["before", "after", "before", "saw broken vendor", "after"]
    rep = _report()
    assert rep["b_good"].status == "loaded" and rep["c_bad"].status == "failed"
    assert rep["a_wrapper"].status == "loaded"  # a wrapper alone registers nothing
    assert reg_op(torch.zeros(1)).item() == 10.0


def test_pluggy_tracing_and_monitoring_see_every_hook_call(fake: FakePlugins,
                                                           registry: opmux.OpRegistry) -> None:
    fake.add("one", register=lambda registry, platform: None)
    pm: pluggy.PluginManager = plugins.plugin_state().pm
    traced: list[str] = []
    pm.trace.root.setwriter(traced.append)
    undo_trace = pm.enable_tracing()
    monitored: list[str] = []
    undo_monitor = pm.add_hookcall_monitoring(
        lambda name, impls, kwargs: monitored.append(name), lambda *args: None)
    try:
        opmux.load_plugins(registry)
    finally:
        undo_trace()
        undo_monitor()
    hooks = ("opmux_plugin_info", "opmux_register")  # the hooks the plugin implements
    for hook in hooks:
        assert hook in monitored
        assert any(hook in line for line in traced)
