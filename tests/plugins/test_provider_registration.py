"""One registration contract for every built-in plugin's provider modules."""

from __future__ import annotations

import importlib
import inspect

import pytest
import torch

import opmux
from opmux.plugins.registration import find_op, op_table, predicate, register_table

#: every ``register`` of the built-in plugins: entry modules and provider modules
REGISTER_MODULES = [
    "opmux.plugins.cpu", "opmux.plugins.cpu.cpp_ops", "opmux.plugins.cpu.moe_ops",
    "opmux.plugins.cuda", "opmux.plugins.cuda.triton_ops", "opmux.plugins.cuda.cuda_c",
    "opmux.plugins.ascend", "opmux.plugins.ascend.dlpack_provider",
    "opmux.plugins.xla.paged_attention",
]


@pytest.mark.parametrize("module", REGISTER_MODULES)
def test_register_has_one_shape(module: str) -> None:
    fn = importlib.import_module(module).register
    params = list(inspect.signature(fn).parameters.values())
    assert [p.name for p in params[:2]] == ["registry", "dispatch_key"], module
    assert params[1].default is not inspect.Parameter.empty  # the plugin's own key
    assert all(p.kind is inspect.Parameter.KEYWORD_ONLY for p in params[2:]), module
    assert inspect.signature(fn).return_annotation in ("list[str]", list[str]), module


@pytest.mark.parametrize("plugin", ["cpu", "cuda", "ascend", "xla"])
def test_hooks_are_typed(plugin: str) -> None:
    module = importlib.import_module(f"opmux.plugins.{plugin}")
    for hook in ("opmux_plugin_info", "opmux_register", "opmux_default_priority"):
        fn = getattr(module, hook, None)
        if fn is None:
            continue
        annotations = inspect.get_annotations(fn)
        assert "Any" not in {str(annotations.get(p)) for p in ("registry", "platform")}, hook
        assert "return" in annotations, hook


def test_register_table_registers_what_the_registry_holds(registry: opmux.OpRegistry,
                                                          ns: str) -> None:
    op = registry.register_op(opmux.ops.rms_norm.native, name="rms_norm", namespace=ns)
    native = op.impls["native"].fn
    table = {"rms_norm": (native, None), "silu_and_mul": (native, None)}
    done = register_table(registry, "p", "CPU", table, supported=False, reason="no compiler")
    assert done == ["rms_norm:p"]  # silu_and_mul is not in this registry: skipped
    impl = op.impls["p"]
    assert (impl.supported, impl.reason, impl.dispatch_key) == (False, "no compiler", "CPU")


def test_op_table_keys_rows_by_the_impls_name() -> None:
    def rms_norm(x: torch.Tensor) -> torch.Tensor:
        return x * 2

    def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
        return x * 3

    ok = predicate(rms_norm, lambda x: True)
    table = op_table((rms_norm, ok), {"silu_and_mul": (silu_and_mul, None)})
    assert table == {"rms_norm": (rms_norm, ok), "silu_and_mul": (silu_and_mul, None)}
    with pytest.raises(opmux.RegistrationError, match="two impls for op 'rms_norm'"):
        op_table((rms_norm, None), table)


def test_find_op_prefers_the_catalog() -> None:
    opmux.load_plugins()  # defines xla_gpu::paged_attention next to the catalog's
    found = find_op(opmux.global_registry(), "paged_attention")
    assert found is not None and found.qualname == "opmux::paged_attention"
    assert find_op(opmux.global_registry(), "no_such_op") is None


def _impl(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x


def test_predicate_takes_the_impls_parameters_and_passes_what_the_check_names(
        registry: opmux.OpRegistry, ns: str) -> None:
    seen: list[tuple[int, int]] = []
    pred = predicate(_impl, lambda weight, x: seen.append((weight.dim(), x.dim())) or x.dim() == 2)
    assert list(inspect.signature(pred).parameters) == ["x", "weight", "eps"]
    assert inspect.signature(pred).parameters["eps"].default == 1e-6
    assert pred.__name__ == "__impl_supports"
    x, w = torch.ones(2, 3), torch.ones(3)
    assert pred(x, w) is True and pred(x=x[0], weight=w, eps=0.5) is False
    assert seen == [(1, 2), (1, 1)]  # in the check's order
    other = predicate(_impl, lambda weight, x: False)  # same parameters: its own check
    assert other(x, w) is False and pred(x, w) is True
    assert other.__qualname__ == "__impl_supports"
    op = registry.register_op(opmux.ops.rms_norm.native, name="rms_norm", namespace=ns)
    op.register_impl("p", dispatch_key="CPU", supports_args=predicate(_impl, lambda x: True))(
        _impl)  # the registration's signature check accepts it
    with pytest.raises(opmux.SignatureMismatchError, match=r"reads \['scale'\]"):
        predicate(_impl, lambda x, scale: True)
    with pytest.raises(opmux.SignatureMismatchError, match="plain functions"):
        predicate(_impl, print)  # type: ignore[arg-type]


def test_predicate_fills_left_out_defaults_without_binding(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # the torch dispatcher leaves out trailing arguments equal to their defaults: the
    # predicate fills them from impl's defaults, with no signature binding on that path
    seen: list[float] = []
    pred = predicate(_impl, lambda x, eps: seen.append(eps) or eps > 0)
    x, w = torch.ones(2, 3), torch.ones(3)

    def no_signature(*args: object, **kwargs: object) -> None:
        raise AssertionError("bound a call that passed its arguments by position")

    monkeypatch.setattr(inspect, "signature", no_signature)
    assert pred(x, w) is True and pred(x, w, -1.0) is False
    assert seen == [1e-6, -1.0]
    monkeypatch.undo()
    assert pred(x, weight=w) is True and seen[-1] == 1e-6  # keywords: bound
    with pytest.raises(TypeError):
        pred(x)  # too few: binding raises (the dispatcher's walk takes that as a decline)
