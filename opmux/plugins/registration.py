"""The registration contract every built-in plugin's provider modules follow.

Each provider module has one entry point, ``register(registry, dispatch_key=...) -> list[str]``:
it registers its providers on the ops ``registry`` holds for the torch dispatch key
``dispatch_key`` and returns the ``"op:provider"`` pairs it registered (the same form as
:attr:`opmux.PluginRecord.providers`). Keyword-only options may follow (the ``mindspore``
provider's ``lazy``). The per-op tables stay in the provider modules (``OPS =
op_table((impl, supports_args), ...)``, keyed by each impl's name); :func:`register_table` turns
one such table into registrations, with the same ``supported`` flag and reason for all of them
(a failed build marks every op).

A predicate must take the op's parameters, but most read only a few of them: :func:`predicate`
builds one with an impl's parameters from a check that names just those it reads. Predicates
are named ``<op>_supports`` (``_<op>_supports`` when private), as the Triton modules and the
example vendor do; the ``cpp`` table (``_<op>_ok``), ``cuda_c`` (abbreviated op names) and
``mindspore`` (``supports_args``) use names of their own.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any, Protocol

from opmux.core.errors import RegistrationError, SignatureMismatchError

if TYPE_CHECKING:
    from opmux.core.op import Op

__all__ = ["Impl", "OpTable", "PlatformLike", "RegistryLike", "find_op", "op_table",
           "predicate", "register_table"]

Impl = tuple[Callable[..., Any], Callable[..., bool] | None]
"""``(impl, supports_args)`` of one op; ``None`` when the provider takes every input."""

OpTable = Mapping[str, Impl]
"""Op name -> :data:`Impl`, the shape of every provider module's table."""


def op_table(*impls: Impl | OpTable) -> dict[str, Impl]:
    """An :data:`OpTable` keyed by each impl's ``__name__`` (the op it serves), in order;
    a mapping argument (another module's table) is merged in at its place.

    :raises RegistrationError: two impls serve the same op.
    """
    table: dict[str, Impl] = {}
    for item in impls:
        rows = item.items() if isinstance(item, Mapping) else ((item[0].__name__, item),)
        for name, row in rows:
            if name in table:
                raise RegistrationError(f"op_table: two impls for op {name!r}; keep one")
            table[name] = row
    return table


class RegistryLike(Protocol):
    """What provider registration needs of a registry (:class:`opmux.OpRegistry` has it)."""

    def list_ops(self) -> list[Op]: ...


class PlatformLike(Protocol):
    """What the built-in plugins' hooks read of a platform (:class:`opmux.Platform` has it)."""

    @property
    def name(self) -> str: ...


def find_op(registry: RegistryLike, name: str) -> Op | None:
    """The op called ``name`` in ``registry``: the catalog's (namespace ``opmux``) first, else
    the only op of that name in another namespace (test registries), else ``None``."""
    return _pick([op for op in registry.list_ops() if op.name == name])


def _pick(matches: list[Op]) -> Op | None:
    for op in matches:
        if op.namespace == "opmux":
            return op
    return matches[0] if len(matches) == 1 else None


def predicate(impl: Callable[..., Any], check: Callable[..., bool]) -> Callable[..., bool]:
    """A ``supports_args`` predicate with ``impl``'s parameters and defaults (native's) that
    returns ``check`` of the arguments ``check`` names, passed in ``check``'s order.

    The predicate is a closure wrapping ``impl`` (``__wrapped__``: its signature is
    ``impl``'s, which registration checks); the dispatcher passes every argument by
    position, leaving out trailing arguments equal to their defaults (filled in from
    ``impl``'s), so a call picks ``check``'s arguments by index, and binds them only when a
    caller passed keywords (the torch wrap off).

    :raises SignatureMismatchError: ``check`` names a parameter ``impl`` lacks, or either is
        not a plain function.
    """
    try:
        code, inner = impl.__code__, check.__code__
    except AttributeError as exc:
        raise SignatureMismatchError(f"predicate: {impl!r} and {check!r} must be plain "
                                     f"functions") from exc
    params = code.co_varnames[:code.co_argcount]
    wanted = inner.co_varnames[:inner.co_argcount]
    unknown = [p for p in wanted if p not in params]
    if unknown or "_check" in params or code.co_kwonlyargcount or code.co_flags & 0x0C:
        raise SignatureMismatchError(
            f"predicate: {check.__qualname__} reads {unknown or list(wanted)}, which must be "
            f"among the plain parameters {list(params)} of {impl.__qualname__}")
    picks = tuple(params.index(p) for p in wanted)
    count = len(params)
    defaults = impl.__defaults__ or ()
    fewest = count - len(defaults)

    signature: list[inspect.Signature] = []  # impl's, built on the first call that binds

    def supports(*args: Any, **kwargs: Any) -> bool:
        if kwargs or len(args) != count:
            if not kwargs and fewest <= len(args) < count:
                # the torch dispatcher leaves out trailing arguments equal to their defaults
                args += defaults[len(args) - count:]
            else:  # keywords (the torch wrap off)
                if not signature:
                    signature.append(inspect.signature(impl))
                bound = signature[0].bind(*args, **kwargs)
                bound.apply_defaults()
                args = tuple(bound.arguments.values())
        return check(*[args[i] for i in picks])

    supports.__name__ = supports.__qualname__ = f"_{impl.__name__}_supports"
    supports.__module__ = impl.__module__
    # inspect.signature follows __wrapped__ (impl's parameters, built only when asked);
    # registration compares impl's code with native's instead, sparing start-up the
    # signatures (benchmarks/startup.py)
    supports.__wrapped__ = impl  # type: ignore[attr-defined]
    return supports


def register_table(registry: RegistryLike, provider: str, dispatch_key: str, table: OpTable,
                   *, supported: bool = True, reason: str | None = None) -> list[str]:
    """Register ``provider`` for every op of ``table`` that ``registry`` holds.

    :param registry: where the ops are looked up (:func:`find_op`); ops it lacks are skipped.
    :param provider: the provider name.
    :param dispatch_key: the torch dispatch key served.
    :param table: op name -> ``(impl, supports_args)``.
    :param supported: the static availability of every impl (e.g. the build outcome).
    :param reason: why they are unsupported (shown by ``explain`` and ``opmux info``).
    :returns: the ``"op:provider"`` pairs registered, in table order.
    """
    by_name: dict[str, list[Op]] = {}
    for op in registry.list_ops():  # listed once: find_op for each name of the table
        by_name.setdefault(op.name, []).append(op)
    done: list[str] = []
    for name, (fn, predicate) in table.items():
        found = _pick(by_name.get(name, []))
        if found is None:
            continue
        found.register_impl(provider, dispatch_key=dispatch_key, supported=supported,
                         supports_args=predicate, reason=reason)(fn)
        done.append(f"{name}:{provider}")
    return done
