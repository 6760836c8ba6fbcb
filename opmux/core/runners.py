"""Opaque stateful kernels: a registry of runner objects addressed by integer IDs.

Engines keep kernels that own state (a compiled plan, a workspace, a handle to a
vendor library) in Python objects. A torch op cannot take such an object as an
argument, but it can take an ``int``: :func:`register_runner` hands out an ID, and an
op defined with :func:`register_runner_op` carries ``runner_id: int`` in its schema
and looks the runner up when it executes. Under ``torch.compile`` the op is one opaque
node; the fake computes shapes without touching the runner.

>>> import torch, opmux.core.runners as runners
>>> class Scale:
...     def __init__(self, k):
...         self.k = k
>>> @runners.register_runner_op("doc_scale", namespace="opmux_doc_runner",
...                             fake=lambda runner_id, x: torch.empty_like(x))
... def scale(runner: Scale, x: torch.Tensor) -> torch.Tensor:
...     return x * runner.k
>>> with runners.runner_scope(Scale(3.0)) as rid:
...     scale(rid, torch.ones(2)).tolist()
[3.0, 3.0]

IDs are never reused within a process. Lookup on the execution path is one dict
access; the bookkeeping (locks, tombstones) lives on the registration side.
"""

from __future__ import annotations

import contextlib
import inspect
import itertools
import threading
import weakref
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import TYPE_CHECKING, Any, Final, final

from opmux.core.errors import RegistrationError, SignatureMismatchError, UnknownRunnerError

if TYPE_CHECKING:
    from typing_extensions import Required, TypedDict, Unpack

    from opmux.core.op import Op
    from opmux.core.registry import OpRegistry

    class ObjectOpOptions(TypedDict, total=False):
        """Keyword options of :func:`register_runner_op` and
        :func:`~opmux.core.forward_context.register_layer_op`."""

        fake: Required[Callable[..., Any]]
        """Shape function with the op's parameters (key first); it never sees the object."""
        mutates_args: Iterable[str]
        """Names of Tensor parameters written in place (default: none)."""
        namespace: str
        """Torch namespace of the op (default ``opmux``)."""
        registry: OpRegistry | None
        """Op registry (default: the global one)."""

__all__ = [
    "RunnerRegistry",
    "get_runner",
    "register_runner",
    "register_runner_op",
    "release_runner",
    "runner_registry",
    "runner_scope",
]

TOMBSTONE_LIMIT: Final = 4096
"""How many released or collected runners are remembered for error messages."""

_DESCRIPTION_LIMIT: Final = 120
"""Longest runner repr kept in a tombstone."""

_MISSING: Final = object()


def _describe(obj: object) -> str:
    cls = type(obj)
    try:
        text = repr(obj)
    except Exception:  # a broken __repr__ must not break registration
        text = f"<{cls.__qualname__} object>"
    if len(text) > _DESCRIPTION_LIMIT:
        text = text[: _DESCRIPTION_LIMIT - 3] + "..."
    return f"{cls.__module__}.{cls.__qualname__} {text}"


