"""The op registry: owns the torch libraries and the ops, and runs its start-up lazily.

An :class:`OpRegistry` knows nothing of the catalog, plugins or platforms: whoever builds
it passes the hooks (a ``loader`` run before the first op call, a ``catalog`` hook run
before the default namespace is used, the ``platform_key`` providers default to). The
process-wide registry is built by :mod:`opmux._runtime` (which passes the start-up, the
catalog import and the current platform's key, see docs/architecture.md, "Start-up") and
held by the runtime object (:func:`opmux.core.state.runtime`), so that
:func:`register_op` (used by the catalog modules) and :func:`get_op` reach it; tests
build their own with a unique namespace (see ``tests/conftest.py``).
"""

from __future__ import annotations

import inspect
import sys
import threading
from collections.abc import Callable, Iterable, Sequence
from typing import Any, TypeVar, overload

import torch

from opmux.core.errors import RegistrationError, UnknownOpError
from opmux.core.op import Op
from opmux.core.state import runtime
from opmux.core.torch_lib import (
    define_custom_op,
    infer_schema,
    validate_name,
    validate_namespace,
)

__all__ = ["OpRegistry", "direct_register_custom_op", "get_op", "global_registry", "list_ops",
           "register_op"]

_F = TypeVar("_F", bound=Callable[..., Any])
DEFAULT_NAMESPACE = "opmux"


