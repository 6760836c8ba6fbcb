"""Registration validates everything before it changes anything."""

from __future__ import annotations

import pytest
import torch

import opmux


@pytest.fixture
def op(registry: opmux.OpRegistry, ns: str) -> opmux.Op:
    @opmux.register_op(namespace=ns, registry=registry)
    def scale(x: torch.Tensor, factor: float = 2.0) -> torch.Tensor:
        return x * factor

    return scale


def _impl(x: torch.Tensor, factor: float = 2.0) -> torch.Tensor:
    return x * factor + 100


def test_bare_and_argument_forms(registry: opmux.OpRegistry, ns: str) -> None:
    def twice(x: torch.Tensor) -> torch.Tensor:
        return x * 2

    named = opmux.register_op(name="twice2", namespace=ns, registry=registry)(twice)
    assert named.name == "twice2" and named(torch.ones(1)).item() == 2.0
    assert named.__doc__ == twice.__doc__


def test_bare_decorator_uses_the_global_registry_and_opmux_namespace(ns: str) -> None:
    def fn(x: torch.Tensor) -> torch.Tensor:
        return x - 1

    fn.__name__ = f"bare_{ns}"
    op = opmux.register_op(fn)
    try:
        assert op.namespace == "opmux" and op.name == fn.__name__
        assert opmux.get_op(fn.__name__) is op
        assert op(torch.ones(1)).item() == 0.0
    finally:
        opmux.global_registry().forget_op(op)


def test_catalog_ops_are_in_the_global_registry() -> None:
    # the bare form uses the global registry and namespace "opmux": check the catalog op
    op = opmux.get_op("rms_norm")
    assert op.namespace == "opmux" and op.name == "rms_norm"
    assert op in opmux.list_ops()


def test_keyword_only_parameters_are_rejected(registry: opmux.OpRegistry, ns: str) -> None:
    def kw(x: torch.Tensor, *, eps: float = 1.0) -> torch.Tensor:
        return x

    with pytest.raises(opmux.SignatureMismatchError,
                       match=r"keyword-only parameter\(s\) \['eps'\]"):
        opmux.register_op(namespace=ns, registry=registry)(kw)


def test_unannotated_native_is_rejected(registry: opmux.OpRegistry, ns: str) -> None:
    def bad(x):  # type: ignore[no-untyped-def]
        return x

    with pytest.raises(TypeError, match="cannot infer a torch schema"):
        opmux.register_op(namespace=ns, registry=registry)(bad)


@pytest.mark.parametrize("name", ["Bad", "1x", "with-dash", ""])
def test_bad_op_names(registry: opmux.OpRegistry, ns: str, name: str) -> None:
    def f(x: torch.Tensor) -> torch.Tensor:
        return x

    with pytest.raises(opmux.RegistrationError, match="invalid op name"):
        opmux.register_op(name=name, namespace=ns, registry=registry)(f)


def test_duplicate_op(registry: opmux.OpRegistry, ns: str, op: opmux.Op) -> None:
    def scale(x: torch.Tensor, factor: float = 2.0) -> torch.Tensor:
        return x

    with pytest.raises(opmux.RegistrationError, match="already defined"):
        opmux.register_op(namespace=ns, registry=registry)(scale)


def test_an_op_torch_has_from_elsewhere_is_refused(registry: opmux.OpRegistry, ns: str) -> None:
    other = torch.library.Library(ns, "FRAGMENT")
    try:
        other.define("taken(Tensor x) -> Tensor")

        def taken(x: torch.Tensor) -> torch.Tensor:
            return x

        with pytest.raises(opmux.RegistrationError, match=f"'{ns}::taken' is already defined"):
            opmux.register_op(namespace=ns, registry=registry)(taken)
        assert registry.list_ops() == []
        free = opmux.register_op(name="free", namespace=ns, registry=registry)(taken)
        assert free(torch.ones(1)).item() == 1.0  # the refusal left nothing half-defined
    finally:
        other._destroy()


