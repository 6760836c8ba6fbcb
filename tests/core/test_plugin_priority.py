"""The plugin priority merge rule: independent of plugin names and install order.

A plugin naming the current platform in ``opmux_plugin_info`` is *specific*; one serving
it through ``"*"`` is *generic*. Specific answers go first; generic ones add what is not
listed yet; disagreeing answers of one tier are a recorded conflict and that tier gives
no opinion.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from fake_plugins import FakePlugins, provider, report

import opmux


def _plugin(fake: FakePlugins, name: str, op: opmux.Op, *, platforms: list[str],
            provides: dict[str, float], prefers: list[str]) -> None:
    def register(registry: opmux.OpRegistry, platform: opmux.Platform) -> None:
        for provider_name, delta in provides.items():
            provider(op, provider_name, delta)(registry, platform)

    def priority(op_name: str, platform: opmux.Platform) -> list[str] | None:
        return [*prefers, "native"] if op_name == op.qualname else None

    fake.add(name, platforms=platforms, register=register,
             extra={"opmux_default_priority": opmux.hookimpl(priority)})


def _generic_and_vendor(vendor: str, generic: str) -> Callable[[FakePlugins, opmux.Op], None]:
    def setup(fake: FakePlugins, op: opmux.Op) -> None:
        _plugin(fake, generic, op, platforms=["*"], provides={"cpp": 10}, prefers=["cpp"])
        _plugin(fake, vendor, op, platforms=["cpu"], provides={"vendor": 20},
                prefers=["vendor"])

    return setup


@pytest.mark.parametrize(("vendor", "generic"), [
    ("aaa_vendor", "zzz_generic"), ("zzz_vendor", "aaa_generic"), ("example_vendor", "cpu"),
])
@pytest.mark.parametrize("reverse_install_order", [False, True])
def test_a_platform_specific_plugin_beats_a_generic_one(
        fake: FakePlugins, registry: opmux.OpRegistry, reg_op: opmux.Op, vendor: str,
        generic: str, reverse_install_order: bool) -> None:
    _generic_and_vendor(vendor, generic)(fake, reg_op)
    if reverse_install_order:
        fake.eps.reverse()
    opmux.load_plugins(registry)
    assert reg_op.priority() == ["vendor", "cpp", "native"]
    assert reg_op.priority_source() == "plugins"
    assert reg_op(torch.zeros(1)).item() == 20.0
    assert all(not r.conflicts for r in report().values())


@pytest.mark.parametrize("names", [("aaa_vendor", "zzz_vendor"), ("zzz_vendor", "aaa_vendor")])
@pytest.mark.parametrize("reverse_install_order", [False, True])
def test_equal_specificity_disagreement_is_a_recorded_conflict(
        fake: FakePlugins, registry: opmux.OpRegistry, reg_op: opmux.Op,
        names: tuple[str, str], reverse_install_order: bool) -> None:
    first, second = names
    _plugin(fake, first, reg_op, platforms=["cpu"], provides={"one": 10}, prefers=["one"])
    _plugin(fake, second, reg_op, platforms=["cpu"], provides={"two": 20}, prefers=["two"])
    _plugin(fake, "generic", reg_op, platforms=["*"], provides={"three": 30},
            prefers=["three"])
    if reverse_install_order:
        fake.eps.reverse()
    opmux.load_plugins(registry)
    # neither specific plugin wins; the generic tier still speaks
    assert reg_op.priority() == ["three", "native"]
    assert reg_op(torch.zeros(1)).item() == 30.0
    rep = report()
    for name in names:
        assert len(rep[name].conflicts) == 1
        assert "platform-specific plugins disagree" in rep[name].conflicts[0]
        assert "aaa_vendor: ['one']" in rep[name].conflicts[0] or \
            "aaa_vendor: ['two']" in rep[name].conflicts[0]
    assert rep["generic"].conflicts == []


def test_agreeing_plugins_and_unknown_providers(
        fake: FakePlugins, registry: opmux.OpRegistry, reg_op: opmux.Op) -> None:
    _plugin(fake, "a", reg_op, platforms=["cpu"], provides={"one": 10},
            prefers=["two", "one", "absent"])
    _plugin(fake, "b", reg_op, platforms=["cpu", "cuda"], provides={"two": 20},
            prefers=["two", "one"])
    opmux.load_plugins(registry)
    # "absent" is not a provider of the op: dropped before comparing, so they agree
    assert reg_op.priority() == ["two", "one", "native"]
    assert all(not r.conflicts for r in report().values())


@pytest.mark.parametrize("vendor", ["aaa_vendor", "zzz_vendor"])
@pytest.mark.parametrize("reverse_install_order", [False, True])
def test_two_generic_plugins_that_disagree_never_let_a_name_decide(
        fake: FakePlugins, registry: opmux.OpRegistry, reg_op: opmux.Op, vendor: str,
        reverse_install_order: bool) -> None:
    # the cpu plugin serves "*" (CPU tensors exist everywhere): a "*" vendor that prefers
    # itself ties with it, whatever either is called
    _plugin(fake, "cpu", reg_op, platforms=["*"], provides={"cpp": 10}, prefers=["cpp"])
    _plugin(fake, vendor, reg_op, platforms=["*"], provides={"vendor": 20},
            prefers=["vendor"])
    if reverse_install_order:
        fake.eps.reverse()
    opmux.load_plugins(registry)
    assert reg_op.priority() == ["native", "cpp", "vendor"]  # after native: never run
    assert reg_op.priority_source() == "plugins"
    assert reg_op(torch.zeros(1)).item() == 1.0  # native (x + 1): neither plugin's mark
    rep = report()
    assert "generic plugins disagree" in rep["cpu"].conflicts[0]
    assert "generic plugins disagree" in rep[vendor].conflicts[0]
