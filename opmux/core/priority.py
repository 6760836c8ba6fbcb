"""The one owner of an op's priority state: layers, scopes, tuned buckets, per-key chains.

An op's effective priority comes from *layers* (strongest first: ``code``, ``env``,
``tuned``, ``plugins``, ``platform``) and from open :meth:`Priorities.scope` blocks, which
beat every layer (the newest open scope wins). A layer or scope lists provider names;
``native`` ends every list, and providers listed after it never run.

Priorities are **global** (shared by all threads). Overlapping scopes from several
threads, closed in any order, all unwind to the priority in force before the first one.
Every change rebuilds the per-key :class:`~opmux.core.dispatch.KeyChain` that the dispatch
kernels walk, dropping unsupported providers then (never per call). Only the named methods
of :class:`Priorities` change this state; other modules call them through ``op.priorities``.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any, Final

import torch

from opmux.core.dispatch import SIZE_BUCKETS, KeyChain, bucket_of
from opmux.core.errors import RegistrationError

if TYPE_CHECKING:
    from opmux.core.op import OpImpl

__all__ = ["LAYERS", "NATIVE", "Priorities"]

NATIVE: Final = "native"
"""The reserved provider name of every op's reference implementation."""

LAYERS: Final = ("code", "env", "tuned", "plugins", "platform")
"""Priority sources, strongest first (``tuned``: the table ``opmux tune`` wrote)."""


