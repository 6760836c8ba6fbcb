"""Rules a vendor relies on: who wins a provider name, who is blamed for a failure, how a
failure is seen, and how a plugin's own ops are found."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Generator
from typing import Any

import pytest
import torch
from fake_plugins import FakePlugins
from fake_plugins import provider as _provider
from fake_plugins import report as _report

import opmux
from opmux.testing import reset_for_tests


def _accel(name: str) -> type[opmux.Platform]:
    return type(f"P_{name}", (opmux.Platform,), {
        "name": name, "device_type": "cpu", "dispatch_key": "CPU",
        "is_available": classmethod(lambda cls: True)})


def test_the_platforms_own_plugin_keeps_a_provider_name_a_generic_plugin_also_takes(
        fake: FakePlugins, registry: opmux.OpRegistry, reg_op: opmux.Op,
        capsys: pytest.CaptureFixture[str]) -> None:
    acme = _accel("acme_rules")
    # "aaa" sorts first: the rule must not be the alphabet
    fake.add("aaa", register=_provider(reg_op, "acme", 666))
    fake.add("zzz_acme", platforms=["acme_rules"], register=_provider(reg_op, "acme", 10),
             extra={"opmux_platforms": opmux.hookimpl(lambda: [acme])})
    opmux.load_plugins(registry)
    rep = _report()
    assert rep["zzz_acme"].status == "loaded"
    assert rep["aaa"].status == "failed"
    assert ("provider 'acme' is already registered by plugin 'zzz_acme'; plugin 'aaa' cannot "
            "register it too") in rep["aaa"].reason
    assert reg_op(torch.zeros(1)).item() == 10.0
    assert capsys.readouterr().err.startswith("opmux: plugin 'aaa' failed")


def test_disagreeing_generic_plugins_never_put_a_built_in_provider_behind_native(
        fake: FakePlugins, registry: opmux.OpRegistry, reg_op: opmux.Op) -> None:
    def answer(providers: list[str]) -> Any:
        return opmux.hookimpl(lambda op_name, platform: providers)

    fake.add("one", register=_provider(reg_op, "one", 1), extra={
        "opmux_default_priority": answer(["one", "native"])})
    fake.add("two", register=_provider(reg_op, "two", 2), extra={
        "opmux_default_priority": answer(["two", "native"])})
    # a built-in generic plugin (its entry module lives in opmux.plugins)
    fake.add("builtin", register=_provider(reg_op, "fast", 3), extra={
        "opmux_default_priority": answer(["fast", "native"])})
    fake.eps[-1] = fake.eps[-1].__class__("builtin", "opmux.plugins.fake_builtin",
                                          fake.eps[-1].group)
    sys.modules["opmux.plugins.fake_builtin"] = sys.modules["_opmux_test_plugin_builtin"]
    try:
        opmux.load_plugins(registry)
    finally:
        del sys.modules["opmux.plugins.fake_builtin"]
    assert reg_op.priority()[0] == "fast"
    assert reg_op(torch.zeros(1)).item() == 3.0
    rep = _report()
    assert rep["one"].conflicts and rep["two"].conflicts and not rep["builtin"].conflicts


def _raising_wrapper() -> Any:
    @opmux.hookimpl(wrapper=True)
    def opmux_register(registry: Any, platform: Any) -> Generator[None, None, None]:
        yield
        raise RuntimeError("wrapper bug")

    return opmux_register


def test_a_failing_hook_wrapper_is_blamed_on_its_own_plugin(
        fake: FakePlugins, registry: opmux.OpRegistry, reg_op: opmux.Op,
        capsys: pytest.CaptureFixture[str]) -> None:
    fake.add("a_good", register=_provider(reg_op, "good", 10))
    fake.add("b_wrapper", extra={"opmux_register": _raising_wrapper()})
    fake.add("c_good", register=_provider(reg_op, "other", 20))
    opmux.load_plugins(registry)
    rep = _report()
    assert rep["b_wrapper"].status == "failed"
    assert "hook wrapper raised RuntimeError: wrapper bug" in rep["b_wrapper"].reason
    assert rep["a_good"].status == rep["c_good"].status == "loaded"
    assert set(reg_op.impls) == {"native", "good", "other"}
    err = capsys.readouterr().err.splitlines()
    assert err == [line for line in err if "'b_wrapper' failed" in line] and len(err) == 1


def test_a_plugin_whose_own_hook_raises_through_a_wrapper_is_still_the_culprit(
        fake: FakePlugins, registry: opmux.OpRegistry, reg_op: opmux.Op) -> None:
    @opmux.hookimpl(wrapper=True)
    def opmux_register(registry: Any, platform: Any) -> Generator[None, None, None]:
        yield  # passes the exception on

    def broken(registry: Any, platform: Any) -> None:
        raise ValueError("vendor bug")

    fake.add("a_broken", register=broken)
    fake.add("b_wrapper", extra={"opmux_register": opmux_register})
    opmux.load_plugins(registry)
    rep = _report()
    assert rep["a_broken"].status == "failed" and "vendor bug" in rep["a_broken"].reason
    assert rep["b_wrapper"].status == "loaded"


@pytest.mark.parametrize("stage", ["import", "register", "info"])
def test_each_failed_plugin_says_so_once_on_stderr(
        fake: FakePlugins, registry: opmux.OpRegistry, reg_op: opmux.Op, stage: str,
        capsys: pytest.CaptureFixture[str]) -> None:
    def broken(registry: Any, platform: Any) -> None:
        raise RuntimeError("no device")

    if stage == "import":
        fake.add("vendor", module_value="_opmux_no_such_vendor_module")
    elif stage == "register":
        fake.add("vendor", register=broken)
    else:
        fake.add("vendor", info={"name": "vendor"})
    opmux.load_plugins(registry)
    reg_op(torch.zeros(1))
    opmux.load_plugins()
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1, err
    assert err[0].startswith("opmux: plugin 'vendor' failed and was skipped: ")
    assert "opmux info" in err[0]


def test_strict_mode_covers_detection_errors(fake: FakePlugins,
                                             monkeypatch: pytest.MonkeyPatch,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    def explode(cls: type) -> bool:
        raise OSError("driver not answering")

    bad = type("P_boom", (opmux.Platform,), {"name": "boom", "device_type": "cpu",
                                              "is_available": classmethod(explode)})
    fake.add("p", extra={"opmux_platforms": opmux.hookimpl(lambda: [bad])})
    assert opmux.current_platform().name == "cpu"
    assert "is_available() raised OSError: driver not answering" in capsys.readouterr().err
    reset_for_tests()
    monkeypatch.setenv("OPMUX_STRICT_PLUGINS", "1")
    with pytest.raises(opmux.PlatformError, match=r"platform detection failed: .*'boom'.*"
                                                  r"driver not answering .*strict mode"):
        opmux.load_plugins()


def test_a_plugin_defined_op_is_found_before_anything_loaded(
        fake: FakePlugins, ns: str) -> None:
    def define(registry: Any, platform: Any) -> None:
        @opmux.register_op(namespace=ns, registry=registry)
        def softcap(x: torch.Tensor, cap: float = 30.0) -> torch.Tensor:
            return cap * torch.tanh(x / cap)

    fake.add("acme", register=define)
    op = opmux.get_op(f"{ns}::softcap")  # start-up runs: the plugin defines it
    assert op.qualname == f"{ns}::softcap"
    with pytest.raises(opmux.UnknownOpError, match=r"no op named .*once that plugin has "
                                                   r"loaded: `opmux info`"):
        opmux.get_op(f"{ns}::nothing")


def test_opmux_explain_finds_a_plugin_op(tmp_path: Any) -> None:
    """The CLI in a fresh process: the example vendor plugin's own op."""
    pytest.importorskip("opmux_example_vendor")
    out = subprocess.run(
        [sys.executable, "-m", "opmux.cli", "explain", "example_vendor::softcap",
         "--shape", "4,16"], capture_output=True, text=True, timeout=300,
        env={**__import__("os").environ, "OPMUX_EXAMPLE_PLATFORM": "1"})
    assert out.returncode == 0, out.stderr
    assert "example_vendor::softcap" in out.stdout and "example_vendor" in out.stdout


def test_a_plugin_declaring_an_unregistered_kv_format_fails_at_load(
        fake: FakePlugins, registry: opmux.OpRegistry, reg_op: opmux.Op) -> None:
    def declare(registry: Any, platform: Any) -> None:
        _provider(reg_op, "tiles", 5)(registry, platform)
        opmux.declare_kv_cache_formats("tiles", ["acme_tiles"])

    fake.add("acme", register=declare)
    opmux.load_plugins(registry)
    rec = _report()["acme"]
    assert rec.status == "failed" and "format(s) ['acme_tiles'] are not registered" in rec.reason
    assert "tiles" not in reg_op.impls


def test_a_declaration_answering_an_unregistered_format_names_its_provider(
        fresh_plugins: None) -> None:
    from opmux.ops.kv_formats import kv_cache_formats_of

    opmux.declare_kv_cache_formats("acme_chooser", lambda spec: ("acme_nz",))
    spec = opmux.KVCacheSpec(torch.device("cpu"), torch.float32, 64, 2, 16)
    with pytest.raises(opmux.ConfigError, match="provider 'acme_chooser' declares KV-cache "
                                                r"format\(s\) \['acme_nz'\]"):
        kv_cache_formats_of("acme_chooser", spec)
