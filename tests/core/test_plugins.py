"""Plugin discovery and loading: isolation of broken plugins, strict mode, allow-list."""

from __future__ import annotations

import re
import sys
from typing import Any

import pytest
import torch
from fake_plugins import FakePlugins
from fake_plugins import provider as _provider
from fake_plugins import report as _report

import opmux
from opmux.testing import reset_for_tests


def test_good_plugin_loads_and_serves(fake: FakePlugins, registry: opmux.OpRegistry,
                                      reg_op: opmux.Op) -> None:
    fake.add("good", register=_provider(reg_op, "good", 10))
    opmux.load_plugins(registry)
    rec = _report()["good"]
    assert rec.status == "loaded" and rec.providers == [f"{reg_op.qualname}:good"]
    assert reg_op(torch.zeros(1)).item() == 10.0


def test_broken_plugins_are_isolated_and_rolled_back(
        fake: FakePlugins, registry: opmux.OpRegistry, reg_op: opmux.Op) -> None:
    def half_then_raise(registry: opmux.OpRegistry, platform: opmux.Platform) -> None:
        _provider(reg_op, "half", 50)(registry, platform)
        raise RuntimeError("vendor library missing")

    fake.add("a_import", module_value="_opmux_no_such_module_xyz")
    fake.add("b_raises", register=half_then_raise)
    fake.add("d_badinfo", info={"name": "d", "platforms": "cpu"})
    fake.add("e_badschema", register=lambda registry, platform: registry.get_op(
        reg_op.qualname).register_impl("bad", dispatch_key="CPU")(lambda y: y))
    fake.add("good", register=_provider(reg_op, "good", 10))
    fake.add("z_dup", register=lambda registry, platform: (
        _provider(reg_op, "good", 30)(registry, platform)))
    opmux.load_plugins(registry)
    rep = _report()
    assert rep["good"].status == "loaded", rep["good"].reason
    assert rep["a_import"].status == "failed"
    assert "ModuleNotFoundError" in rep["a_import"].reason
    assert rep["b_raises"].status == "failed"
    assert "vendor library missing" in rep["b_raises"].reason
    assert "Traceback" in rep["b_raises"].traceback
    assert rep["z_dup"].status == "failed" and "already registered" in rep["z_dup"].reason
    assert rep["d_badinfo"].status == "failed" and "platforms" in rep["d_badinfo"].reason
    assert rep["e_badschema"].status == "failed"
    # nothing half-registered remains: "half" was rolled back; "good" is the plugin's own
    assert set(reg_op.impls) == {"native", "good"}
    assert reg_op(torch.zeros(1)).item() == 10.0


