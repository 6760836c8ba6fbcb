"""Per-key selection: what an op's kernel walks on every call (the dispatch hot path).

A :class:`KeyChain` holds the providers of one dispatch key in priority order, and what the
walk reads as one :data:`Selection` ``(walk, then)``: ``walk`` the ``(supports_args, fn)``
of the providers before the first one that accepts every call, ``then`` that provider (or
native when every provider has a predicate). When ``walk`` is empty and no size buckets
are set, ``only`` holds ``then``: the call is then one attribute read and one call. When a
tuned table gives the op a different order per size bucket, ``sized`` holds one selection
per bucket (the bit length of the first argument's ``numel()``, so picking one is an index).

The walk is :meth:`KeyChain.pick`: ``Op.dispatch``, ``Op.explain`` and the provider tally
use it. The torch kernel (:func:`make_kernel`) and the wrap-off call (:func:`make_eager`) run
the same walk written inline over :data:`Selection`, so that a call costs one Python frame
for the selection (``benchmarks/dispatch_overhead.py``); ``tests/core/test_op.py`` checks
that they choose alike. A predicate that raises declines the call and warns once per (op,
provider).

A chain is replaced in one attribute assignment per field (``only`` cleared first and set
last), and each field is read once per call, so a call sees either the old or the new
selection, never a mix that runs a provider the priority excludes.

THE KERNELS ARE THE HOT PATH: no logging, no string work, no signature binding, no
allocation beyond Python's own call frames.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Final, final

import torch

if TYPE_CHECKING:
    from opmux.core.op import OpImpl

__all__ = ["SIZE_BUCKETS", "KeyChain", "Pairs", "Selection", "bucket_of", "make_eager",
           "make_kernel"]

SIZE_BUCKETS: Final = 64
"""Size buckets: bucket ``b`` holds calls whose first argument has ``numel().bit_length() == b``
(``numel`` in ``[2**(b-1), 2**b)``; bucket 0 is an empty tensor)."""

Pairs = tuple[tuple[Callable[..., bool], Callable[..., Any]], ...]
"""``(supports_args, fn)`` of providers with a predicate, in priority order."""

Selection = tuple[Pairs, Callable[..., Any]]
"""``(walk, then)``: try each of ``walk`` in order, else call ``then``."""


def bucket_of(numel: int) -> int:
    """The size bucket of a first argument with ``numel`` elements."""
    return int(numel).bit_length()


@final
class KeyChain:
    """The providers of one dispatch key, in priority order (a mutable holder)."""

    __slots__ = ("key", "native", "only", "qualname", "sel", "sized", "sized_walks", "walk",
                 "warned")

    def __init__(self, key: str, native: Callable[..., Any], qualname: str = "") -> None:
        #: the torch dispatch key, e.g. ``"CPU"``.
        self.key = key
        #: the op's ``namespace::name`` (for the warning of a raising predicate).
        self.qualname = qualname
        #: providers whose predicate raised and was reported.
        self.warned: set[str] = set()
        #: what runs when no provider takes a call.
        self.native = native
        #: ``(chain, fns)``: the providers in priority order and what each runs (its fn,
        #: traced or output-checked when asked), one field so that a reader sees one pair.
        self.walk: tuple[tuple[OpImpl, ...], tuple[Callable[..., Any], ...]] = ((), ())
        #: what the walk reads when no size buckets are set.
        self.sel: Selection = ((), native)
        #: per size bucket selections (a tuned table with different orders), else ``None``.
        self.sized: tuple[Selection, ...] | None = None
        #: per size bucket ``(chain, fns)`` (for :meth:`pick` and ``explain``), else ``None``.
        self.sized_walks: tuple[tuple[tuple[OpImpl, ...], tuple[Callable[..., Any], ...]],
                                ...] | None = None
        #: ``sel``'s ``then`` when its walk is empty and no size buckets are set, else
        #: ``None`` (the kernels' one-read path).
        self.only: Callable[..., Any] | None = native

    def set(self, chain: tuple[OpImpl, ...], fns: tuple[Callable[..., Any], ...],
            sized: list[tuple[tuple[OpImpl, ...], tuple[Callable[..., Any], ...]]] | None
            = None) -> None:
        """Publish a new selection; ``sized`` gives a chain per size bucket (64 entries)."""
        sel = self._selection(chain, fns)
        self.only = None  # calls read it first: cleared before the fields it stands for change
        if sized is None:
            self.sized = None
            self.sized_walks = None
        else:
            self.sized_walks = tuple(sized)
            self.sized = tuple(self._selection(c, f) for c, f in sized)
        self.sel = sel
        self.walk = (chain, fns)
        self.only = sel[1] if not sel[0] and sized is None else None

    @property
    def chain(self) -> tuple[OpImpl, ...]:
        """The providers in priority order (for ``dispatch`` / ``explain``)."""
        return self.walk[0]

    @property
    def fns(self) -> tuple[Callable[..., Any], ...]:
        """What each provider of :attr:`chain` runs."""
        return self.walk[1]

    def chain_for(self, first: Any) -> tuple[OpImpl, ...]:
        """The chain a call whose first argument is ``first`` walks (not the hot path)."""
        walks = self.sized_walks
        if walks is not None and isinstance(first, torch.Tensor):
            return walks[bucket_of(first.numel())][0]
        return self.walk[0]

    def pick(self, args: tuple[Any, ...], kwargs: dict[str, Any]
             ) -> tuple[OpImpl | None, Callable[..., Any]]:
        """The walk: ``(impl, fn)`` of the first provider that takes the call, ``(None,
        native)`` when none does. A predicate that raises declines (see :meth:`declined`)."""
        first = args[0] if args else None
        walks = self.sized_walks
        if walks is not None and isinstance(first, torch.Tensor):
            chain, fns = walks[bucket_of(first.numel())]
        else:
            chain, fns = self.walk
        for impl, fn in zip(chain, fns, strict=True):
            pred = impl.supports_args
            if pred is not None:
                try:
                    if not pred(*args, **kwargs):
                        continue
                except Exception as exc:
                    self.declined(pred, exc)
                    continue
            return impl, fn
        return None, self.native

    def declined(self, pred: Callable[..., bool], exc: Exception) -> None:
        """A predicate raised: the call goes on down the chain; the first time for a
        provider, a :class:`RuntimeWarning` names the op, the provider and the exception."""
        chains = (self.walk[0], *(c for c, _ in self.sized_walks or ()))
        provider = next((i.provider for c in chains for i in c if i.supports_args is pred), "?")
        if provider in self.warned:
            return
        self.warned.add(provider)
        warnings.warn(f"op {self.qualname!r}: supports_args of provider {provider!r} raised "
                      f"{type(exc).__name__}: {exc}; it counts as declining (the next "
                      f"provider runs). Fix the predicate: it must return a bool for every "
                      f"call", RuntimeWarning, stacklevel=3)

    def _selection(self, chain: tuple[OpImpl, ...], fns: tuple[Callable[..., Any], ...]
                   ) -> Selection:
        walk: list[tuple[Callable[..., bool], Callable[..., Any]]] = []
        for impl, fn in zip(chain, fns, strict=True):
            if impl.supports_args is None:
                return tuple(walk), fn
            walk.append((impl.supports_args, fn))
        return tuple(walk), self.native


def make_kernel(name: str, holder: KeyChain, loaded: list[bool],
                ensure_loaded: Callable[[], None]) -> Callable[..., Any]:
    """The torch kernel of one key: runs the first provider of ``holder`` whose
    ``supports_args`` accepts the call (a predicate that raises declines), else native.

    :param loaded: the registry's one-element flag; start-up runs first while it is false.
    """
    tensor = torch.Tensor

    def kernel(*args: Any) -> Any:
        # HOT PATH: the torch dispatcher calls this with every argument positional.
        if not loaded[0]:
            ensure_loaded()
        only = holder.only
        if only is not None:
            return only(*args)
        sized = holder.sized
        if sized is None:
            walk, then = holder.sel
        else:
            first = args[0] if args else None
            walk, then = sized[first.numel().bit_length()] if isinstance(first, tensor) \
                else holder.sel
        for pred, fn in walk:  # KeyChain.pick's walk, inline (module docstring)
            try:
                ok = pred(*args)
            except Exception as exc:
                holder.declined(pred, exc)
                continue
            if ok:
                return fn(*args)
        return then(*args)

    kernel.__name__ = kernel.__qualname__ = name
    return kernel


def make_eager(chains: dict[str, KeyChain], native: Callable[..., Any], torch_op: Any,
               loaded: list[bool], ensure_loaded: Callable[[], None],
               key_of: Callable[[tuple[Any, ...], dict[str, Any]], str]
               ) -> Callable[..., Any]:
    """The call used with the torch wrap off: the key of the first tensor's device, then
    the key's walk (as :meth:`KeyChain.pick`), passing keywords on (under Dynamo tracing it
    calls ``torch_op``, so a compiled graph still sees one node)."""
    tensor = torch.Tensor
    is_compiling = torch.compiler.is_dynamo_compiling

    def eager(*args: Any, **kwargs: Any) -> Any:
        # HOT PATH (torch wrap off): a plain call of the selected provider.
        if is_compiling():
            return torch_op(*args, **kwargs)
        if not loaded[0]:
            ensure_loaded()
        first = args[0] if args else None
        if isinstance(first, tensor) and first.is_cpu:
            key = "CPU"  # Tensor.device builds an object; is_cpu does not
        else:
            key = key_of(args, kwargs)
        holder = chains.get(key)
        if holder is None:
            return native(*args, **kwargs)
        only = holder.only
        if only is not None:
            return only(*args, **kwargs)
        sized = holder.sized
        walk, then = sized[first.numel().bit_length()] \
            if sized is not None and isinstance(first, tensor) else holder.sel
        for pred, fn in walk:  # KeyChain.pick's walk, inline (module docstring)
            try:
                ok = pred(*args, **kwargs)
            except Exception as exc:
                holder.declined(pred, exc)
                continue
            if ok:
                return fn(*args, **kwargs)
        return then(*args, **kwargs)

    return eager
