"""Ops and their providers: registration, priority, and the dispatch hot path.

An :class:`Op` is one ``torch.ops.<namespace>.<name>`` operator defined from a native
(pure PyTorch) reference. Providers are alternative implementations, each bound to one
dispatch key. For every key that has providers, one kernel is registered on the torch op;
that kernel walks the key's *chain* (the supported providers of that key, in priority
order), runs the first whose ``supports_args`` accepts the arguments, and falls back to
native. Chains are recomputed when priorities or providers change, never per call.

Priorities are **global** (shared by all threads): ``set_priority`` is a scoped
override that restores the previous value on exit; concurrent scoped overrides of the
same op from several threads are not isolated from each other. Each chain is swapped in
one attribute assignment, so a call always sees either the old or the new chain.
"""

from __future__ import annotations

import contextlib
import inspect
import threading
import weakref
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any, Final, final

import torch

from opmux.core.errors import RegistrationError, SignatureMismatchError
from opmux.core.torch_lib import infer_schema, validate_dispatch_key, validate_name

if TYPE_CHECKING:
    from opmux.core.registry import OpRegistry

__all__ = ["NATIVE", "Op", "OpImpl", "enable_torch_wrap", "torch_wrap_enabled"]

NATIVE: Final = "native"
"""The reserved provider name of every op's reference implementation."""

RESERVED_PROVIDERS: Final = frozenset({NATIVE})
"""Provider names no plugin may register."""

_NATIVE_KEY: Final = "CompositeExplicitAutograd"

#: device type → dispatch key, used when the torch dispatcher is bypassed.
DEVICE_TYPE_TO_KEY: Final[dict[str, str]] = {
    "cpu": "CPU",
    "cuda": "CUDA",
    "xla": "XLA",
    "meta": "Meta",
    "mps": "MPS",
    "xpu": "XPU",
    "hpu": "HPU",
    "npu": "PrivateUse1",
    "privateuseone": "PrivateUse1",
}

#: The torch-wrap switch; a one-element list so the hot path reads it without a lookup
#: of a module global that a ``global`` statement rebinds.
_WRAP: list[bool] = [True]
_WRAP_LOCK = threading.Lock()
_ALL_OPS: weakref.WeakSet[Op] = weakref.WeakSet()


def torch_wrap_enabled() -> bool:
    """Whether op calls go through the torch dispatcher (the default)."""
    return _WRAP[0]


@contextlib.contextmanager
def enable_torch_wrap(enabled: bool = True) -> Iterator[None]:
    """Route op calls through the torch dispatcher (``True``) or bypass it (``False``).

    With the wrap off, calling an op maps the device type of its first tensor argument
    to a dispatch key and runs the same provider selection in Python: a plain call of
    the chosen provider. Under ``torch.compile`` the dispatcher is always used. The
    switch is process-wide; the previous value is restored on exit.
    """
    with _WRAP_LOCK:
        previous = _WRAP[0]
        _set_wrap(bool(enabled))
    try:
        yield
    finally:
        with _WRAP_LOCK:
            _set_wrap(previous)


def _set_wrap(enabled: bool) -> None:
    _WRAP[0] = enabled
    for op in list(_ALL_OPS):
        op._install_call(enabled)


@final
class OpImpl:
    """One implementation of an op: the native reference or a provider.

    Calling an ``OpImpl`` calls its function directly (no dispatch).
    """

    __slots__ = ("dispatch_key", "fn", "op_name", "provider", "reason", "supported",
                 "supports_args")

    def __init__(self, op_name: str, provider: str, dispatch_key: str, fn: Callable[..., Any],
                 supported: bool, supports_args: Callable[..., bool] | None,
                 reason: str | None = None) -> None:
        #: qualified name of the op, ``namespace::name``.
        self.op_name = op_name
        #: provider name (``"native"`` for the reference).
        self.provider = provider
        #: the dispatch key this implementation serves.
        self.dispatch_key = dispatch_key
        #: the implementation itself.
        self.fn = fn
        #: static availability (library or hardware present).
        self.supported = supported
        #: per-call predicate over the op's arguments, or ``None`` (accepts all).
        self.supports_args = supports_args
        #: why the provider is unsupported, when it is.
        self.reason = reason

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.fn(*args, **kwargs)

    def __repr__(self) -> str:
        flag = "" if self.supported else ", unsupported"
        return f"OpImpl({self.op_name}, provider={self.provider!r}, key={self.dispatch_key}{flag})"