class Priorities:
    """The priority state of one op, its providers and the chains built from them.

    The owner of the op's providers table (:attr:`impls`) and of the op's lock
    (:attr:`lock`): the op registers and unregisters providers in that table, under that
    lock, and then asks for :meth:`rebuild`.

    :param qualname: the op's ``namespace::name`` (for error messages).
    :param native: the op's native implementation, the first entry of :attr:`impls`.
    :param wrap: turns an :class:`OpImpl` into the callable a chain runs (output checks,
        tracing), called whenever chains are rebuilt.
    """

    def __init__(self, qualname: str, native: OpImpl,
                 wrap: Callable[[OpImpl], Callable[..., Any]]) -> None:
        self._qualname = qualname
        #: the op's providers by name, native first
        self.impls: dict[str, OpImpl] = {NATIVE: native}
        #: guards :attr:`impls` and the priority state (registration and priority changes)
        self.lock = threading.RLock()
        self._impls = self.impls
        self._lock = self.lock
        self._wrap = wrap
        self._layers: dict[str, list[str] | None] = dict.fromkeys(LAYERS)
        #: the tuned layer's order per size bucket (``SIZE_BUCKETS`` lists), or ``None``
        self._tuned_sized: list[list[str]] | None = None
        #: open scopes, oldest first: ``(token, providers)``
        self._scopes: list[tuple[object, list[str]]] = []
        #: the chain of each dispatch key that has providers
        self._chains: dict[str, KeyChain] = {}

    # ------------------------------------------------------------------ reading
    @property
    def chains(self) -> dict[str, KeyChain]:
        """``{dispatch key: KeyChain}`` (the dict the wrap-off call reads; do not mutate)."""
        return self._chains

    def priority(self) -> list[str]:
        """The effective priority list (strongest source wins), ``native`` last."""
        scopes = self._scopes
        if scopes:
            return _with_native(scopes[-1][1])
        for layer in LAYERS:
            value = self._layers[layer]
            if value is not None:
                return _with_native(value)
        return [*(p for p in self._impls if p != NATIVE), NATIVE]

    def source(self) -> str:
        """Which source the effective priority comes from (a scope counts as ``code``)."""
        if self._scopes:
            return "code"
        for layer in LAYERS:
            if self._layers[layer] is not None:
                return layer
        return "registration order"

    def layer(self, name: str) -> list[str] | None:
        """The providers layer ``name`` lists, or ``None`` when it has no opinion."""
        value = self._layers[name]
        return None if value is None else list(value)

    def order_for(self, first: Any) -> list[str]:
        """The priority a call whose first argument is ``first`` uses (tuned size buckets)."""
        sized = self._tuned_sized
        if sized is not None and self.source() == "tuned" and isinstance(first, torch.Tensor):
            return _with_native(sized[bucket_of(first.numel())])
        return self.priority()

    # ----------------------------------------------------------------- changing
    def set_layer(self, layer: str, providers: Sequence[str] | None, *,
                  strict: bool = True) -> None:
        """Set one layer (``None``: no opinion).

        :param strict: raise for provider names the op lacks; otherwise drop them, and a
            list naming none of the op's providers counts as no opinion.
        :raises RegistrationError: an unknown layer, or (``strict``) an unknown provider.
        """
        if layer not in self._layers:
            raise RegistrationError(f"op {self._qualname!r}: unknown priority layer {layer!r}; "
                                    f"layers: {list(LAYERS)}", op=self._qualname)
        with self._lock:
            value = None if providers is None else self.check(providers, strict=strict)
            if value == self._layers[layer] and layer != "tuned":
                return  # start-up sets every layer of every op: most change nothing
            self._layers[layer] = value
            self.rebuild()

    def set_tuned(self, order: Sequence[str] | None,
                  sized: Sequence[Sequence[str]] | None = None) -> None:
        """Set the ``tuned`` layer: one order, and optionally one per size bucket."""
        if sized is not None and len(sized) != SIZE_BUCKETS:
            raise RegistrationError(f"op {self._qualname!r}: a tuned order per size bucket "
                                    f"needs {SIZE_BUCKETS} entries, got {len(sized)}",
                                    op=self._qualname)
        with self._lock:
            self._tuned_sized = None if sized is None else [
                self.check(o, strict=False) or [NATIVE] for o in sized]
            self.set_layer("tuned", order, strict=False)

    @contextlib.contextmanager
    def scope(self, providers: Sequence[str]) -> Iterator[None]:
        """A scoped priority: the newest open scope wins; on exit this scope's entry leaves."""
        token = object()
        with self._lock:
            names = self.check(providers, strict=True)
            assert names is not None  # strict checks never answer "no opinion"
            self._scopes.append((token, names))
            self.rebuild()
        try:
            yield
        finally:
            with self._lock:
                self._scopes[:] = [entry for entry in self._scopes if entry[0] is not token]
                self.rebuild()

    def reset(self) -> None:
        """Forget every layer, tuned bucket and open scope."""
        with self._lock:
            self._layers = dict.fromkeys(LAYERS)
            self._tuned_sized = None
            self._scopes.clear()
            self.rebuild()

    def check(self, providers: Sequence[str], *, strict: bool) -> list[str] | None:
        """Validated, de-duplicated provider list (``None``: a default with no opinion)."""
        if isinstance(providers, (str, bytes)) or not isinstance(providers, Sequence):
            raise RegistrationError(
                f"op {self._qualname!r}: a priority is a list of provider names, got "
                f"{providers!r}" + (f"; did you mean [{providers!r}]?"
                                     if isinstance(providers, str) else ""),
                op=self._qualname)
        names = list(providers)
        unknown = [p for p in names if p not in self._impls]
        if unknown and strict:
            raise RegistrationError(
                f"op {self._qualname!r}: unknown provider(s) {unknown} in priority "
                f"{names}; registered providers: {sorted(self._impls)}",
                op=self._qualname, provider=str(unknown[0]),
            )
        kept = [p for p in dict.fromkeys(names) if p in self._impls]
        # a default naming none of our providers is no opinion, not "native only"
        return None if not strict and not any(p != NATIVE for p in kept) else kept

    # ------------------------------------------------------------------ chains
    def add_key(self, key: str, native: Callable[..., Any]) -> tuple[KeyChain, bool]:
        """The chain of ``key``, and whether it was created now (its kernel is then due);
        ``native`` is what a new chain runs when no provider takes a call."""
        with self._lock:
            holder = self._chains.get(key)
            if holder is not None:
                return holder, False
            holder = self._chains[key] = KeyChain(key, native, self._qualname)
            return holder, True

    def rebuild(self) -> None:
        """Recompute every key's chain from the priority and the providers."""
        with self._lock:
            order = self.priority()
            sized = self._tuned_sized if self.source() == "tuned" else None
            for key, holder in self._chains.items():
                chain = self._chain(order, key)
                per_bucket = None
                if sized is not None:
                    built: dict[tuple[str, ...], tuple[Any, Any]] = {}
                    per_bucket = []
                    for names in sized:
                        entry = built.get(tuple(names))
                        if entry is None:
                            c = self._chain(names, key)
                            entry = built[tuple(names)] = (c, self._fns(c))
                        per_bucket.append(entry)
                holder.set(chain, self._fns(chain), per_bucket)

    def _fns(self, chain: tuple[OpImpl, ...]) -> tuple[Callable[..., Any], ...]:
        return tuple(self._wrap(impl) for impl in chain)

    def _chain(self, order: list[str], key: str) -> tuple[OpImpl, ...]:
        # providers after native never run: native wins where it is listed first
        if NATIVE in order:
            order = order[:order.index(NATIVE)]
        return tuple(impl for name in order
                     if (impl := self._impls.get(name)) is not None
                     and impl.dispatch_key == key and impl.supported)


def _with_native(order: list[str]) -> list[str]:
    return order if NATIVE in order else [*order, NATIVE]