@final
class RunnerRegistry:
    """Runner objects by integer ID; strong or weak entries; thread-safe registration.

    :param tombstone_limit: how many forgotten IDs keep a description for errors.
    """

    __slots__ = (
        "__weakref__",
        "_counter",
        "_lock",
        "_strong",
        "_tombstone_limit",
        "_tombstones",
        "_weak",
    )

    def __init__(self, *, tombstone_limit: int = TOMBSTONE_LIMIT) -> None:
        self._lock = threading.RLock()
        self._counter = itertools.count(1)
        #: id → runner, read on the execution path (plain dict access).
        self._strong: dict[int, Any] = {}
        #: id → (weak reference, description), for ``weak=True`` entries.
        self._weak: dict[int, tuple[weakref.ref[Any], str]] = {}
        #: id → "description (released|collected)", bounded, oldest dropped first.
        self._tombstones: OrderedDict[int, str] = OrderedDict()
        self._tombstone_limit = tombstone_limit

    # ---------------------------------------------------------------- register
    def register(self, obj: object, *, weak: bool = False) -> int:
        """Register ``obj`` and return its new ID (never 0, never reused).

        :param weak: hold ``obj`` through a weak reference: the entry disappears when the
            object is garbage collected (its ID then reads as "collected" in errors).
        :raises RegistrationError: ``obj`` is ``None``, or ``weak=True`` and ``obj``
            cannot be weakly referenced.
        """
        if obj is None:
            raise RegistrationError("register_runner(None): a runner must be an object")
        if not weak:
            with self._lock:
                rid = next(self._counter)
                self._strong[rid] = obj
            return rid
        description = _describe(obj)
        with self._lock:
            rid = next(self._counter)
            try:
                ref = weakref.ref(obj, self._collected_callback(rid))
            except TypeError as exc:
                raise RegistrationError(
                    f"register_runner({description}, weak=True): objects of type "
                    f"{type(obj).__qualname__!r} cannot be weakly referenced; add "
                    f"'__weakref__' to its __slots__ or register it with weak=False"
                ) from exc
            self._weak[rid] = (ref, description)
        return rid

    def _collected_callback(self, rid: int) -> Callable[[weakref.ref[Any]], None]:
        owner = weakref.ref(self)

        def collected(_ref: weakref.ref[Any]) -> None:
            # Runs inside the garbage collector, possibly on a thread that holds the
            # lock already (hence RLock); dict.pop is atomic under the GIL anyway.
            registry = owner()
            if registry is None:
                return
            with registry._lock:
                entry = registry._weak.pop(rid, None)
                if entry is not None:
                    registry._bury(rid, f"{entry[1]} (collected)")

        return collected

    def _bury(self, rid: int, text: str) -> None:
        tombstones = self._tombstones
        tombstones[rid] = text
        while len(tombstones) > self._tombstone_limit:
            tombstones.popitem(last=False)

    # ------------------------------------------------------------------ lookup
    def get(self, rid: int) -> Any:
        """The runner registered as ``rid``.

        :raises UnknownRunnerError: the ID was never issued, was released, or its weak
            runner was collected; the message says which and what it was.
        """
        # HOT PATH: one dict access for strong entries.
        try:
            return self._strong[rid]
        except KeyError:
            pass
        entry = self._weak.get(rid)
        if entry is not None:
            obj = entry[0]()
            if obj is not None:
                return obj
        raise self._unknown(rid)

    def _unknown(self, rid: object) -> UnknownRunnerError:
        with self._lock:
            past = self._tombstones.get(rid) if isinstance(rid, int) else None
            live = len(self._strong) + len(self._weak)
        if past is not None:
            return UnknownRunnerError(
                f"runner id {rid!r} is no longer registered: it was {past}; register the "
                f"runner again (register_runner) and use the new id"
            )
        return UnknownRunnerError(
            f"unknown runner id {rid!r}: no runner was ever registered under it here "
            f"({live} live runner(s)); use the id returned by register_runner"
        )

    def __contains__(self, rid: object) -> bool:
        if rid in self._strong:
            return True
        entry = self._weak.get(rid)  # type: ignore[call-overload]
        return entry is not None and entry[0]() is not None

    def __len__(self) -> int:
        return len(self._strong) + len(self._weak)

    # ----------------------------------------------------------------- release
    def release(self, rid: int) -> None:
        """Forget ``rid`` (later lookups raise, naming what it was).

        :raises UnknownRunnerError: ``rid`` is not registered (never was, or already
            released or collected).
        """
        with self._lock:
            obj = self._strong.pop(rid, None)
            if obj is not None:
                self._bury(rid, f"{_describe(obj)} (released)")
                return
            entry = self._weak.pop(rid, None)
            if entry is not None:
                self._bury(rid, f"{entry[1]} (released)")
                return
        raise self._unknown(rid)

    @contextlib.contextmanager
    def scope(self, obj: object, *, weak: bool = False) -> Iterator[int]:
        """Register ``obj`` for the ``with`` block; release it on exit (even on error)."""
        rid = self.register(obj, weak=weak)
        try:
            yield rid
        finally:
            with self._lock:
                still_there = rid in self._strong or rid in self._weak
            if still_there:
                self.release(rid)

    def clear(self) -> None:
        """Forget every runner and tombstone (IDs keep counting up: never reused)."""
        with self._lock:
            self._strong.clear()
            self._weak.clear()
            self._tombstones.clear()


