"""CustomOp layers: per-platform forward, enablement strings, out-of-tree replacement."""

from __future__ import annotations

import pytest
import torch

import opmux
from opmux.core import config, plugins
from opmux.testing import reset_for_tests


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
    reset_for_tests()
    assert mark()(torch.zeros(1)).item() == 20.0  # hip → cuda
    monkeypatch.setenv("OPMUX_PLATFORM", "xla")
    reset_for_tests()
    assert mark()(torch.zeros(1)).item() == 1.0  # not overridden → native


def _oot_platform(monkeypatch: pytest.MonkeyPatch, name: str, method: str) -> None:
    """Make an out-of-tree platform ``name`` with forward method ``method`` the current one."""
    accel = type(f"P_{name}", (opmux.Platform,), {
        "name": name, "device_type": "cpu", "dispatch_key": "CPU", "forward_method": method,
        "is_available": classmethod(lambda cls: True)})
    monkeypatch.setattr(plugins, "discovered_platforms", lambda: [accel])
    reset_for_tests()


def test_an_out_of_tree_platform_names_its_own_forward(monkeypatch: pytest.MonkeyPatch) -> None:
    _oot_platform(monkeypatch, "mark_accel", "forward_oot")
    assert opmux.current_platform().forward_method == "forward_oot"
    mark = _layer_classes("oot")
    assert mark()(torch.zeros(1)).item() == 10.0  # no forward_oot of its own: the CPU path

    class OotMark(mark):  # type: ignore[misc,valid-type]
        def forward_oot(self, x: torch.Tensor) -> torch.Tensor:
            return x + 30

    assert OotMark()(torch.zeros(1)).item() == 30.0


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


def test_list_form_and_whitespace() -> None:
    mark = _layer_classes("f")
    opmux.set_custom_ops(["none", "+mark_f"])
    assert mark()(torch.zeros(1)).item() == 10.0
    opmux.set_custom_ops([" all ", "-mark_f"])
    assert mark()(torch.zeros(1)).item() == 1.0
    opmux.set_custom_ops(("none",))
    assert not mark.enabled()


@pytest.mark.parametrize(("spec", "message"), [
    ("all,none", "exactly one"),
    ("all,all", "exactly one"),
    (["none", "all"], "exactly one"),
    ("all,rms_norm", "element 'rms_norm'"),
    ("+Bad", "element '\\+Bad'"),
    ("+all", "'all' and 'none' take no sign"),
    ("none,-all", "'all' and 'none' take no sign"),
    (["+none"], "'all' and 'none' take no sign"),
    ("all,+silu_and_mul,-silu_and_mul", "both enables and disables 'silu_and_mul'"),
    ("-gelu_neww", r"unknown custom op layer name\(s\) \['gelu_neww'\]; known layers: "
                   r"\[.*'gelu_new',.*'silu_and_mul'"),
    (42, "expected a string like 'all,-rms_norm' or a list of strings.*got int 42"),
    (["all", 3], "got list"),
    (b"all", "got bytes"),
])
def test_bad_enablement_settings(spec: object, message: str) -> None:
    from opmux.layers import NewGELU

    opmux.set_custom_ops("none")
    with pytest.raises(opmux.ConfigError, match=message):
        opmux.set_custom_ops(spec)  # type: ignore[arg-type]
    assert not NewGELU.enabled()  # nothing changed


def test_unknown_names_list_the_known_layers_sorted() -> None:
    _layer_classes("h")
    with pytest.raises(opmux.ConfigError) as info:
        opmux.set_custom_ops("all,-nope,-also_nope")
    message = str(info.value)
    assert "['also_nope', 'nope']" in message
    listed = message.split("known layers: ")[1]
    names = [n.strip(" '[]") for n in listed.split(",")]
    assert names == sorted(names) and "mark_h" in names and "xielu" in names


def test_env_setting_is_checked_when_resolved(monkeypatch: pytest.MonkeyPatch) -> None:
    mark = _layer_classes("i")
    monkeypatch.setenv("OPMUX_CUSTOM_OPS", "none,+mark_i")
    assert mark()(torch.zeros(1)).item() == 10.0
    monkeypatch.setenv("OPMUX_CUSTOM_OPS", "none,+mark_typo")
    with pytest.raises(opmux.ConfigError, match="OPMUX_CUSTOM_OPS: unknown custom op layer"):
        mark()


