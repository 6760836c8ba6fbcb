"""torch.library plumbing: one library per namespace, schemas, kernels, fakes.

opmux keeps every :class:`torch.library.Library` it creates alive for as long as the
registry that owns it: an op lives exactly as long as its library object.
"""

from __future__ import annotations

import inspect
import re
from collections.abc import Callable, Iterable, Sequence
from types import FunctionType
from typing import Any

import torch

from opmux.core.errors import RegistrationError, SignatureMismatchError

__all__ = ["TORCH_NAMESPACES", "define_custom_op", "infer_schema", "register_fake",
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

    The schema is :func:`torch.library.infer_schema`'s. A plain function whose parameters
    and return are annotated with (non-string) types in torch's own tables and whose
    defaults are numbers, booleans, strings or ``None`` is lowered here from its code object
    and those tables, to the same string, without building an :class:`inspect.Signature`
    (twice: once here, once in torch) for each of the catalog's ops at start-up; anything
    else goes to torch's function, which also words the errors.

    :raises SignatureMismatchError: when the signature cannot be lowered to a schema.
    """
    mutates = tuple(mutates_args)
    fast = _fast_schema(fn, mutates)
    if fast is not None:
        return fast
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


_TYPE_TABLES: list[tuple[dict[Any, str], dict[Any, str]] | None] = []
"""torch's annotation → schema type tables (parameters, returns), read once; ``None`` where
this torch has no such tables (then every schema is torch's :func:`infer_schema`'s)."""

_FUNCTION_FLAGS_REFUSED = inspect.CO_VARARGS | inspect.CO_VARKEYWORDS
_MISSING = object()


def _type_tables() -> tuple[dict[Any, str], dict[Any, str]] | None:
    if not _TYPE_TABLES:
        module = getattr(torch._library, "infer_schema", None)
        params = getattr(module, "SUPPORTED_PARAM_TYPES", None)
        returns = getattr(module, "SUPPORTED_RETURN_TYPES", None)
        _TYPE_TABLES.append((params, returns) if isinstance(params, dict)
                            and isinstance(returns, dict) else None)
    return _TYPE_TABLES[0]


def _fast_schema(fn: Callable[..., Any], mutates: tuple[str, ...]) -> str | None:
    """``fn``'s schema from its code object and torch's type tables, or ``None`` when the
    function is anything but the plain case (see :func:`infer_schema`)."""
    tables = _type_tables()
    if tables is None or type(fn) is not FunctionType:
        return None
    if "__wrapped__" in fn.__dict__ or "__signature__" in fn.__dict__:
        return None  # inspect.signature would follow these
    code = fn.__code__
    if code.co_posonlyargcount or code.co_kwonlyargcount or \
            code.co_flags & _FUNCTION_FLAGS_REFUSED:
        return None
    param_types, return_types = tables
    annotations = fn.__annotations__
    names = code.co_varnames[:code.co_argcount]
    defaults = fn.__defaults__ or ()
    first_default = len(names) - len(defaults)
    params = []
    try:
        for idx, name in enumerate(names):
            annotation = annotations.get(name, _MISSING)
            if isinstance(annotation, str):
                return None
            schema_type = param_types.get(annotation)
            if schema_type is None:
                return None
            if name in mutates:
                if not schema_type.startswith("Tensor"):
                    return None
                schema_type = f"Tensor(a{idx}!){schema_type[6:]}"
            if idx < first_default:
                params.append(f"{schema_type} {name}")
                continue
            default = defaults[idx - first_default]
            if default is None or isinstance(default, (bool, int, float)):
                params.append(f"{schema_type} {name}={default}")
            elif type(default) is str:
                params.append(f'{schema_type} {name}="{default}"')
            else:
                return None
        if any(m not in names for m in mutates):
            return None
        ret = annotations.get("return", _MISSING)
        if ret is None:
            returns = "()"
        elif isinstance(ret, str):
            return None
        elif getattr(ret, "__origin__", None) is tuple:
            items = [return_types[a] for a in ret.__args__]
            returns = f"(({items[0]}))" if len(items) == 1 else f"({', '.join(items)})"
        else:
            returns = return_types[ret]
    except (KeyError, TypeError, AttributeError, IndexError):  # unhashable, unknown, odd
        return None
    return f"({', '.join(params)}) -> {returns}"


def register_fake(lib: torch.library.Library, qualname: str, fn: Callable[..., Any], *,
                  allow_override: bool) -> None:
    """:func:`torch.library.register_fake` of ``fn`` for ``qualname``, defined in ``lib``.

    torch's function names the registration's source by inspecting its caller's frame
    (``inspect.getframeinfo``, which scans ``sys.modules``): about half a millisecond per
    op at start-up. Where torch's fake-impl holder has the ``register(func, source, lib,
    allow_override)`` that this torch's ``register_fake`` calls, the registration is made
    there directly, with the fake function's own definition as its source: the same
    registration (the holder's kernel, its Meta kernel, a handle that ``lib`` removes when
    it is destroyed). With any other torch, torch's public function is called.
    """
    holder_register = _fake_holder_register(qualname)
    handles = getattr(lib, "_registration_handles", None)
    if holder_register is None or not isinstance(handles, list):
        torch.library.register_fake(qualname, fn, lib=lib, allow_override=allow_override)
        return
    code = getattr(fn, "__code__", None)
    source = f"{code.co_filename}:{code.co_firstlineno}" if code is not None else repr(fn)
    handles.append(holder_register(fn, source, lib=lib, allow_override=allow_override))


_FAKE_HOLDER_OK: list[bool | None] = [None]
"""Whether torch's fake-impl holder has the ``register`` this module calls (checked once)."""

_FAKE_HOLDER_PARAMS = ["self", "func", "source", "lib", "allow_override"]


def _fake_holder_register(qualname: str) -> Callable[..., Any] | None:
    """The ``register`` of ``qualname``'s fake-impl holder, or ``None`` (other torch)."""
    ok = _FAKE_HOLDER_OK[0]
    if ok is None:
        holder: Any = getattr(getattr(torch._library, "fake_impl", None), "FakeImplHolder", None)
        try:
            ok = list(inspect.signature(holder.register).parameters) == _FAKE_HOLDER_PARAMS
        except (AttributeError, TypeError, ValueError):
            ok = False
        _FAKE_HOLDER_OK[0] = ok
    if not ok:
        return None
    register: Callable[..., Any] = \
        torch._library.simple_registry.singleton.find(qualname).fake_impl.register
    return register


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
        register_fake(lib, qualname, fake_impl, allow_override=True)
