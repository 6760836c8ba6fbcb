"""Start-up in one module, one reset, one configuration module."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from fake_plugins import FakePlugins

import opmux
from opmux.core import config, runners, state, switches
from opmux.core.errors import ConfigError
from opmux.testing import reset_for_tests

_ROOT = Path(opmux.__file__).parent


def test_ops_get_the_platform_key_from_their_registry(ns: str) -> None:
    reg = opmux.OpRegistry(platform_key=lambda: "XLA")
    try:
        @opmux.register_op(namespace=ns, registry=reg)
        def ident(x: torch.Tensor) -> torch.Tensor:
            return x

        @ident.register_impl("p")
        def _p(x: torch.Tensor) -> torch.Tensor:
            return x + 1

        assert ident.impls["p"].dispatch_key == "XLA"
    finally:
        reg.destroy()


def test_reset_for_tests_resets_every_piece_of_global_state(fake: FakePlugins) -> None:
    silu = opmux.get_op("silu_and_mul")
    fake.add("good", register=lambda registry, platform: registry.get_op(
        "silu_and_mul").register_impl("good", dispatch_key="CPU")(_silu_plus))
    opmux.load_plugins()
    assert "good" in silu.impls
    silu.set_default_priority(["native"])
    scope = silu.set_priority(["good"])
    scope.__enter__()
    rid = opmux.register_runner(object())
    switches.set_output_checks(True)
    wrap = opmux.enable_torch_wrap(False)
    wrap.__enter__()
    assert opmux.current_platform().name == "cpu"

    reset_for_tests()

    assert opmux.torch_wrap_enabled() and not switches.output_checks_enabled()
    assert not silu.has_provider("good")  # rolled back (.impls would start up again)
    assert silu.priority_source() == "registration order"
    assert opmux.plugin_report() == []
    with pytest.raises(opmux.UnknownRunnerError):
        runners.get_runner(rid)
    assert not opmux.global_registry().loaded_flag[0]
    opmux.load_plugins()  # start-up runs again, from scratch
    assert "good" in silu.impls and {r.name for r in opmux.plugin_report()} == {"good"}


def _silu_plus(x: torch.Tensor) -> torch.Tensor:
    return opmux.get_op("silu_and_mul").native(x) + 1


def test_reset_for_tests_builds_a_fresh_runtime_object_around_the_same_registry() -> None:
    opmux.current_platform()
    old = state.runtime()
    reset_for_tests()
    new = state.runtime()
    assert new is not old and new.registry is old.registry
    assert new.platform is None and new.plugins is not old.plugins


@pytest.mark.parametrize(("value", "expected"), [
    (None, False), ("", False), ("0", False), ("false", False), ("No", False),
    ("1", True), ("TRUE", True), (" yes ", True), ("on", True),
])
def test_boolean_variables(monkeypatch: pytest.MonkeyPatch, value: str | None,
                           expected: bool) -> None:
    for var, accessor in (("OPMUX_STRICT_PLUGINS", config.strict_plugins),
                          ("OPMUX_CHECK_OUTPUTS", config.check_outputs)):
        if value is None:
            monkeypatch.delenv(var, raising=False)
        else:
            monkeypatch.setenv(var, value)
        assert accessor() is expected


@pytest.mark.parametrize("value", ["2", "enabled", "-1"])
def test_a_malformed_boolean_is_an_error(monkeypatch: pytest.MonkeyPatch, value: str) -> None:
    monkeypatch.setenv("OPMUX_STRICT_PLUGINS", value)
    with pytest.raises(ConfigError, match=f"OPMUX_STRICT_PLUGINS={value!r} is not a boolean"):
        config.strict_plugins()


def test_path_and_string_variables(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv("OPMUX_CACHE_DIR", raising=False)
    assert config.cache_dir() == Path.home() / ".cache" / "opmux"
    monkeypatch.setenv("OPMUX_CACHE_DIR", "~/somewhere")
    assert config.cache_dir() == Path.home() / "somewhere"
    monkeypatch.delenv("OPMUX_ASCEND_SOC_VERSION", raising=False)
    assert config.ascend_soc_version() == "Ascend910B1"
    monkeypatch.setenv("OPMUX_ASCEND_SOC_VERSION", "Ascend310P3")
    assert config.ascend_soc_version() == "Ascend310P3"
    monkeypatch.setenv("ASCEND_HOME_PATH", str(tmp_path))
    assert config.cann_home() == tmp_path
    monkeypatch.setenv("OPMUX_PLATFORM", " cuda ")
    assert config.platform_override() == "cuda"
    monkeypatch.setenv("OPMUX_PRIORITY", "rms_norm=cpp,native")
    assert config.priority_overrides() == {"rms_norm": ["cpp", "native"]}
    monkeypatch.setenv("OPMUX_PLUGINS", " cpu , cuda ")
    assert config.plugin_allow_list() == frozenset({"cpu", "cuda"})


def test_every_opmux_variable_in_the_tree_has_an_accessor() -> None:
    import re

    repo = _ROOT.parent
    used: set[str] = set()
    for path in [*repo.joinpath("opmux").rglob("*.py"), repo / "README.md"]:
        used.update(re.findall(r"\bOPMUX_[A-Z_]+[A-Z]\b", path.read_text()))
    # compile-time macros of the C++ sources, and the example plugin's own switch
    used -= {"OPMUX_WITH_ASCENDC", "OPMUX_MS_EXTENSION_MODULE", "OPMUX_EXAMPLE_PLATFORM"}
    documented = set(re.findall(r"``(OPMUX_[A-Z_]+)``", config.__doc__ or ""))
    assert used <= documented, sorted(used - documented)