def test_strict_mode_makes_failures_fatal(fake: FakePlugins, registry: opmux.OpRegistry,
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OPMUX_STRICT_PLUGINS", "1")
    fake.add("broken", module_value="_opmux_no_such_module_xyz")
    with pytest.raises(opmux.PluginLoadError, match="plugin 'broken' failed") as info:
        opmux.load_plugins(registry)
    assert info.value.plugin == "broken"


def test_allow_list(fake: FakePlugins, registry: opmux.OpRegistry, reg_op: opmux.Op,
                    monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OPMUX_PLUGINS", "good")
    fake.add("good", register=_provider(reg_op, "good", 10))
    fake.add("other", register=_provider(reg_op, "other", 20))
    opmux.load_plugins(registry)
    rep = _report()
    assert rep["good"].status == "loaded"
    assert rep["other"].status == "skipped" and "OPMUX_PLUGINS" in rep["other"].reason
    assert "other" not in reg_op.impls


def test_platform_mismatch_is_skipped_before_register(
        fake: FakePlugins, registry: opmux.OpRegistry, reg_op: opmux.Op) -> None:
    def must_not_run(registry: opmux.OpRegistry, platform: opmux.Platform) -> None:
        raise AssertionError("a plugin for another platform must not register")

    fake.add("gpu_only", platforms=["cuda"], register=must_not_run)
    opmux.load_plugins(registry)
    rec = _report()["gpu_only"]
    assert rec.status == "skipped" and "platform mismatch" in rec.reason


def test_loading_is_idempotent(fake: FakePlugins, registry: opmux.OpRegistry,
                               reg_op: opmux.Op) -> None:
    calls: list[int] = []

    def register(registry: opmux.OpRegistry, platform: opmux.Platform) -> None:
        calls.append(1)

    fake.add("counted", register=register)
    opmux.load_plugins(registry)
    opmux.load_plugins(registry)
    assert calls == [1]


def test_plugin_default_priority_and_env_priority_compose(
        fake: FakePlugins, registry: opmux.OpRegistry, reg_op: opmux.Op,
        monkeypatch: pytest.MonkeyPatch) -> None:
    def prefer_b(op_name: str, platform: opmux.Platform) -> list[str] | None:
        # ops outside the opmux namespace are asked for by qualified name
        return ["b", "a"] if op_name == reg_op.qualname else None

    def register(registry: opmux.OpRegistry, platform: opmux.Platform) -> None:
        _provider(reg_op, "a", 10)(registry, platform)
        _provider(reg_op, "b", 20)(registry, platform)

    fake.add("ab", register=register,
             extra={"opmux_default_priority": opmux.hookimpl(prefer_b)})
    monkeypatch.setenv("OPMUX_PRIORITY", f"{reg_op.qualname}=a,native")
    opmux.load_plugins(registry)
    assert reg_op.priority() == ["a", "native"] and reg_op.priority_source() == "env"
    reg_op.priorities.set_layer("env", None)
    assert reg_op.priority_source() == "plugins" and reg_op(torch.zeros(1)).item() == 20.0
    reg_op.set_default_priority(["native"])  # code wins over everything
    assert reg_op(torch.zeros(1)).item() == 1.0


def test_a_malformed_env_priority_is_fatal(fake: FakePlugins, registry: opmux.OpRegistry,
                                           reg_op: opmux.Op,
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OPMUX_PRIORITY", reg_op.qualname)
    with pytest.raises(opmux.ConfigError, match="is not of the form"):
        opmux.load_plugins(registry)


@pytest.mark.parametrize(("value", "said"), [
    ("{op}=nope,a", r"op '{op}' has no provider\(s\) \['nope'\] .* runs the rest of the "
                    r"list, \['a', 'native'\]"),
    ("no_such_op=a;{op}=a", "names op 'no_such_op', which is not registered; its entry is "
                            "ignored"),
])
def test_an_env_priority_naming_what_is_missing_degrades(
        fake: FakePlugins, registry: opmux.OpRegistry, reg_op: opmux.Op,
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
        value: str, said: str) -> None:
    fake.add("pa", register=_provider(reg_op, "a", 10))
    monkeypatch.setenv("OPMUX_PRIORITY", value.format(op=reg_op.qualname))
    opmux.load_plugins(registry)
    err = capsys.readouterr().err
    assert re.search(said.format(op=re.escape(reg_op.qualname)), err), err
    assert len(err.splitlines()) == 1
    assert reg_op.priority() == ["a", "native"] and reg_op(torch.zeros(1)).item() == 10.0


def test_oot_platforms(fake: FakePlugins, monkeypatch: pytest.MonkeyPatch) -> None:
    def make(name: str) -> type[opmux.Platform]:
        return type(f"P_{name}", (opmux.Platform,), {
            "name": name, "device_type": "cpu", "dispatch_key": "CPU",
            "is_available": classmethod(lambda cls: True)})

    one, two = make("one_accel"), make("two_accel")
    fake.add("p1", extra={"opmux_platforms": opmux.hookimpl(lambda: [one])})
    assert opmux.current_platform().name == "one_accel"
    fake.add("p2", extra={"opmux_platforms": opmux.hookimpl(lambda: [two])})
    reset_for_tests()
    with pytest.raises(opmux.PlatformError, match=r"one_accel.*two_accel"):
        opmux.current_platform()
    monkeypatch.setenv("OPMUX_PLATFORM", "two_accel")
    reset_for_tests()
    assert opmux.current_platform().name == "two_accel"


def test_plugins_load_in_a_spawned_worker() -> None:
    import concurrent.futures
    import multiprocessing

    ctx = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(1, mp_context=ctx) as pool:
        records = pool.submit(opmux.load_plugins).result(timeout=300)
    status = {r.name: r.status for r in records}
    assert status.get("cpu") == "loaded"
    assert status.get("example_vendor") == "loaded"


def test_real_example_package_end_to_end_in_a_fresh_process(tmp_path: Any) -> None:
    import json
    import os
    import subprocess

    code = (
        "import json, torch, opmux\n"
        "opmux.load_plugins()\n"
        "op = opmux.get_op('silu_and_mul')\n"
        "x = torch.randn(4, 64)\n"
        "rep = {r.name: r.status for r in opmux.plugin_report()}\n"
        "ref = op.impls['native'](x)\n"
        "out = op.impls['example_vendor'](x)\n"
        "print(json.dumps({'platform': opmux.current_platform().name, 'report': rep,\n"
        "  'chosen': op.dispatch(x).provider, 'explain': op.explain(x),\n"
        "  'err': (out - ref).abs().max().item()}))\n"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("OPMUX_")}
    base = json.loads(subprocess.run([sys.executable, "-c", code], env=env, check=True,
                                     capture_output=True, text=True).stdout)
    assert base["report"]["example_vendor"] == "loaded"
    assert base["platform"] == "cpu"
    assert base["err"] < 1e-5
    assert "example_vendor" in base["explain"]
    env["OPMUX_EXAMPLE_PLATFORM"] = "1"
    accel = json.loads(subprocess.run([sys.executable, "-c", code], env=env, check=True,
                                      capture_output=True, text=True).stdout)
    assert accel["platform"] == "example_accel"
    assert accel["chosen"] == "example_vendor"


_HEAVY_PROBE = (
    "import json, sys, opmux\n"
    "opmux.load_plugins()\n"
    "op = opmux.get_op('advance_step_flashattn')\n"
    "print(json.dumps({'platform': opmux.current_platform().name,\n"
    "  'heavy': sorted(m for m in ('triton', 'torch_xla', 'mindspore') if m in sys.modules),\n"
    "  'providers': sorted(op.supported_providers())}))\n"
)


def _probe_heavy() -> dict[str, Any]:
    import json
    import os
    import subprocess

    env = {k: v for k, v in os.environ.items() if not k.startswith(("OPMUX_", "PJRT_"))}
    out = subprocess.run([sys.executable, "-c", _HEAVY_PROBE], env=env, check=True,
                         capture_output=True, text=True).stdout
    return dict(json.loads(out))


@pytest.mark.triton
def test_triton_is_not_imported_on_a_cpu_platform() -> None:
    data = _probe_heavy()
    assert data["platform"] == "cpu" and "triton" not in data["heavy"]


@pytest.mark.mindspore
def test_mindspore_is_not_imported_on_a_cpu_platform_until_used() -> None:
    data = _probe_heavy()
    assert data["platform"] == "cpu" and "mindspore" not in data["heavy"]
    assert "mindspore" in data["providers"]  # registered lazily, built on first call