def test_compile_mode_sets_the_default(monkeypatch: pytest.MonkeyPatch) -> None:
    mark = _layer_classes("j")
    monkeypatch.delenv("OPMUX_COMPILE_MODE", raising=False)
    assert mark.enabled()  # eager: all
    opmux.set_compile_mode("inductor")  # as vLLM with Inductor: none
    assert not mark.enabled()
    assert mark()(torch.zeros(1)).item() == 1.0
    opmux.set_custom_ops("+mark_j")  # no base mode: the compile-mode default, plus mark_j
    assert mark.enabled()
    opmux.set_custom_ops("all")  # an explicit base wins
    assert mark.enabled()
    opmux.set_custom_ops(None)
    opmux.set_compile_mode("aot_eager")  # another backend: all
    assert mark.enabled()
    opmux.set_compile_mode(None)
    monkeypatch.setenv("OPMUX_COMPILE_MODE", "inductor")
    assert not mark.enabled()
    monkeypatch.setenv("OPMUX_CUSTOM_OPS", "-mark_j")
    assert not mark.enabled()
    monkeypatch.setenv("OPMUX_COMPILE_MODE", "none")
    assert not mark.enabled() and mark.enabled() is False
    monkeypatch.setenv("OPMUX_CUSTOM_OPS", "")
    assert mark.enabled()
    from opmux.layers.custom_op import compile_mode

    monkeypatch.setenv("OPMUX_COMPILE_MODE", "not a mode")
    with pytest.raises(opmux.ConfigError, match="OPMUX_COMPILE_MODE: expected 'inductor'"):
        compile_mode()
    with pytest.raises(opmux.ConfigError, match="set_compile_mode: expected"):
        opmux.set_compile_mode("Inductor!")


def test_settings_and_info_report_layers(capsys: pytest.CaptureFixture[str]) -> None:
    from opmux import cli
    from opmux.layers.custom_op import custom_op_settings

    _layer_classes("k")
    opmux.set_custom_ops("none,+gelu_new")
    settings = custom_op_settings()
    assert settings["base"] == "none" and settings["overrides"] == {"gelu_new": True}
    assert settings["source"] == "set_custom_ops" and settings["compile_mode"] == "none"
    assert settings["layers"]["gelu_new"] and not settings["layers"]["silu_and_mul"]
    from opmux.layers import NewGELU

    NewGELU()
    assert cli.main(["info"]) == 0
    out = capsys.readouterr().out
    assert "custom ops: base none (set_custom_ops), overrides {'gelu_new': True}" in out
    rows = {line.split()[0]: line.split()[1:] for line in out.splitlines()
            if line.startswith(("gelu_new ", "silu_and_mul ", "fused_moe "))}
    assert rows["gelu_new"] == ["yes", "1", "0"]
    assert rows["silu_and_mul"] == ["no", "0", "0"] and rows["fused_moe"][0] == "no"


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


def test_register_oot_by_name_spares_unregistered_subclasses_and_takes_class_names() -> None:
    from opmux import CustomOp, RegistrationError
    from opmux.layers import ColumnParallelLinear, MergedColumnParallelLinear, RMSNorm

    class VendorColumn(ColumnParallelLinear):
        pass

    class VendorNorm(RMSNorm):
        pass

    try:
        CustomOp.register_oot(VendorColumn, name="column_parallel_linear")
        CustomOp.register_oot(VendorNorm, name="RMSNorm")
        assert type(ColumnParallelLinear(8, 4)) is VendorColumn
        # a subclass inheriting the registered name keeps its own class and constructor
        merged = MergedColumnParallelLinear(8, [4, 4])
        assert type(merged) is MergedColumnParallelLinear
        assert type(RMSNorm(8)) is VendorNorm
    finally:
        CustomOp.op_registry_oot.pop("column_parallel_linear", None)
        CustomOp.op_registry_oot.pop("RMSNorm", None)
    assert type(RMSNorm(8)) is RMSNorm
    with pytest.raises(RegistrationError, match="neither a layer name"):
        CustomOp.register_oot(VendorNorm, name="rms-norm")


def test_a_platform_method_a_layer_lacks_runs_its_catalog_op_path(
        monkeypatch: pytest.MonkeyPatch) -> None:
    _oot_platform(monkeypatch, "acme_fw", "forward_acme")
    mark = _layer_classes("acme")
    assert mark()(torch.zeros(1)).item() == 10.0  # never forward_native by accident

    class AcmeMark(mark):  # type: ignore[misc,valid-type]
        def forward_acme(self, x: torch.Tensor) -> torch.Tensor:
            return x + 40

    assert AcmeMark()(torch.zeros(1)).item() == 40.0
    opmux.set_custom_ops("none")
    assert AcmeMark()(torch.zeros(1)).item() == 1.0  # disabled: native
    # a catalog layer reaches the catalog op, so the CPU key's providers serve it
    opmux.set_custom_ops(None)
    silu = opmux.layers.SiluAndMul()
    x = torch.randn(3, 8)
    calls = []
    op = opmux.get_op("silu_and_mul")

    def acme_silu(x: torch.Tensor) -> torch.Tensor:
        calls.append(1)
        return op.native(x)

    op.register_impl("acme_silu", dispatch_key="CPU")(acme_silu)
    try:
        with op.set_priority(["acme_silu", "native"]):
            torch.testing.assert_close(silu(x), op.native(x))
    finally:
        op.unregister_impl("acme_silu")
    assert calls == [1]


@pytest.mark.parametrize("method", ["forward", "forward_", "run_acme", "forward-acme", None,
                                    123, ""])
def test_a_platform_forward_method_is_checked_when_the_class_is_made(method: object) -> None:
    with pytest.raises(opmux.PlatformError, match=r"platform 'bad_fw' .* forward_method must "
                                                  r"name a CustomOp method 'forward_<name>'"):
        type("BadFw", (opmux.Platform,), {"name": "bad_fw", "forward_method": method})
