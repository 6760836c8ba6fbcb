"""CustomOp layers: per-platform forward, enablement strings, out-of-tree replacement."""

from __future__ import annotations

import pytest
import torch

import opmux
from opmux.core import config


@pytest.fixture(autouse=True)
def _fresh(fresh_custom_ops: None, fresh_plugins: None) -> None:
    pass


def _layer_classes(tag: str) -> type[opmux.CustomOp]:
    @opmux.CustomOp.register(f"mark_{tag}")
    class Mark(opmux.CustomOp):
        def forward_native(self, x: torch.Tensor) -> torch.Tensor:
            return x + 1

        def forward_cpu(self, x: torch.Tensor) -> torch.Tensor:
            return x + 10

        def forward_cuda(self, x: torch.Tensor) -> torch.Tensor:
            return x + 20

    return Mark


def test_platform_method_is_chosen_once(monkeypatch: pytest.MonkeyPatch) -> None:
    mark = _layer_classes("a")
    assert mark()(torch.zeros(1)).item() == 10.0  # cpu platform
    monkeypatch.setenv("OPMUX_PLATFORM", "rocm")
    from opmux import platforms

    platforms._reset_for_tests()
    assert mark()(torch.zeros(1)).item() == 20.0  # hip → cuda
    monkeypatch.setenv("OPMUX_PLATFORM", "xla")
    platforms._reset_for_tests()
    assert mark()(torch.zeros(1)).item() == 1.0  # not overridden → native


def test_enablement_strings(monkeypatch: pytest.MonkeyPatch) -> None:
    mark = _layer_classes("b")
    opmux.set_custom_ops("all,-mark_b")
    assert mark()(torch.zeros(1)).item() == 1.0
    opmux.set_custom_ops("none,+mark_b")
    assert mark()(torch.zeros(1)).item() == 10.0
    opmux.set_custom_ops("none")
    assert mark()(torch.zeros(1)).item() == 1.0
    opmux.set_custom_ops(None)
    monkeypatch.setenv("OPMUX_CUSTOM_OPS", "none")
    assert mark()(torch.zeros(1)).item() == 1.0
    counts = opmux.custom_op_counts()
    assert counts["enabled"]["mark_b"] == 1 and counts["disabled"]["mark_b"] == 3


@pytest.mark.parametrize(("spec", "message"), [
    ("all,none", "exactly one"),
    ("all,all", "exactly one"),
    ("all,rms_norm", "element 'rms_norm'"),
    ("+Bad", "element '\\+Bad'"),
])
def test_bad_enablement_strings(spec: str, message: str) -> None:
    with pytest.raises(opmux.ConfigError, match=message):
        opmux.set_custom_ops(spec)


def test_register_oot_replaces_the_in_tree_class() -> None:
    mark = _layer_classes("c")

    @opmux.CustomOp.register_oot(name="mark_c")
    class Vendor(mark):  # type: ignore[misc, valid-type]
        def forward_cpu(self, x: torch.Tensor) -> torch.Tensor:
            return x + 100

    layer = mark()
    assert type(layer) is Vendor
    assert layer(torch.zeros(1)).item() == 100.0


def test_duplicate_in_tree_name() -> None:
    _layer_classes("d")
    with pytest.raises(opmux.RegistrationError, match="already registered"):
        _layer_classes("d")


def test_custom_op_layer_compiles_fullgraph() -> None:
    mark = _layer_classes("e")
    layer = mark()
    explained = torch._dynamo.explain(layer)(torch.zeros(2))
    assert explained.graph_break_count == 0
    torch._dynamo.reset()


def test_parse_custom_ops_default() -> None:
    assert config.parse_custom_ops("") == (True, {})
    assert config.parse_custom_ops("none,+a,-b") == (False, {"a": True, "b": False})


@pytest.mark.parametrize(("text", "expected"), [
    ("", {}),
    ("rms_norm=cpp,native", {"rms_norm": ["cpp", "native"]}),
    (" a=x ; ns::b = y,z ;", {"a": ["x"], "ns::b": ["y", "z"]}),
])
def test_parse_priority(text: str, expected: dict[str, list[str]]) -> None:
    assert config.parse_priority(text) == expected


@pytest.mark.parametrize(("text", "message"), [
    ("a", "not of the form"),
    ("a=b=c", "not of the form"),
    ("A=x", "not an op name"),
    ("a=", "bad provider"),
    ("a=x,Y", r"bad provider name\(s\) \['Y'\]"),
    ("a=x;a=y", "given twice"),
])
def test_parse_priority_errors(text: str, message: str) -> None:
    with pytest.raises(opmux.ConfigError, match=message):
        config.parse_priority(text)
