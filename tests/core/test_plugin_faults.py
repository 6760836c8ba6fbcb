"""Fault injection: a plugin failing in each hook, and fatal configuration.

Every hook is isolated alike: the failing plugin is recorded as ``failed`` with the hook
and its traceback, whatever it registered is rolled back, the other plugins load and
their priorities apply. Fatal errors stay fatal on every call until fixed.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from typing import Any

import pytest
import torch
from fake_plugins import FakePlugins, provider, report

import opmux


def _raise(exc: BaseException) -> Callable[..., Any]:
    def hook(*args: Any, **kwargs: Any) -> Any:
        raise exc

    return hook


def _good(fake: FakePlugins, op: opmux.Op) -> None:
    """A healthy plugin: providers ``other`` then ``good``, default priority good first."""
    def register(registry: opmux.OpRegistry, platform: opmux.Platform) -> None:
        provider(op, "other", 30)(registry, platform)
        provider(op, "good", 10)(registry, platform)

    def priority(op_name: str, platform: opmux.Platform) -> list[str] | None:
        return ["good", "other", "native"] if op_name == op.qualname else None

    fake.add("good", register=register,
             extra={"opmux_default_priority": opmux.hookimpl(priority)})


_bad_names = itertools.count()


def _bad_register(op: opmux.Op) -> Callable[..., None]:
    return provider(op, f"bad{next(_bad_names)}", 50)


# hook → (plugin kwargs for FakePlugins.add given the op, text the reason must contain)
FAULTS: dict[str, Callable[[opmux.Op], tuple[dict[str, Any], str]]] = {
    "import": lambda op: ({"module_value": "_opmux_no_such_module_xyz"}, "ModuleNotFoundError"),
    "plugin_info_raises": lambda op: (
        {"extra": {"opmux_plugin_info": opmux.hookimpl(_raise(RuntimeError("info boom")))}},
        "opmux_plugin_info: RuntimeError: info boom"),
    "plugin_info_garbage": lambda op: ({"info": ["cpu"]}, "must return"),
    "platforms_raises": lambda op: (
        {"extra": {"opmux_platforms": opmux.hookimpl(_raise(ImportError("no sdk")))}},
        "opmux_platforms: ImportError: no sdk"),
    "platforms_garbage": lambda op: (
        {"extra": {"opmux_platforms": opmux.hookimpl(lambda: ["not a class"])}},
        "list of Platform classes"),
    "register_raises_halfway": lambda op: (
        {"register": lambda registry, platform: (
            _bad_register(op)(registry, platform), _raise(OSError("vendor lib missing"))())},
        "opmux_register raised OSError: vendor lib missing"),
    "default_priority_raises": lambda op: (
        {"register": _bad_register(op),
         "extra": {"opmux_default_priority": opmux.hookimpl(_raise(KeyError("rms_norm")))}},
        "opmux_default_priority raised KeyError"),
    "default_priority_garbage": lambda op: (
        {"register": _bad_register(op),
         "extra": {"opmux_default_priority": opmux.hookimpl(
             lambda op_name, platform: "bad")}},
        "must return a list of provider names"),
    "hookimpl_with_unknown_argument": lambda op: (
        {"extra": {"opmux_register": opmux.hookimpl(lambda registry, platform, nope: None)}},
        "nope"),
}


@pytest.mark.parametrize("fault", sorted(FAULTS))
def test_a_plugin_failing_in_any_hook_is_recorded_and_rolled_back(
        fake: FakePlugins, registry: opmux.OpRegistry, reg_op: opmux.Op, fault: str) -> None:
    # the broken plugin sorts before and after the good one: order must not matter
    kwargs, reason = FAULTS[fault](reg_op)
    fake.add("aaa_broken", **kwargs)
    _good(fake, reg_op)
    fake.add("zzz_broken", **FAULTS[fault](reg_op)[0])
    opmux.load_plugins(registry)
    rep = report()
    for name in ("aaa_broken", "zzz_broken"):
        assert rep[name].status == "failed", (fault, rep[name])
        assert reason in rep[name].reason
        assert "Traceback" in rep[name].traceback
        assert rep[name].providers == []
    assert rep["good"].status == "loaded"
    assert set(reg_op.impls) == {"native", "other", "good"}  # "bad…" rolled back
    assert reg_op.priority() == ["good", "other", "native"]
    assert reg_op.priority_source() == "plugins"
    assert reg_op(torch.zeros(1)).item() == 10.0


@pytest.mark.parametrize("fault", ["import", "default_priority_raises", "platforms_raises"])
def test_strict_mode_is_fatal_on_every_call_until_unset(
        fake: FakePlugins, monkeypatch: pytest.MonkeyPatch, fault: str) -> None:
    silu = opmux.get_op("silu_and_mul")
    kwargs, _ = FAULTS[fault](silu)
    fake.add("broken", **kwargs)
    monkeypatch.setenv("OPMUX_STRICT_PLUGINS", "1")
    x = torch.randn(2, 8)
    for _ in range(3):  # not once: every call, through every entry point
        with pytest.raises(opmux.PluginLoadError, match="plugin 'broken' failed") as info:
            silu(x)
        assert info.value.plugin == "broken"
        with pytest.raises(opmux.PluginLoadError):
            opmux.load_plugins()
    assert report()["broken"].status == "failed"
    monkeypatch.setenv("OPMUX_STRICT_PLUGINS", "0")
    assert {r.name: r.status for r in opmux.load_plugins()} == {"broken": "failed"}
    torch.testing.assert_close(silu(x), silu.native(x))
    assert not any(p.startswith("bad") for p in silu.impls)


def _rms_plus_100(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return opmux.get_op("rms_norm").native(x, weight, eps) + 100


def _claiming(name: str) -> type[opmux.Platform]:
    return type(f"P_{name}", (opmux.Platform,), {
        "name": name, "device_type": "cpu", "dispatch_key": "CPU",
        "is_available": classmethod(lambda cls: True)})


@pytest.mark.parametrize(("setup", "error", "message"), [
    (lambda fake, mp: mp.setenv("OPMUX_PLATFORM", "nonsense"), opmux.PlatformError,
     "OPMUX_PLATFORM='nonsense' names no known platform"),
    (lambda fake, mp: mp.setenv("OPMUX_PRIORITY", "rms_norm"), opmux.ConfigError,
     "is not of the form"),
    (lambda fake, mp: mp.setenv("OPMUX_PLUGINS", "cpu;cuda"), opmux.ConfigError,
     "bad plugin name"),
    (lambda fake, mp: mp.setenv("OPMUX_PLUGINS", ",,,"), opmux.ConfigError, "names no plugin"),
    (lambda fake, mp: mp.setenv("OPMUX_STRICT_PLUGINS", "2"), opmux.ConfigError,
     "OPMUX_STRICT_PLUGINS='2' is not a boolean"),
    (lambda fake, mp: (
        fake.add("p1", extra={"opmux_platforms": opmux.hookimpl(lambda: [_claiming("one")])}),
        fake.add("p2", extra={"opmux_platforms": opmux.hookimpl(lambda: [_claiming("two")])})),
     opmux.PlatformError, "several out-of-tree platforms claim"),
], ids=["platform", "priority_form", "plugins_semicolon",
        "plugins_empty", "strict_2", "two_platforms"])
def test_fatal_configuration_stays_fatal_until_fixed(
        fake: FakePlugins, monkeypatch: pytest.MonkeyPatch, setup: Callable[..., Any],
        error: type[Exception], message: str) -> None:
    rms = opmux.get_op("rms_norm")
    x, w = torch.randn(2, 8), torch.ones(8)
    fake.add("good", register=lambda registry, platform: registry.get_op(
        "rms_norm").register_impl("good", dispatch_key="CPU")(_rms_plus_100))
    setup(fake, monkeypatch)
    for _ in range(3):
        with pytest.raises(error, match=message):
            rms(x, w)  # never silently native: the same error on every call
        with pytest.raises(error, match=message):
            opmux.load_plugins()
    for var in ("OPMUX_PLATFORM", "OPMUX_PRIORITY", "OPMUX_PLUGINS", "OPMUX_STRICT_PLUGINS"):
        monkeypatch.delenv(var, raising=False)
    if "p1" in {ep.name for ep in fake.eps}:
        monkeypatch.setenv("OPMUX_PLATFORM", "one")  # the documented fix: choose one
    opmux.load_plugins()  # fixed: start-up completes, the plugin serves
    torch.testing.assert_close(rms(x, w), rms.native(x, w) + 100)


def test_unknown_plugin_names_in_the_allow_list_are_reported(
        fake: FakePlugins, monkeypatch: pytest.MonkeyPatch) -> None:
    fake.add("good")
    monkeypatch.setenv("OPMUX_PLUGINS", "good,no_such_plugin")
    with pytest.warns(RuntimeWarning, match=r"\['no_such_plugin'\] that are not installed"):
        records = {r.name: r for r in opmux.load_plugins()}
    assert records["good"].status == "loaded"
    assert records["no_such_plugin"].status == "missing"
    assert "OPMUX_PLUGINS" in records["no_such_plugin"].reason


def test_a_rolled_back_plugin_op_leaves_the_registry(
        fake: FakePlugins, registry: opmux.OpRegistry, ns: str) -> None:
    def define_then_fail(registry: opmux.OpRegistry, platform: opmux.Platform) -> None:
        @opmux.register_op(namespace=ns, registry=registry)
        def vendor_only(x: torch.Tensor) -> torch.Tensor:
            return x * 3

        raise RuntimeError("late failure")

    fake.add("definer", register=define_then_fail)
    opmux.load_plugins(registry)
    assert report()["definer"].status == "failed"
    with pytest.raises(opmux.UnknownOpError):
        registry.get_op(f"{ns}::vendor_only")
    # documented: torch cannot undefine one op of a library; it stays, native only
    assert getattr(torch.ops, ns).vendor_only(torch.ones(1)).item() == 3.0