class OpRegistry:
    """Ops by qualified name, plus the :class:`torch.library.Library` of each namespace.

    :param loader: run on first use of any op until it succeeds (the global registry's
        start-up loads plugins; a test registry usually has none). An error it raises
        reaches the caller, and the next use runs it again: a fatal configuration stays
        fatal until fixed.
    :param catalog: run before ops of ``namespace="opmux"`` are looked up or defined (the
        global registry imports the op catalog, so catalog names are taken first).
    :param platform_key: the dispatch key providers register on when they name none, or a
        function giving it (asked at each registration; the process-wide registry asks the
        current platform). Default ``"CPU"``.
    """

    def __init__(self, *, loader: Callable[[OpRegistry], None] | None = None,
                 catalog: Callable[[], None] | None = None,
                 platform_key: str | Callable[[], str] = "CPU") -> None:
        self._ops: dict[str, Op] = {}
        self._libs: dict[str, torch.library.Library] = {}
        self._lock = threading.RLock()
        self._loader = loader
        self._catalog = catalog
        self._platform_key: Callable[[], str] = (
            platform_key if callable(platform_key) else lambda: platform_key)
        #: has the loader run? A one-element list because every kernel reads it on each
        #: call (the hot path): a closure cell would need a global or a lookup per call.
        self.loaded_flag: list[bool] = [loader is None]
        self._loading_thread: int | None = None

    # ------------------------------------------------------------ libraries
    def library(self, namespace: str) -> torch.library.Library:
        """The FRAGMENT library of ``namespace`` (created on first use, kept alive)."""
        with self._lock:
            lib = self._libs.get(namespace)
            if lib is None:
                validate_namespace(namespace)
                lib = torch.library.Library(namespace, "FRAGMENT")
                self._libs[namespace] = lib
            return lib

    # ----------------------------------------------------------------- ops
    def register_op(self, fn: Callable[..., Any], *, name: str | None = None,
                    namespace: str = DEFAULT_NAMESPACE, mutates_args: Iterable[str] = (),
                    tags: Sequence[torch.Tag] = ()) -> Op:
        """Define ``namespace::name`` from the native function ``fn``; see :func:`register_op`.

        Registering the same function under the same name again returns the op already
        defined (a plugin's ``opmux_register`` runs again after a reset); any other
        function under a taken name is an error.
        """
        op_name = validate_name("op", name if name is not None else fn.__name__)
        validate_namespace(namespace)
        qualname = f"{namespace}::{op_name}"
        mutates = tuple(mutates_args)
        schema = infer_schema(fn, op=qualname, mutates_args=mutates)
        if namespace == DEFAULT_NAMESPACE:
            self._load_catalog()  # catalog names are reserved: they are taken first
        with self._lock:
            existing = self._ops.get(qualname)
            if (existing is not None and existing.native is fn and existing.schema == schema
                    and existing.mutates_args == mutates):
                return existing  # the same definition again: a plugin loading anew
            if existing is not None:
                self.check_undefined(namespace, op_name)  # raises, naming the owner
            lib = self.library(namespace)
            try:
                # torch refuses a name it has (looking it up first costs another failed
                # torch.ops lookup per op at start-up); nothing is defined then
                lib.define(op_name + schema, tags=tuple(tags))
            except RuntimeError:
                self.check_undefined(namespace, op_name)  # an op of that name: say so
                raise
            op = Op(self, op_name, namespace, fn, schema, mutates, self._platform_key)
            lib.impl(op_name, op.native_kernel(), "CompositeExplicitAutograd")
            # The default fake is native itself, run by a Meta kernel (cheaper to register
            # than torch.library.register_fake, which inspects its caller's frame); both
            # FakeTensorMode and meta-device calls use it. Op.register_fake (also torch's
            # registered fake) or Op.register_meta (the Meta kernel only) replaces it.
            lib.impl(op_name, op.meta_kernel(), "Meta")
            self._ops[qualname] = op
            runtime().plugins.journal.record_op(op)
            return op

    def check_undefined(self, namespace: str, op_name: str) -> None:
        """Raise :class:`~opmux.RegistrationError` if ``namespace::op_name`` exists."""
        qualname = f"{namespace}::{op_name}"
        owner = self._ops.get(qualname)
        if owner is not None or hasattr(getattr(torch.ops, namespace), op_name):
            where = ""
            if owner is not None:
                module = inspect.getmodule(owner.native)
                where = f" (by {module.__name__})" if module is not None else ""
            reserved = (" Catalog op names are reserved in namespace 'opmux'."
                        if namespace == DEFAULT_NAMESPACE else "")
            raise RegistrationError(
                f"op {qualname!r} is already defined{where}; choose another name or "
                f"namespace.{reserved} (tests: use the fresh-registry fixture, which gives "
                f"a unique namespace)",
                op=qualname,
            )

    def _load_catalog(self) -> None:
        if self._catalog is not None:
            self._catalog()

    def get_op(self, name: str) -> Op:
        """The op called ``name`` (``"rms_norm"`` means ``"opmux::rms_norm"``); an op not
        known yet is looked for again after start-up (plugins define theirs then)."""
        qualname = name if "::" in name else f"{DEFAULT_NAMESPACE}::{name}"
        op = self._ops.get(qualname)
        if op is None and qualname.startswith(f"{DEFAULT_NAMESPACE}::"):
            self._load_catalog()
            op = self._ops.get(qualname)
        if op is None and not self.loaded_flag[0]:
            self.ensure_loaded()  # plugins define ops of their own when they load
            op = self._ops.get(qualname)
        if op is None:
            raise UnknownOpError(
                f"no op named {name!r}; registered ops: {sorted(self._ops)} (an op a plugin "
                f"defines exists once that plugin has loaded: `opmux info` shows the "
                f"plugins, and why any failed)"
            )
        return op

    def list_ops(self) -> list[Op]:
        """Every registered op, sorted by qualified name."""
        self._load_catalog()
        return [self._ops[k] for k in sorted(self._ops)]

    def known_ops(self) -> list[Op]:
        """Every op registered so far (the catalog is not imported for it)."""
        with self._lock:
            return list(self._ops.values())

    def forget_op(self, op: Op) -> None:
        """Take ``op`` out of the registry (a plugin's op, rolled back). torch cannot
        undefine one op of a shared library: it stays defined in torch, native only."""
        with self._lock:
            self._ops.pop(op.qualname, None)

    # --------------------------------------------------------------- loading
    def ensure_loaded(self) -> None:
        """Run the start-up ``loader`` unless it has succeeded (thread-safe, re-entrant)."""
        if self.loaded_flag[0] or self._loader is None:
            return
        with self._lock:
            if self.loaded_flag[0] or self._loading_thread == threading.get_ident():
                return  # loaded, or re-entered from a plugin hook while loading
            self._loading_thread = threading.get_ident()
            try:
                loader = self._loader
                if "torch._dynamo" in sys.modules:
                    # The first op call may come from a compiled graph; Dynamo must not
                    # try to trace plugin loading (registration is not traceable).
                    loader = torch._dynamo.disable(loader)
                loader(self)
                # only a start-up that succeeded counts: a fatal error is raised again on
                # the next call, until the configuration is fixed
                self.loaded_flag[0] = True
            finally:
                self._loading_thread = None

    def unload(self) -> None:
        """Mark start-up to run again on the next op call (a reset for tests)."""
        self.loaded_flag[0] = self._loader is None

    def platform_key(self) -> str:
        """The dispatch key providers register on when they name none."""
        return self._platform_key()

    def destroy(self) -> None:
        """Drop every op and destroy this registry's torch libraries (a test registry)."""
        with self._lock:
            for lib in self._libs.values():
                lib._destroy()
            self._libs.clear()
            self._ops.clear()
            self.unload()