#: a module global, not a field of the runtime object: runner ops keep its table from
#: registration and read it on every call (the hot path), so a reset clears it in place
_GLOBAL: Final = RunnerRegistry()


def runner_registry() -> RunnerRegistry:
    """The process-wide runner registry that runner ops read."""
    return _GLOBAL


def register_runner(obj: object, *, weak: bool = False) -> int:
    """Register ``obj`` in the global runner registry; see :meth:`RunnerRegistry.register`."""
    return _GLOBAL.register(obj, weak=weak)


def get_runner(rid: int) -> Any:
    """The runner registered as ``rid``; see :meth:`RunnerRegistry.get`."""
    return _GLOBAL.get(rid)


def release_runner(rid: int) -> None:
    """Release ``rid``; see :meth:`RunnerRegistry.release`."""
    _GLOBAL.release(rid)


def runner_scope(obj: object, *, weak: bool = False) -> contextlib.AbstractContextManager[int]:
    """``with runner_scope(obj) as rid:`` registers ``obj`` for the block."""
    return _GLOBAL.scope(obj, weak=weak)


# ------------------------------------------------------------ object-keyed ops
_OPTIONS: Final = ("fake", "mutates_args", "namespace", "registry")
"""The keys of ``ObjectOpOptions``, for the check made when a decorator is built."""


def _check_options(where: str, options: Mapping[str, Any]) -> None:
    """Refuse unknown or missing keyword options of ``where`` when the decorator is built."""
    unknown = sorted(set(options) - set(_OPTIONS))
    if unknown or "fake" not in options:
        what = f"unknown option(s) {unknown}" if unknown else "no fake= given"
        raise SignatureMismatchError(
            f"{where}: {what}; pass fake= (a shape function with the op's parameters) and "
            f"optionally {', '.join(_OPTIONS[1:])}")


def _object_op(
    fn: Callable[..., Any],
    *,
    name: str | None,
    key_name: str,
    key_type: type,
    table: dict[Any, Any] | None,
    resolve: Callable[[Any], Any],
    fake: Callable[..., Any],
    mutates_args: Iterable[str] = (),
    namespace: str = "opmux",
    registry: OpRegistry | None = None,
) -> Op:
    """Define an op whose first parameter is an object resolved from a key at run time.

    ``fn(obj, *rest)`` becomes an op ``(key_name: key_type, *rest)``; its kernel calls
    ``fn(table[key], *rest)``, or ``fn(resolve(key), *rest)`` when ``table`` lacks the
    key (``resolve`` raises the helpful error or finds the object elsewhere). Shared by
    runner ops (``runner_id: int``) and layer ops (``layer_name: str``).
    """
    from opmux.core.registry import register_op

    op_name = name if name is not None else fn.__name__
    qualname = f"{namespace}::{op_name}"
    try:
        sig = inspect.signature(fn, eval_str=True)
    except (NameError, TypeError) as exc:
        raise SignatureMismatchError(
            f"op {qualname!r}: cannot read the signature of {fn.__qualname__} ({exc}); "
            f"make every annotation importable at module scope", op=qualname) from exc
    params = list(sig.parameters.values())
    if not params or params[0].kind not in (params[0].POSITIONAL_ONLY,
                                            params[0].POSITIONAL_OR_KEYWORD):
        raise SignatureMismatchError(
            f"op {qualname!r}: {fn.__qualname__} must take the resolved object as its first "
            f"positional parameter, e.g. def {op_name}(runner, x: Tensor) -> Tensor; got "
            f"{sig}", op=qualname)
    clash = [p.name for p in params[1:] if p.name == key_name]
    if clash:
        raise SignatureMismatchError(
            f"op {qualname!r}: parameter name {key_name!r} is reserved for the op's first "
            f"argument; rename the parameter of {fn.__qualname__}", op=qualname)
    op_sig = sig.replace(parameters=[
        inspect.Parameter(key_name, inspect.Parameter.POSITIONAL_OR_KEYWORD,
                          annotation=key_type),
        *params[1:],
    ])
    _check_fake(fake, op_sig, qualname)

    if table is not None:
        found = table

        def kernel(key: Any = _MISSING, /, *args: Any, **kwargs: Any) -> Any:
            # HOT PATH: one dict access for the key, then fn.
            if kwargs:  # only with the torch wrap off and keyword arguments
                key, args, kwargs = _rebind(op_sig, key, args, kwargs)
            try:
                obj = found[key]
            except KeyError:
                obj = resolve(key)
            return fn(obj, *args, **kwargs)
    else:

        def kernel(key: Any = _MISSING, /, *args: Any, **kwargs: Any) -> Any:
            # HOT PATH: resolve the key, then fn.
            if kwargs:
                key, args, kwargs = _rebind(op_sig, key, args, kwargs)
            return fn(resolve(key), *args, **kwargs)

    kernel.__signature__ = op_sig  # type: ignore[attr-defined]
    kernel.__name__ = op_name
    kernel.__qualname__ = fn.__qualname__
    kernel.__doc__ = fn.__doc__
    kernel.__module__ = fn.__module__
    op = register_op(name=op_name, namespace=namespace, mutates_args=mutates_args,
                     registry=registry)(kernel)
    op.register_fake(fake)
    return op


