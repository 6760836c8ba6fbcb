"""Ops and their providers: registration, priority, and the dispatch hot path.

An :class:`Op` is one ``torch.ops.<namespace>.<name>`` operator defined from a native
(pure PyTorch) reference. Providers are alternative implementations, each bound to one
dispatch key. For every key that has providers, one kernel is registered on the torch op;
that kernel walks the key's *chain* (the supported providers of that key, in priority
order), runs the first whose ``supports_args`` accepts the arguments, and falls back to
native. Chains are recomputed when priorities or providers change, never per call.

Priorities are **global** (shared by all threads). ``set_priority`` is a scoped
override: every open scope is an entry on the op's scope stack and the newest entry
wins; a scope removes its own entry on exit, so overlapping scopes from several threads,
closed in any order, all unwind to the priority in force before the first one. Priorities
are set outside ``torch.compile``-d code (a context manager inside a fullgraph region is
not traceable); selection happens when the compiled graph runs. Each chain is swapped in
one attribute assignment, so a call always sees either the old or the new chain.

A ``supports_args`` predicate that raises counts as declining the call (the next
provider, ultimately native, runs and validates the arguments itself); ``explain`` shows
the exception as the reason.
"""

from __future__ import annotations

import contextlib
import inspect
import threading
import types
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any, Final, final

import torch

from opmux.core import switches, trace
from opmux.core._chooser import SIZE_BUCKETS, _KeyChain, bucket_of, make_eager, make_kernel
from opmux.core.errors import RegistrationError, SignatureMismatchError
from opmux.core.output_checks import checked
from opmux.core.switches import _WRAP, enable_torch_wrap, torch_wrap_enabled
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


_LAYERS: Final = ("code", "env", "tuned", "plugins", "platform")
"""Priority sources, strongest first (``tuned``: the table ``opmux tune`` wrote)."""