def global_registry() -> OpRegistry:
    """The process-wide registry: the catalog's ops and every plugin's providers."""
    return runtime().registry


@overload
def register_op(fn: _F, /) -> Op: ...


@overload
def register_op(*, name: str | None = None, namespace: str = DEFAULT_NAMESPACE,
                mutates_args: Iterable[str] = (), tags: Sequence[torch.Tag] = (),
                registry: OpRegistry | None = None) -> Callable[[Callable[..., Any]], Op]: ...


def register_op(fn: Callable[..., Any] | None = None, /, *, name: str | None = None,
                namespace: str = DEFAULT_NAMESPACE, mutates_args: Iterable[str] = (),
                tags: Sequence[torch.Tag] = (),
                registry: OpRegistry | None = None) -> Op | Callable[[Callable[..., Any]], Op]:
    """Turn a native PyTorch function into an :class:`~opmux.Op` and a torch op.

    Usable bare (``@register_op``) or with arguments (``@register_op(name=...)``). The
    schema is inferred from the annotations; the function becomes the
    ``CompositeExplicitAutograd`` kernel and, until :meth:`Op.register_fake` or
    :meth:`Op.register_meta` says otherwise, the fake kernel too.

    >>> import torch, opmux
    >>> @opmux.register_op(namespace="opmux_doc")
    ... def scale2(x: torch.Tensor) -> torch.Tensor:
    ...     return x * 2
    >>> scale2(torch.ones(2)).tolist()
    [2.0, 2.0]
    >>> str(scale2.torch_op)
    'opmux_doc.scale2.default'

    :param name: op name (default: the function's name).
    :param namespace: torch namespace (default ``"opmux"``).
    :param mutates_args: names of Tensor arguments the op writes in place.
    :param tags: :class:`torch.Tag` values for the schema.
    :param registry: where to register (default: the global registry).
    """
    reg = registry if registry is not None else global_registry()

    def decorator(f: Callable[..., Any]) -> Op:
        return reg.register_op(f, name=name, namespace=namespace, mutates_args=mutates_args,
                               tags=tags)

    if fn is not None:
        return decorator(fn)
    return decorator


def get_op(name: str) -> Op:
    """The op ``name`` from the global registry (the catalog is imported on demand)."""
    return global_registry().get_op(name)


def list_ops() -> list[Op]:
    """Every op of the global registry, the catalog included."""
    return global_registry().list_ops()


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
    current platform's key). ``fake_impl`` gives shapes for ``torch.compile``. Everything
    is validated before the op is defined: a refused call leaves nothing behind and a
    corrected retry works. Catalog op names are reserved in namespace ``opmux``.

    :param op_name: name inside the library's namespace, e.g. ``"my_attention"``.
    :param mutates_args: names of the Tensor arguments written in place.
    :raises RegistrationError: a bad name, torch's own namespace, an unknown dispatch
        key, or a name already defined (catalog names included).
    """
    registry = global_registry()
    lib = target_lib if target_lib is not None else registry.library(DEFAULT_NAMESPACE)
    if lib.ns == DEFAULT_NAMESPACE:
        validate_name("op", op_name)
        registry._load_catalog()
        registry.check_undefined(lib.ns, op_name)
    key = dispatch_key if dispatch_key is not None else registry.platform_key()
    define_custom_op(lib, op_name, op_func, key, mutates_args=mutates_args,
                     fake_impl=fake_impl, tags=tags)
