"""torch.library plumbing: one library per namespace, schemas, kernels, fakes.

opmux keeps every :class:`torch.library.Library` it creates alive for as long as the
registry that owns it: an op lives exactly as long as its library object.
"""

from __future__ import annotations

import inspect
import re
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch

from opmux.core.errors import RegistrationError, SignatureMismatchError

__all__ = ["TORCH_NAMESPACES", "define_custom_op", "infer_schema",
           "validate_dispatch_key", "validate_name", "validate_namespace"]

_NAME_RE: re.Pattern[str] = re.compile(r"^[a-z_][a-z0-9_]*$")
"""Op, provider and namespace names: lower-case identifiers."""

_NON_BACKEND_PREFIXES: tuple[str, ...] = ("Composite", "Autograd", "Undefined", "Meta")
"""Dispatch keys a provider may not claim: these are not device backends."""

TORCH_NAMESPACES: frozenset[str] = frozenset({
    "aten", "prim", "prims", "torch", "quantized", "_quantized", "sparse", "_nested",
    "inductor", "higher_order", "rngprims", "debugprims", "profiler", "c10d",
    "_c10d_functional", "_c10d_functional_autograd", "c10d_functional", "_dtensor",
    "_export", "_inductor_test", "_test", "onednn", "mkldnn", "mkl", "xnnpack",
})
"""torch's own operator namespaces: opmux never defines or overrides ops there."""


def validate_name(kind: str, name: object, *, op: str | None = None) -> str:
    """Check ``name`` against ``^[a-z_][a-z0-9_]*$``.

    :param kind: what is being named ("op", "provider", "namespace"), for the message.
    :raises RegistrationError: when the name is not a lower-case identifier.
    """
    if not isinstance(name, str) or not _NAME_RE.match(name):
        where = f" of op {op!r}" if op else ""
        raise RegistrationError(
            f"invalid {kind} name {name!r}{where}: expected a lower-case identifier "
            f"matching ^[a-z_][a-z0-9_]*$ (e.g. 'rms_norm')",
            op=op,
        )
    return name


def validate_namespace(namespace: object) -> str:
    """Check a namespace name: a lower-case identifier that is not one of torch's own.

    :raises RegistrationError: bad name, or a namespace in :data:`TORCH_NAMESPACES`.
    """
    validate_name("namespace", namespace)
    assert isinstance(namespace, str)
    if namespace in TORCH_NAMESPACES:
        raise RegistrationError(
            f"namespace {namespace!r} belongs to torch; define opmux ops in a namespace of "
            f"your own (e.g. 'opmux' or your project's name)")
    return namespace


_BACKEND_KEYS: list[frozenset[str]] = []
"""The device backend dispatch keys, read once (``DispatchKey.__members__`` builds a dict)."""


def _backend_keys() -> frozenset[str]:
    if not _BACKEND_KEYS:
        _BACKEND_KEYS.append(frozenset(k for k in torch._C.DispatchKey.__members__
                                       if not k.startswith(_NON_BACKEND_PREFIXES)))
    return _BACKEND_KEYS[0]


def validate_dispatch_key(key: object, *, op: str, provider: str) -> str:
    """Check that ``key`` names a device backend dispatch key torch knows.

    :raises RegistrationError: for unknown keys and for alias keys such as
        ``CompositeExplicitAutograd`` or ``Autograd``.
    """
    backends = _backend_keys()
    if isinstance(key, str) and key in backends:
        return key
    examples = ", ".join(sorted(k for k in ("CPU", "CUDA", "XLA", "PrivateUse1", "MPS", "XPU")
                                if k in backends))
    raise RegistrationError(
        f"provider {provider!r} of op {op!r}: unknown or non-backend dispatch key {key!r}; "
        f"expected a device backend key such as {examples}",
        op=op,
        provider=provider,
    )


def infer_schema(fn: Callable[..., Any], *, op: str, mutates_args: Iterable[str],
                 what: str = "native implementation") -> str:
    """Infer the torch schema (without the name) of ``fn``; reject keyword-only parameters.

    The schema is :func:`torch.library.infer_schema`'s; its errors are reworded to name
    the op and say what to change.

    :raises SignatureMismatchError: when the signature cannot be lowered to a schema.
    """
    mutates = tuple(mutates_args)
    sig = inspect.signature(fn)
    kw_only = [p.name for p in sig.parameters.values() if p.kind is p.KEYWORD_ONLY]
    if kw_only:
        raise SignatureMismatchError(
            f"{what} of op {op!r} has keyword-only parameter(s) {kw_only}: opmux ops take "
            f"positional-or-keyword parameters only (they must lower to a torch schema); "
            f"remove the '*' separator",
            op=op,
        )
    try:
        return torch.library.infer_schema(fn, mutates_args=mutates)
    except Exception as exc:  # torch raises ValueError / ValueError subclasses with detail
        raise SignatureMismatchError(
            f"cannot infer a torch schema for the {what} of op {op!r}: {exc}. Annotate every "
            f"parameter and the return with types torch.library supports "
            f"(Tensor, int, float, bool, str, Optional[...], list[...], tuple of Tensors)",
            op=op,
        ) from exc


def define_custom_op(
    lib: torch.library.Library,
    op_name: str,
    op_func: Callable[..., Any],
    dispatch_key: str,
    *,
    mutates_args: Sequence[str] | None = None,
    fake_impl: Callable[..., Any] | None = None,
    tags: Sequence[torch.Tag] = (),
) -> None:
    """Define ``lib.ns::op_name`` from ``op_func`` with one kernel; validate before defining.

    Everything that can be refused (name, namespace, schema, dispatch key, an existing
    op of that name) is checked first, so a refused call leaves nothing defined and a
    corrected retry works. :func:`opmux.direct_register_custom_op` fills the defaults.

    :raises RegistrationError: bad name or namespace, unknown key, name already defined.
    :raises SignatureMismatchError: ``op_func`` cannot be lowered to a schema.
    """
    validate_name("op", op_name)
    ns = validate_namespace(lib.ns)
    qualname = f"{ns}::{op_name}"
    schema = infer_schema(op_func, op=qualname, mutates_args=mutates_args or (),
                          what="function")
    validate_dispatch_key(dispatch_key, op=qualname, provider=getattr(
        op_func, "__name__", "op_func"))
    if hasattr(getattr(torch.ops, ns), op_name):
        raise RegistrationError(
            f"op {qualname!r} is already defined; choose another name or namespace",
            op=qualname,
        )
    lib.define(op_name + schema, tags=tuple(tags))
    lib.impl(op_name, op_func, dispatch_key)
    if fake_impl is not None:
        torch.library.register_fake(qualname, fake_impl, lib=lib, allow_override=True)