class Op:
    """A registered op. Call it like its native function.

    :ivar name: the op name, e.g. ``"rms_norm"``.
    :ivar namespace: the torch namespace, e.g. ``"opmux"``.
    :ivar torch_op: the ``torch.ops.<namespace>.<name>.default`` overload.
    """

    def __init__(self, registry: OpRegistry, name: str, namespace: str, native: Callable[..., Any],
                 schema: str, mutates_args: tuple[str, ...],
                 platform_key: Callable[[], str]) -> None:
        self.name = name
        self.namespace = namespace
        self.qualname = f"{namespace}::{name}"
        self.native = native
        self.schema = schema
        self.mutates_args = mutates_args
        self._signature: inspect.Signature | None = None
        self.__doc__ = native.__doc__
        self.__wrapped__ = native
        self._registry = registry
        #: the dispatch key of this process's platform (providers' default key)
        self._platform_key = platform_key
        self._lock = threading.RLock()
        self._native_impl = OpImpl(self.qualname, NATIVE, _NATIVE_KEY, native, True, None)
        self._impls: dict[str, OpImpl] = {NATIVE: self._native_impl}
        self._chains: dict[str, _KeyChain] = {}
        self._layers: dict[str, list[str] | None] = dict.fromkeys(_LAYERS)
        #: the tuned layer's order per size bucket (``SIZE_BUCKETS`` lists), or ``None``
        self._tuned_sized: list[list[str]] | None = None
        #: open ``set_priority`` scopes, oldest first: ``(token, providers)``
        self._scopes: list[tuple[object, list[str]]] = []
        self._fake: Callable[..., Any] = native
        self.torch_op: torch._ops.OpOverload = getattr(getattr(torch.ops, namespace), name).default
        #: the wrap-off ``__call__``, built the first time the wrap is turned off
        self._eager: Callable[..., Any] | None = None
        #: :attr:`eager`, bound to this op (built on first use)
        self._eager_bound: Callable[..., Any] | None = None
        # a class of its own, so __call__ can be the OpOverload itself (see _install_call)
        self.__class__ = type("Op", (type(self),), {"__module__": "opmux"})
        self._install_call(_WRAP[0])
        switches._track(self)

    @property
    def signature(self) -> inspect.Signature:
        """The native function's :class:`inspect.Signature` (built on first use)."""
        sig = self._signature
        if sig is None:
            sig = self._signature = inspect.signature(self.native)
        return sig

    @property
    def eager(self) -> Callable[..., Any]:
        """This op called the way ``enable_torch_wrap(False)`` calls it, whatever the switch
        says: the provider is chosen from the first tensor's device and called directly,
        without a trip through the torch dispatcher (under Dynamo tracing it calls
        :attr:`torch_op`, so a compiled graph still sees one node).

        For engine code that only runs eagerly, such as an attention backend's forward
        outside the compiled graph: it saves the dispatcher's boxing of the arguments (about
        20 us for a 9-argument op on the 2-core machine of the README). As with the wrap off,
        the backward of :meth:`register_autograd` does not apply on this route.
        """
        call = self._eager_bound
        if call is None:
            if torch.compiler.is_dynamo_compiling():
                return self.torch_op  # not built while tracing (the build runs exec)
            call = self._eager_bound = types.MethodType(self._eager_fn(), self)
        return call

    # ------------------------------------------------------------------ calling
    # Each Op gets its own subclass whose ``__call__`` forwards straight to the
    # OpOverload (torch wrap on) or to the eager-selection closure (wrap off), with no
    # flag test per call; ``enable_torch_wrap`` swaps them. It stays a plain function so
    # that Dynamo inlines it.
    def __call__(self, *args: Any, **kwargs: Any) -> Any:  # replaced per instance class
        return self.torch_op(*args, **kwargs)

    def _install_call(self, wrap: bool) -> None:
        if not wrap:
            setattr(type(self), "__call__", self._eager_fn())  # noqa: B010
            return
        target = self.torch_op
        # the overload's own C++ callable: one Python frame less than OpOverload.__call__;
        # Dynamo cannot trace it, so a compiled region calls the overload itself
        raw = target._op
        is_compiling = torch.compiler.is_dynamo_compiling

        def __call__(_self: Any, *args: Any, **kwargs: Any) -> Any:
            if is_compiling():
                return target(*args, **kwargs)
            return raw(*args, **kwargs)

        setattr(type(self), "__call__", __call__)  # noqa: B010

    def _eager_fn(self) -> Callable[..., Any]:
        """The wrap-off ``__call__`` function (built on first use)."""
        eager = self._eager
        if eager is None:
            eager = self._eager = self._build_eager()
        return eager

    def _build_eager(self) -> Callable[..., Any]:
        # Dynamo evaluates is_compiling as True while tracing; plain calls get False
        native = trace.wrap(self.qualname, NATIVE, self.native)  # itself unless OPMUX_TRACE
        return make_eager(self._chains, native, self.torch_op, self._registry._loaded,
                          self._registry._ensure_loaded, torch.compiler.is_dynamo_compiling,
                          DEVICE_TYPE_TO_KEY, _key_of, torch.Tensor)

    def _make_kernel(self, holder: _KeyChain) -> Callable[..., Any]:
        native = trace.wrap(self.qualname, NATIVE, self.native)  # itself unless OPMUX_TRACE
        return make_kernel(f"{self.name}_{holder.key.lower()}_kernel", holder, native,
                           self._registry._loaded, self._registry._ensure_loaded)

    def _meta_kernel(self) -> Callable[..., Any]:
        def kernel(*args: Any) -> Any:
            return self._fake(*args)

        kernel.__name__ = f"{self.name}_meta_kernel"
        return kernel

    def _native_kernel(self) -> Callable[..., Any]:
        native = trace.wrap(self.qualname, NATIVE, self.native)  # itself unless OPMUX_TRACE
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
            first = self._first_arg(args, kwargs)
            for impl in holder.chain_for(first, isinstance(first, torch.Tensor)):
                if impl.supports_args is None or _pred_verdict(impl, args, kwargs) is True:
                    return impl
        return self._native_impl

    def _first_arg(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        if args:
            return args[0]
        first = next(iter(self.signature.parameters), None)
        return kwargs.get(first) if first is not None else None

    def _order_for(self, first: Any) -> list[str]:
        """The priority a call whose first argument is ``first`` uses (tuned size buckets)."""
        sized = self._tuned_sized
        if sized is not None and self.priority_source() == "tuned" \
                and isinstance(first, torch.Tensor):
            order = sized[bucket_of(first.numel())]
            return order if NATIVE in order else [*order, NATIVE]
        return self.priority()

    def explain(self, *args: Any, **kwargs: Any) -> str:
        """Describe which implementation runs for these arguments and why others don't."""
        self._registry._ensure_loaded()
        key = _key_of(args, kwargs)
        chosen = self.dispatch(*args, **kwargs)
        order = self._order_for(self._first_arg(args, kwargs))
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
            elif impl.supports_args is not None and (
                    got := _pred_verdict(impl, args, kwargs)) is not True:
                verdict = ("skipped: supports_args rejected these arguments" if got is False
                           else f"skipped: supports_args raised {got} (counts as declining)")
            elif order.index(name) > order.index(NATIVE):
                verdict = "skipped: native comes first in the priority list"
            else:
                verdict = "not reached (an earlier provider was chosen)"
            lines.append(f"  {name:<12} [{impl.dispatch_key}] {verdict}")
        return "\n".join(lines)

    @property
    def impls(self) -> dict[str, OpImpl]:
        """``{provider: OpImpl}``, native included (a copy; start-up runs first)."""
        self._registry._ensure_loaded()
        return dict(self._impls)

    def supported_providers(self) -> list[str]:
        """Names of the providers that are supported here, in registration order."""
        self._registry._ensure_loaded()
        return [name for name, impl in self._impls.items() if impl.supported]

    def priority(self) -> list[str]:
        """The effective priority list (strongest source wins); native is appended when
        missing, and providers listed after native never run."""
        scopes = self._scopes
        if scopes:
            scoped = scopes[-1][1]
            return scoped if NATIVE in scoped else [*scoped, NATIVE]
        for layer in _LAYERS:
            value = self._layers[layer]
            if value is not None:
                return value if NATIVE in value else [*value, NATIVE]
        return [*(p for p in self._impls if p != NATIVE), NATIVE]

    def priority_source(self) -> str:
        """Which source the effective priority comes from (a scope counts as ``code``)."""
        if self._scopes:
            return "code"
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
        """Scoped priority: the newest open scope wins; on exit this scope's entry leaves.

        Scopes may overlap across threads and close in any order: once all have closed,
        the priority is the one in force before the first opened. Use it outside
        ``torch.compile``-d functions (selection happens when the graph runs).
        """
        self._registry._ensure_loaded()
        token = object()
        with self._lock:
            names = self._check_providers(providers, strict=True)
            assert names is not None
            self._scopes.append((token, names))
            self._rebuild_chains()
        try:
            yield
        finally:
            with self._lock:
                self._scopes[:] = [entry for entry in self._scopes if entry[0] is not token]
                self._rebuild_chains()

    def _check_providers(self, providers: Sequence[str], *, strict: bool) -> list[str] | None:
        """Validated, de-duplicated provider list (``None``: a default with no opinion)."""
        if isinstance(providers, (str, bytes)) or not isinstance(providers, Sequence):
            raise RegistrationError(
                f"op {self.qualname!r}: a priority is a list of provider names, got "
                f"{providers!r}" + (f"; did you mean [{providers!r}]?"
                                     if isinstance(providers, str) else ""),
                op=self.qualname)
        names = list(providers)
        unknown = [p for p in names if p not in self._impls]
        if unknown and strict:
            raise RegistrationError(
                f"op {self.qualname!r}: unknown provider(s) {unknown} in priority "
                f"{names}; registered providers: {sorted(self._impls)}",
                op=self.qualname, provider=str(unknown[0]),
            )
        kept = [p for p in dict.fromkeys(names) if p in self._impls]
        # a default naming none of our providers is no opinion, not "native only"
        return None if not strict and not any(p != NATIVE for p in kept) else kept

    def _set_layer(self, layer: str, providers: Sequence[str] | None, *,
                   strict: bool = True) -> None:
        with self._lock:
            value = None if providers is None else self._check_providers(providers,
                                                                         strict=strict)
            if value == self._layers[layer] and layer != "tuned":
                return  # start-up sets every layer of every op: most change nothing
            self._layers[layer] = value
            self._rebuild_chains()

    def _reset_priorities(self) -> None:
        """Forget every priority layer and open scope (tests; see runtime.reset_for_tests)."""
        with self._lock:
            self._layers = dict.fromkeys(_LAYERS)
            self._tuned_sized = None
            self._scopes.clear()
            self._rebuild_chains()

    def _set_tuned(self, order: Sequence[str] | None,
                   sized: Sequence[Sequence[str]] | None = None) -> None:
        """Set the ``tuned`` layer: one order, and optionally one per size bucket."""
        if sized is not None and len(sized) != SIZE_BUCKETS:
            raise RegistrationError(f"op {self.qualname!r}: a tuned order per size bucket "
                                    f"needs {SIZE_BUCKETS} entries, got {len(sized)}",
                                    op=self.qualname)
        with self._lock:
            checked_sized = None if sized is None else [
                self._check_providers(o, strict=False) or [NATIVE] for o in sized]
            self._tuned_sized = checked_sized
            self._set_layer("tuned", order, strict=False)

    def _rebuild_chains(self) -> None:
        check = switches.output_checks_enabled()
        with self._lock:
            order = self.priority()
            sized = self._tuned_sized if self.priority_source() == "tuned" else None
            for key, holder in self._chains.items():
                chain = self._chain(order, key)
                fns = self._fns(chain, check)
                per_bucket = None
                if sized is not None:
                    built: dict[tuple[str, ...], tuple[Any, Any]] = {}
                    per_bucket = []
                    for names in sized:
                        entry = built.get(tuple(names))
                        if entry is None:
                            c = self._chain(names, key)
                            entry = built[tuple(names)] = (
                                c, self._fns(c, check))
                        per_bucket.append(entry)
                holder.set(chain, fns, per_bucket,
                           trace.wrap(self.qualname, NATIVE, self.native))

    def _fns(self, chain: tuple[OpImpl, ...], check: bool) -> tuple[Callable[..., Any], ...]:
        # the callables a chain runs: output-checked when asked, traced under OPMUX_TRACE
        return tuple(trace.wrap(self.qualname, i.provider, checked(self, i) if check else i.fn)
                     for i in chain)

    def _chain(self, order: list[str], key: str) -> tuple[OpImpl, ...]:
        # providers after native never run: native wins where it is listed first
        if NATIVE in order:
            order = order[:order.index(NATIVE)]
        return tuple(impl for name in order
                     if (impl := self._impls.get(name)) is not None
                     and impl.dispatch_key == key and impl.supported)

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
            dispatch_key = self._platform_key()
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
        got = self.schema if _same_signature(impl.fn, self.native) else infer_schema(
            impl.fn, op=self.qualname, mutates_args=self.mutates_args,
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
                self._registry._holders.append(holder)
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
        if _same_signature(pred, self.native, annotations=False):
            return  # the common case, without building two inspect.Signature objects
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


def _same_signature(fn: Callable[..., Any], native: Callable[..., Any], *,
                    annotations: bool = True) -> bool:
    """Whether two plain functions have the same parameters, defaults and (``annotations``)
    annotations; then they infer the same schema, so start-up skips torch's inference."""
    a, b = getattr(fn, "__code__", None), getattr(native, "__code__", None)
    if a is None or b is None or type(fn) is not type(native):
        return False
    n = a.co_argcount
    return (n == b.co_argcount and a.co_varnames[:n] == b.co_varnames[:n]
            and a.co_kwonlyargcount == b.co_kwonlyargcount == 0
            and (a.co_flags & 0x0C) == (b.co_flags & 0x0C) == 0  # no *args / **kwargs
            and getattr(fn, "__defaults__", None) == getattr(native, "__defaults__", None)
            and (not annotations or getattr(fn, "__annotations__", None)
                 == getattr(native, "__annotations__", None)))


def _fmt(params: list[tuple[str, Any]]) -> str:
    parts = [n if d is inspect.Parameter.empty else f"{n}={d!r}" for n, d in params]
    return "(" + ", ".join(parts) + ")"


def _pred_verdict(impl: OpImpl, args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool | str:
    """``supports_args``'s answer, or ``"<Exception>: message"`` when it raised (declines)."""
    assert impl.supports_args is not None
    try:
        return bool(impl.supports_args(*args, **kwargs))
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"


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