def _rebind(sig: inspect.Signature, key: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
            ) -> tuple[Any, tuple[Any, ...], dict[str, Any]]:
    bound = sig.bind(*(() if key is _MISSING else (key,)), *args, **kwargs)
    return bound.args[0], bound.args[1:], bound.kwargs


def _check_fake(fake: Callable[..., Any], op_sig: inspect.Signature, qualname: str) -> None:
    try:
        fake_sig = inspect.signature(fake)
    except (TypeError, ValueError) as exc:
        raise SignatureMismatchError(
            f"op {qualname!r}: the fake has no inspectable signature ({exc})",
            op=qualname) from exc
    want = list(op_sig.parameters)
    got = list(fake_sig.parameters)
    if got != want:
        raise SignatureMismatchError(
            f"op {qualname!r}: the fake must take the op's parameters {want} (the first is the "
            f"key, not the object: the fake computes shapes without it), got {got}",
            op=qualname)


def register_runner_op(
    name: str | None = None, *, runners: RunnerRegistry | None = None,
    **options: Unpack[ObjectOpOptions],
) -> Callable[[Callable[..., Any]], Op]:
    """Decorator: turn ``fn(runner, x: Tensor, ...)`` into an op ``(runner_id: int, x, ...)``.

    The op's kernel looks ``runner_id`` up in the runner registry when it executes and
    calls ``fn`` with the runner; an unknown or released ID raises
    :class:`~opmux.UnknownRunnerError`. The returned :class:`~opmux.Op` is called with
    the ID: ``op(rid, x)``.

    :param name: op name (default: the function's name).
    :param fake: shape function with the op's parameters, ``(runner_id, x, ...)``; it
        never sees the runner (``torch.compile`` traces with it).
    :param mutates_args: names of Tensor parameters the runner writes in place.
    :param namespace: torch namespace of the op.
    :param registry: op registry (default: the global one).
    :param runners: runner registry to resolve IDs in (default: the global one).
    :raises SignatureMismatchError: ``fn`` has no leading runner parameter, or the fake's
        parameters differ from the op's.
    """
    _check_options("register_runner_op", options)
    table = runners if runners is not None else _GLOBAL

    def decorator(fn: Callable[..., Any]) -> Op:
        return _object_op(fn, name=name, key_name="runner_id", key_type=int,
                          table=table._strong, resolve=table.get, **options)

    return decorator
