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

__all__ = ["direct_register_custom_op", "infer_schema", "validate_dispatch_key", "validate_name"]

_NAME_RE: re.Pattern[str] = re.compile(r"^[a-z_][a-z0-9_]*$")
"""Op, provider and namespace names: lower-case identifiers."""

_NON_BACKEND_PREFIXES: tuple[str, ...] = ("Composite", "Autograd", "Undefined", "Meta")
"""Dispatch keys a provider may not claim: these are not device backends."""


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


def validate_dispatch_key(key: object, *, op: str, provider: str) -> str:
    """Check that ``key`` names a device backend dispatch key torch knows.

    :raises RegistrationError: for unknown keys and for alias keys such as
        ``CompositeExplicitAutograd`` or ``Autograd``.
    """
    members = torch._C.DispatchKey.__members__
    if not isinstance(key, str) or key not in members or key.startswith(_NON_BACKEND_PREFIXES):
        examples = ", ".join(sorted(k for k in ("CPU", "CUDA", "XLA", "PrivateUse1", "MPS", "XPU")
                                    if k in members))
        raise RegistrationError(
            f"provider {provider!r} of op {op!r}: unknown or non-backend dispatch key {key!r}; "
            f"expected a device backend key such as {examples}",
            op=op,
            provider=provider,
        )
    return key


def infer_schema(fn: Callable[..., Any], *, op: str, mutates_args: Iterable[str],
                 what: str = "native implementation") -> str:
    """Infer the torch schema (without the name) of ``fn``; reject keyword-only parameters.

    :raises SignatureMismatchError: when the signature cannot be lowered to a schema.
    """
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
        return torch.library.infer_schema(fn, mutates_args=tuple(mutates_args))
    except Exception as exc:  # torch raises ValueError / ValueError subclasses with detail
        raise SignatureMismatchError(
            f"cannot infer a torch schema for the {what} of op {op!r}: {exc}. Annotate every "
            f"parameter and the return with types torch.library supports "
            f"(Tensor, int, float, bool, str, Optional[...], list[...], tuple of Tensors)",
            op=op,
        ) from exc


def direct_register_custom_op(
    op_name: str,
    op_func: Callable[..., Any],
    mutates_args: Sequence[str] | None = None,
    fake_impl: Callable[..., Any] | None = None,
    target_lib: torch.library.Library | None = None,
    dispatch_key: str | None = None,
    tags: Sequence[torch.Tag] = (),
) -> None:
    """Register ``op_func`` as a torch op with the least overhead: define + one impl.

    The engine-style helper: the schema is inferred from ``op_func``, the op is defined
    in ``target_lib`` (default: opmux's own ``opmux`` library, kept alive by the global
    registry) and ``op_func`` becomes the kernel for ``dispatch_key`` (default: the
    current platform's key). ``fake_impl`` gives shapes for ``torch.compile``.

    :param op_name: name inside the library's namespace, e.g. ``"my_attention"``.
    :param mutates_args: names of the Tensor arguments written in place.
    :raises RegistrationError: on a bad name or a name already defined.
    """
    validate_name("op", op_name)
    schema = infer_schema(op_func, op=op_name, mutates_args=mutates_args or (),
                          what="function")
    if target_lib is None:
        from opmux.core.registry import global_registry

        target_lib = global_registry().library("opmux")
    if dispatch_key is None:
        from opmux.platforms import current_platform

        dispatch_key = current_platform().dispatch_key
    ns = target_lib.ns
    if hasattr(getattr(torch.ops, ns), op_name):
        raise RegistrationError(
            f"op '{ns}::{op_name}' is already defined; choose another name or namespace",
            op=f"{ns}::{op_name}",
        )
    target_lib.define(op_name + schema, tags=tuple(tags))
    target_lib.impl(op_name, op_func, dispatch_key)
    if fake_impl is not None:
        torch.library.register_fake(f"{ns}::{op_name}", fake_impl, lib=target_lib)