@final
class _KeyChain:
    """The providers of one dispatch key, in priority order (mutable holder)."""

    __slots__ = ("chain", "direct", "key", "pairs")

    def __init__(self, key: str) -> None:
        self.key = key
        self.chain: tuple[OpImpl, ...] = ()
        #: ``(supports_args, fn)`` of each chain entry: what the hot path reads.
        self.pairs: tuple[tuple[Callable[..., bool] | None, Callable[..., Any]], ...] = ()
        #: the first provider's function when it takes every call (no ``supports_args``)
        self.direct: Callable[..., Any] | None = None

    def set(self, chain: tuple[OpImpl, ...]) -> None:
        # readers see either the old or the new selection, never a mix: clear the shortcut,
        # publish the pairs, then the new shortcut
        self.direct = None
        self.pairs = tuple((impl.supports_args, impl.fn) for impl in chain)
        self.chain = chain
        if chain and chain[0].supports_args is None:
            self.direct = chain[0].fn


_LAYERS: Final = ("code", "env", "plugins", "platform")
"""Priority sources, strongest first."""


class Op:
    """A registered op. Call it like its native function.

    :ivar name: the op name, e.g. ``"rms_norm"``.
    :ivar namespace: the torch namespace, e.g. ``"opmux"``.
    :ivar torch_op: the ``torch.ops.<namespace>.<name>.default`` overload.
    """

    def __init__(self, registry: OpRegistry, name: str, namespace: str, native: Callable[..., Any],
                 schema: str, mutates_args: tuple[str, ...]) -> None:
        self.name = name
        self.namespace = namespace
        self.qualname = f"{namespace}::{name}"
        self.native = native
        self.schema = schema
        self.mutates_args = mutates_args
        self.signature = inspect.signature(native)
        self.__doc__ = native.__doc__
        self.__wrapped__ = native
        self._registry = registry
        self._lock = threading.RLock()
        self._native_impl = OpImpl(self.qualname, NATIVE, _NATIVE_KEY, native, True, None)
        self._impls: dict[str, OpImpl] = {NATIVE: self._native_impl}
        self._chains: dict[str, _KeyChain] = {}
        self._layers: dict[str, list[str] | None] = dict.fromkeys(_LAYERS)
        self._fake: Callable[..., Any] = native
        self.torch_op: torch._ops.OpOverload = getattr(getattr(torch.ops, namespace), name).default
        self._eager = self._build_eager()
        # a class of its own, so __call__ can be the OpOverload itself (see _install_call)
        self.__class__ = type("Op", (type(self),), {"__module__": "opmux"})
        self._install_call(_WRAP[0])
        _ALL_OPS.add(self)

    # ------------------------------------------------------------------ calling
    # Each Op gets its own subclass whose ``__call__`` forwards straight to the
    # OpOverload (torch wrap on) or to the eager-selection closure (wrap off), with no
    # flag test per call; ``enable_torch_wrap`` swaps them. It stays a plain function so
    # that Dynamo inlines it.
    def __call__(self, *args: Any, **kwargs: Any) -> Any:  # replaced per instance class
        return self.torch_op(*args, **kwargs)

    def _install_call(self, wrap: bool) -> None:
        if not wrap:
            setattr(type(self), "__call__", self._eager)  # noqa: B010
            return
        target = self.torch_op

        def __call__(_self: Any, *args: Any, **kwargs: Any) -> Any:
            return target(*args, **kwargs)

        setattr(type(self), "__call__", __call__)  # noqa: B010

    def _build_eager(self) -> Callable[..., Any]:
        chains = self._chains
        native = self.native
        torch_op = self.torch_op
        loaded = self._registry._loaded
        ensure_loaded = self._registry._ensure_loaded
        # Dynamo evaluates this as True while tracing; plain calls get a constant False
        is_compiling = torch.compiler.is_dynamo_compiling
        keymap = DEVICE_TYPE_TO_KEY
        tensor = torch.Tensor

        def eager(_self: Any, *args: Any, **kwargs: Any) -> Any:
            # HOT PATH (torch wrap off): a plain call of the selected provider. Installed as
            # the op class's __call__ (hence _self).
            if is_compiling():
                return torch_op(*args, **kwargs)
            if not loaded[0]:
                ensure_loaded()
            first = args[0] if args else None
            if isinstance(first, tensor):
                # is_cpu / is_cuda are cheap; Tensor.device builds an object (≈1 µs)
                key = "CPU" if first.is_cpu else "CUDA" if first.is_cuda else keymap.get(
                    first.device.type, "PrivateUse1")
            else:
                key = _key_of(args, kwargs)
            holder = chains.get(key)
            if holder is not None:
                direct = holder.direct
                if direct is not None:
                    return direct(*args, **kwargs)
                for pred, fn in holder.pairs:
                    if pred is None or pred(*args, **kwargs):
                        return fn(*args, **kwargs)
            return native(*args, **kwargs)

        return eager

    def _make_kernel(self, holder: _KeyChain) -> Callable[..., Any]:
        native = self.native
        loaded = self._registry._loaded
        ensure_loaded = self._registry._ensure_loaded

        def kernel(*args: Any) -> Any:
            # HOT PATH: the torch dispatcher calls this with every argument positional.
            if not loaded[0]:
                ensure_loaded()
            direct = holder.direct
            if direct is not None:
                return direct(*args)
            for pred, fn in holder.pairs:
                if pred is None or pred(*args):
                    return fn(*args)
            return native(*args)

        kernel.__name__ = f"{self.name}_{holder.key.lower()}_kernel"
        return kernel

    def _meta_kernel(self) -> Callable[..., Any]:
        def kernel(*args: Any) -> Any:
            return self._fake(*args)

        kernel.__name__ = f"{self.name}_meta_kernel"
        return kernel

    def _native_kernel(self) -> Callable[..., Any]:
        native = self.native
        loaded = self._registry._loaded
        ensure_loaded = self._registry._ensure_loaded

        def kernel(*args: Any) -> Any:
            if not loaded[0]:
                # First call of any op: plugins may add a kernel for this device's key,
                # so go round the dispatcher once more after loading.
                ensure_loaded()
                return self.torch_op(*args)
            return native(*args)

        kernel.__name__ = f"{self.name}_native_kernel"
        return kernel

    # ------------------------------------------------------------- selection
    def dispatch(self, *args: Any, **kwargs: Any) -> OpImpl:
        """Return the implementation a call with these arguments would run (no call)."""
        self._registry._ensure_loaded()
        holder = self._chains.get(_key_of(args, kwargs))
        if holder is not None:
            for impl in holder.chain:
                pred = impl.supports_args
                if pred is None or pred(*args, **kwargs):
                    return impl
        return self._native_impl

    def explain(self, *args: Any, **kwargs: Any) -> str:
        """Describe which implementation runs for these arguments and why others don't."""
        self._registry._ensure_loaded()
        key = _key_of(args, kwargs)
        chosen = self.dispatch(*args, **kwargs)
        order = self.priority()
        lines = [f"op {self.qualname} for dispatch key {key}: runs {chosen.provider!r}"]
        for name in [*order, *(p for p in self._impls if p not in order)]:
            impl = self._impls.get(name)
            if impl is None:
                continue
            if impl is chosen:
                verdict = "chosen"
            elif impl.provider == NATIVE:
                verdict = "not reached (an earlier provider was chosen)"
            elif name not in order:
                verdict = "skipped: not in the priority list " + str(order)
            elif not impl.supported:
                verdict = f"skipped: unsupported ({impl.reason or 'supported=False'})"
            elif impl.dispatch_key != key:
                verdict = f"skipped: serves dispatch key {impl.dispatch_key}, not {key}"
            elif impl.supports_args is not None and not _safe_pred(impl, args, kwargs):
                verdict = "skipped: supports_args rejected these arguments"
            else:
                verdict = "not reached (an earlier provider was chosen)"
            lines.append(f"  {name:<12} [{impl.dispatch_key}] {verdict}")
        return "\n".join(lines)

    @property
    def impls(self) -> dict[str, OpImpl]:
        """``{provider: OpImpl}``, native included (a copy)."""
        return dict(self._impls)

    def supported_providers(self) -> list[str]:
        """Names of the providers that are supported here, in registration order."""
        return [name for name, impl in self._impls.items() if impl.supported]

    def priority(self) -> list[str]:
        """The effective priority list (strongest source wins), native last."""
        for layer in _LAYERS:
            value = self._layers[layer]
            if value is not None:
                return value if NATIVE in value else [*value, NATIVE]
        return [*(p for p in self._impls if p != NATIVE), NATIVE]

    def priority_source(self) -> str:
        """Which source the effective priority comes from."""
        for layer in _LAYERS:
            if self._layers[layer] is not None:
                return layer
        return "registration order"

    def set_default_priority(self, providers: Sequence[str]) -> None:
        """Set the priority permanently (overrides platform, plugin and env defaults).

        :param providers: provider names, first preferred; ``native`` is appended if
            missing. Unsupported providers are dropped from the chains now, not per call.
        :raises RegistrationError: for a provider name the op does not have.
        """
        self._registry._ensure_loaded()
        self._set_layer("code", providers)

    @contextlib.contextmanager
    def set_priority(self, providers: Sequence[str]) -> Iterator[None]:
        """Scoped :meth:`set_default_priority`; the previous priority returns on exit."""
        self._registry._ensure_loaded()
        with self._lock:
            previous = self._layers["code"]
            self._set_layer("code", providers)
        try:
            yield
        finally:
            with self._lock:
                self._layers["code"] = previous
                self._rebuild_chains()

    def _set_layer(self, layer: str, providers: Sequence[str] | None, *,
                   strict: bool = True) -> None:
        with self._lock:
            if providers is None:
                self._layers[layer] = None
            else:
                names = list(providers)
                unknown = [p for p in names if p not in self._impls]
                if unknown and strict:
                    raise RegistrationError(
                        f"op {self.qualname!r}: unknown provider(s) {unknown} in priority "
                        f"{names}; registered providers: {sorted(self._impls)}",
                        op=self.qualname, provider=unknown[0],
                    )
                kept = [p for p in dict.fromkeys(names) if p in self._impls]
                # a default naming none of our providers is no opinion, not "native only"
                no_opinion = not strict and not any(p != NATIVE for p in kept)
                self._layers[layer] = None if no_opinion else kept
            self._rebuild_chains()

    def _rebuild_chains(self) -> None:
        order = self.priority()
        for key, holder in self._chains.items():
            holder.set(tuple(
                impl for name in order
                if (impl := self._impls.get(name)) is not None
                and impl.provider != NATIVE and impl.dispatch_key == key and impl.supported
            ))

    # ---------------------------------------------------------- registration
    def register_impl(
        self,
        provider: str,
        *,
        dispatch_key: str | None = None,
        supported: bool = True,
        supports_args: Callable[..., bool] | None = None,
        reason: str | None = None,
    ) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
        """Decorator registering ``fn`` as provider ``provider`` of this op.

        :param dispatch_key: the torch dispatch key it serves (default: the current
            platform's key).
        :param supported: static availability (library or hardware present). Never read
            environment variables here; use priorities for enablement policy.
        :param supports_args: per-call predicate with native's parameter names and
            defaults, returning whether the provider accepts the arguments.
        :param reason: why the provider is unsupported, shown by ``explain`` and
            ``opmux info``.
        :raises RegistrationError: bad or reserved name, duplicate, unknown key.
        :raises SignatureMismatchError: ``fn`` or ``supports_args`` does not match native.
        """
        validate_name("provider", provider, op=self.qualname)
        if provider in RESERVED_PROVIDERS:
            raise RegistrationError(
                f"op {self.qualname!r}: provider name {provider!r} is reserved for the "
                f"reference implementation; choose another name",
                op=self.qualname, provider=provider,
            )
        if dispatch_key is None:
            from opmux.platforms import current_platform

            dispatch_key = current_platform().dispatch_key
        validate_dispatch_key(dispatch_key, op=self.qualname, provider=provider)
        if supports_args is not None:
            self._check_predicate(provider, supports_args)
        key: str = dispatch_key

        def decorator(fn: Callable[..., Any]) -> Callable[..., Any]:
            self._add_impl(OpImpl(self.qualname, provider, key, fn, bool(supported),
                                  supports_args, reason if not supported else None))
            return fn

        return decorator

    def _add_impl(self, impl: OpImpl) -> None:
        provider = impl.provider
        if provider in self._impls:
            raise RegistrationError(
                f"op {self.qualname!r}: provider {provider!r} is already registered "
                f"(for key {self._impls[provider].dispatch_key}); unregister it first or "
                f"choose another name",
                op=self.qualname, provider=provider,
            )
        got = infer_schema(impl.fn, op=self.qualname, mutates_args=self.mutates_args,
                           what=f"provider {provider!r}")
        if got != self.schema:
            raise SignatureMismatchError(
                f"op {self.qualname!r}: provider {provider!r} has signature {got} but the "
                f"native implementation has {self.schema}; match names, defaults and "
                f"annotations exactly",
                op=self.qualname, provider=provider,
            )
        with self._lock:
            if provider in self._impls:  # lost a race with another registration
                raise RegistrationError(
                    f"op {self.qualname!r}: provider {provider!r} is already registered",
                    op=self.qualname, provider=provider,
                )
            holder = self._chains.get(impl.dispatch_key)
            if holder is None:
                holder = _KeyChain(impl.dispatch_key)
                self._registry._impl_kernel(self, self._make_kernel(holder), impl.dispatch_key)
                self._chains[impl.dispatch_key] = holder
            self._impls[provider] = impl
            self._registry._journal_impl(self, provider)
            self._rebuild_chains()

    def unregister_impl(self, provider: str) -> None:
        """Remove a provider (the torch kernel for its key stays and falls back)."""
        with self._lock:
            if provider == NATIVE or provider not in self._impls:
                raise RegistrationError(
                    f"op {self.qualname!r}: no removable provider {provider!r}; registered: "
                    f"{sorted(p for p in self._impls if p != NATIVE)}",
                    op=self.qualname, provider=provider,
                )
            del self._impls[provider]
            self._rebuild_chains()

    def _check_predicate(self, provider: str, pred: Callable[..., bool]) -> None:
        try:
            sig = inspect.signature(pred)
        except (TypeError, ValueError) as exc:
            raise SignatureMismatchError(
                f"op {self.qualname!r}: supports_args of provider {provider!r} has no "
                f"inspectable signature ({exc}); pass a function or lambda",
                op=self.qualname, provider=provider,
            ) from exc
        want = [(p.name, p.default) for p in self.signature.parameters.values()]
        got = [(p.name, p.default) for p in sig.parameters.values()]
        bad_kind = [p.name for p in sig.parameters.values()
                    if p.kind not in (p.POSITIONAL_OR_KEYWORD, p.POSITIONAL_ONLY)]
        if bad_kind or got != want:
            raise SignatureMismatchError(
                f"op {self.qualname!r}: supports_args of provider {provider!r} must take "
                f"native's parameters {_fmt(want)}, got {_fmt(got)}"
                + (f" (keyword-only/variadic: {bad_kind})" if bad_kind else ""),
                op=self.qualname, provider=provider,
            )

    def register_fake(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        """Replace the fake (meta) implementation used for shapes under tracing.

        It serves FakeTensorMode (as the op's registered fake) and meta-device calls
        (through the op's Meta kernel).
        """
        self._registry._register_fake(self, fn, override=True)
        self._fake = fn
        return fn

    def register_autograd(self, backward: Callable[..., Any], *,
                          setup_context: Callable[..., Any] | None = None) -> None:
        """Give the op a backward (see :func:`torch.library.register_autograd`)."""
        torch.library.register_autograd(self.qualname, backward, setup_context=setup_context,
                                        lib=self._registry.library(self.namespace))

    def __repr__(self) -> str:
        return f"opmux.Op({self.qualname}, providers={sorted(self._impls)})"


def _fmt(params: list[tuple[str, Any]]) -> str:
    parts = [n if d is inspect.Parameter.empty else f"{n}={d!r}" for n, d in params]
    return "(" + ", ".join(parts) + ")"


def _safe_pred(impl: OpImpl, args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    assert impl.supports_args is not None
    return bool(impl.supports_args(*args, **kwargs))


def _key_of(args: tuple[Any, ...], kwargs: dict[str, Any] | None = None) -> str:
    """The dispatch key of the first tensor argument (``CPU`` when there is none)."""
    for a in args:
        if isinstance(a, torch.Tensor):
            return DEVICE_TYPE_TO_KEY.get(a.device.type, "PrivateUse1")
    if kwargs:
        for a in kwargs.values():
            if isinstance(a, torch.Tensor):
                return DEVICE_TYPE_TO_KEY.get(a.device.type, "PrivateUse1")
    return "CPU"