def test_reserved_provider(op: opmux.Op) -> None:
    with pytest.raises(opmux.RegistrationError, match="'native' is reserved"):
        op.register_impl("native", dispatch_key="CPU")(_impl)
    assert set(op.impls) == {"native"}


def test_bad_provider_name(op: opmux.Op) -> None:
    with pytest.raises(ValueError, match="invalid provider name 'Fast!'"):
        op.register_impl("Fast!", dispatch_key="CPU")(_impl)


def test_duplicate_provider(op: opmux.Op) -> None:
    op.register_impl("fast", dispatch_key="CPU")(_impl)
    with pytest.raises(opmux.RegistrationError, match="'fast' is already registered"):
        op.register_impl("fast", dispatch_key="CPU")(_impl)
    assert op(torch.ones(1)).item() == 102.0  # the first registration still serves


@pytest.mark.parametrize("key", ["NoSuchKey", "CompositeExplicitAutograd", "Autograd", 3])
def test_unknown_or_alias_dispatch_key(op: opmux.Op, key: object) -> None:
    with pytest.raises(opmux.RegistrationError, match="non-backend dispatch key"):
        op.register_impl("fast", dispatch_key=key)(_impl)  # type: ignore[arg-type]
    assert set(op.impls) == {"native"}


def test_impl_signature_must_match(op: opmux.Op) -> None:
    def wrong_default(x: torch.Tensor, factor: float = 3.0) -> torch.Tensor:
        return x

    def wrong_name(y: torch.Tensor, factor: float = 2.0) -> torch.Tensor:
        return y

    def wrong_type(x: torch.Tensor, factor: int = 2) -> torch.Tensor:
        return x

    for fn in (wrong_default, wrong_name, wrong_type):
        with pytest.raises(opmux.SignatureMismatchError, match="native implementation has"):
            op.register_impl("fast", dispatch_key="CPU")(fn)
    assert set(op.impls) == {"native"}
    assert op(torch.ones(1)).item() == 2.0


def test_supports_args_signature_is_checked(op: opmux.Op) -> None:
    with pytest.raises(opmux.SignatureMismatchError, match=r"must take native's parameters"):
        op.register_impl("fast", dispatch_key="CPU", supports_args=lambda x: True)
    with pytest.raises(TypeError, match="keyword-only"):
        op.register_impl("fast", dispatch_key="CPU",
                         supports_args=lambda x, *, factor=2.0: True)
    with pytest.raises(TypeError, match=r"\(x, factor=2.0\)"):
        op.register_impl("fast", dispatch_key="CPU", supports_args=lambda x, factor=1.0: True)
    assert set(op.impls) == {"native"}


def test_unknown_provider_in_priority(op: opmux.Op) -> None:
    with pytest.raises(opmux.RegistrationError, match=r"unknown provider\(s\) \['nope'\]"):
        op.set_default_priority(["nope", "native"])
    assert op.priority() == ["native"]


def test_optional_and_tuple_returns(registry: opmux.OpRegistry, ns: str) -> None:
    @opmux.register_op(namespace=ns, registry=registry)
    def pair(x: torch.Tensor, window: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        return x + (window or 0), x * 2

    assert pair.schema == "(Tensor x, SymInt? window=None) -> (Tensor, Tensor)"
    a, b = pair(torch.ones(1), 3)
    assert a.item() == 4.0 and b.item() == 2.0


def test_unregister_impl(op: opmux.Op) -> None:
    op.register_impl("fast", dispatch_key="CPU")(_impl)
    op.unregister_impl("fast")
    assert op(torch.ones(1)).item() == 2.0
    with pytest.raises(opmux.RegistrationError, match="no removable provider 'fast'"):
        op.unregister_impl("fast")


def test_errors_are_opmux_errors_with_public_module() -> None:
    for cls in (opmux.RegistrationError, opmux.SignatureMismatchError, opmux.ConfigError):
        assert issubclass(cls, opmux.OpmuxError)
        assert cls.__module__ == "opmux"
