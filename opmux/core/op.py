"""Ops and their providers: registration, selection, and the dispatch kernels.

An :class:`Op` is one ``torch.ops.<namespace>.<name>`` operator defined from a native
(pure PyTorch) reference. Providers are alternative implementations, each bound to one
dispatch key. For every key that has providers, one kernel is registered on the torch op
(:func:`opmux.core.dispatch.make_kernel`); that kernel walks the key's *chain* (the
supported providers of that key, in priority order), runs the first whose ``supports_args``
accepts the arguments, and falls back to native. The priority state and the chains belong
to :class:`~opmux.core.priority.Priorities` (``op.priorities``); chains are recomputed when
priorities or providers change, never per call.

Priorities are **global** (shared by all threads); ``set_priority`` is a scoped override
(see :mod:`opmux.core.priority`). Priorities are set outside ``torch.compile``-d code (a
context manager inside a fullgraph region is not traceable); selection happens when the
compiled graph runs.

A ``supports_args`` predicate that raises counts as declining the call (the next
provider, ultimately native, runs and validates the arguments itself), and warns once per
provider; ``explain`` shows the exception as the reason.
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any, Final, final

import torch

from opmux.core import switches, trace
from opmux.core.dispatch import make_eager, make_kernel
from opmux.core.errors import RegistrationError, SignatureMismatchError
from opmux.core.output_checks import checked
from opmux.core.priority import NATIVE, Priorities
from opmux.core.state import runtime
from opmux.core.switches import enable_torch_wrap, torch_wrap_enabled
from opmux.core.torch_lib import infer_schema, validate_dispatch_key, validate_name

if TYPE_CHECKING:
    from opmux.core.registry import OpRegistry

__all__ = ["NATIVE", "Op", "OpImpl", "enable_torch_wrap", "torch_wrap_enabled"]

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


class Op:
    """A registered op. Call it like its native function.

    :ivar name: the op name, e.g. ``"rms_norm"``.
    :ivar namespace: the torch namespace, e.g. ``"opmux"``.
    :ivar torch_op: the ``torch.ops.<namespace>.<name>.default`` overload.
    :ivar priorities: the owner of this op's priority state (:mod:`opmux.core.priority`).
    """

    __module__ = "opmux"

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
        #: gives the dispatch key providers register on when they name none
        self._platform_key = platform_key
        self._native_impl = OpImpl(self.qualname, NATIVE, _NATIVE_KEY, native, True, None)
        self.priorities = Priorities(self.qualname, self._native_impl, self._runner)
        # the priorities own the providers table and the lock; the op writes through them
        self._impls = self.priorities.impls
        self._lock = self.priorities.lock
        self._fake: Callable[..., Any] = native
        self.torch_op: torch._ops.OpOverload = getattr(getattr(torch.ops, namespace), name).default
        #: the wrap-off call (built on first use)
        self._eager: Callable[..., Any] | None = None
        #: what ``__call__`` runs: the torch op, or the wrap-off call
        self._call: Callable[..., Any] = self.torch_op
        self.set_wrap(torch_wrap_enabled())
        switches.track(self)

    @property
    def registry(self) -> OpRegistry:
        """The registry that defined this op."""
        return self._registry

    @property
    def signature(self) -> inspect.Signature:
        """The native function's :class:`inspect.Signature` (built on first use)."""
        sig = self._signature
        if sig is None:
            sig = self._signature = inspect.signature(self.native)
        return sig

    @property
    def fake(self) -> Callable[..., Any]:
        """The fake (meta) implementation: native until :meth:`register_fake` or
        :meth:`register_meta` replaces it."""
        return self._fake

    @property
    def eager(self) -> Callable[..., Any]:
        """This op called the way ``enable_torch_wrap(False)`` calls it, whatever the switch
        says: the provider is chosen from the first tensor's device and called directly,
        without a trip through the torch dispatcher (under Dynamo tracing it calls
        :attr:`torch_op`, so a compiled graph still sees one node).

        For engine code that only runs eagerly, such as an attention backend's forward
        outside the compiled graph: it saves the dispatcher's boxing of the arguments. As
        with the wrap off, the backward of :meth:`register_autograd` does not apply here.
        """
        eager = self._eager
        if eager is None:
            native = trace.wrap(self.qualname, NATIVE, self.native)  # itself unless traced
            eager = self._eager = make_eager(
                self.priorities.chains, native, self.torch_op, self._registry.loaded_flag,
                self._registry.ensure_loaded, _key_of)
        return eager

    # ------------------------------------------------------------------ calling
    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        # no empty keyword dict passed on: the call without ``**kwargs`` is the cheaper one
        # (benchmarks/dispatch_overhead.py)
        if kwargs:
            return self._call(*args, **kwargs)
        return self._call(*args)

    def set_wrap(self, wrap: bool) -> None:
        """Route calls through the torch dispatcher (``True``) or the wrap-off call
        (:attr:`eager`); :func:`opmux.enable_torch_wrap` calls this for every op."""
        self._call = self.torch_op if wrap else self.eager

    def _runner(self, impl: OpImpl) -> Callable[..., Any]:
        # what a chain runs for impl: output-checked when asked, counted under OPMUX_TRACE
        fn = checked(self, impl) if switches.output_checks_enabled() else impl.fn
        return trace.wrap(self.qualname, impl.provider, fn)

    def meta_kernel(self) -> Callable[..., Any]:
        """The torch kernel of key ``Meta`` (the registry installs it): runs the fake."""
        def kernel(*args: Any) -> Any:
            return self._fake(*args)

        kernel.__name__ = f"{self.name}_meta_kernel"
        return kernel

    def native_kernel(self) -> Callable[..., Any]:
        """The torch kernel of ``CompositeExplicitAutograd`` (the registry installs it):
        native, after start-up on the first call."""
        native = trace.wrap(self.qualname, NATIVE, self.native)  # itself unless OPMUX_TRACE
        loaded = self._registry.loaded_flag
        ensure_loaded = self._registry.ensure_loaded

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
        self._registry.ensure_loaded()
        holder = self.priorities.chains.get(_key_of(args, kwargs))
        if holder is not None:
            impl = holder.pick(args, kwargs)[0]
            if impl is not None:
                return impl
        return self._native_impl

    def first_choice(self, key: str) -> OpImpl | None:
        """The provider every call of dispatch key ``key`` (``"CPU"``) tries first, where it
        runs as registered (not traced, not output-checked) and no size bucket has an order
        of its own; else ``None`` (native first, or no such key). Its predicate still decides
        each call. For callers that run a provider's kernels directly while it stays first
        (``opmux.models``' lean decoder layers); not the hot path."""
        self._registry.ensure_loaded()
        holder = self.priorities.chains.get(key)
        if holder is None or holder.sized is not None:
            return None
        chain, fns = holder.walk
        if not chain or fns[0] is not chain[0].fn:
            return None
        return chain[0]

    def _first_arg(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        if args:
            return args[0]
        first = next(iter(self.signature.parameters), None)
        return kwargs.get(first) if first is not None else None

    def explain(self, *args: Any, **kwargs: Any) -> str:
        """Describe which implementation runs for these arguments and why others don't."""
        self._registry.ensure_loaded()
        key = _key_of(args, kwargs)
        chosen = self.dispatch(*args, **kwargs)
        order = self.priorities.order_for(self._first_arg(args, kwargs))
        lines = [f"op {self.qualname} for dispatch key {key}: runs {chosen.provider!r}"]
        for name in [*order, *(p for p in self._impls if p not in order)]:
            impl = self._impls.get(name)
            if impl is None:
                continue
            lines.append(f"  {name:<12} [{impl.dispatch_key}] "
                         f"{_verdict(impl, chosen, order, key, args, kwargs)}")
        return "\n".join(lines)

    @property
    def impls(self) -> dict[str, OpImpl]:
        """``{provider: OpImpl}``, native included (a copy; start-up runs first)."""
        self._registry.ensure_loaded()
        return dict(self._impls)

    def has_provider(self, provider: str) -> bool:
        """Whether ``provider`` is registered now (no start-up runs)."""
        return provider in self._impls

    def supported_providers(self) -> list[str]:
        """Names of the providers that are supported here, in registration order."""
        self._registry.ensure_loaded()
        return [name for name, impl in self._impls.items() if impl.supported]

    def priority(self) -> list[str]:
        """The effective priority list (strongest source wins); native is appended when
        missing, and providers listed after native never run."""
        return self.priorities.priority()

    def priority_source(self) -> str:
        """Which source the effective priority comes from (a scope counts as ``code``)."""
        return self.priorities.source()

    def set_default_priority(self, providers: Sequence[str]) -> None:
        """Set the priority permanently (overrides platform, plugin and env defaults).

        :param providers: provider names, first preferred; ``native`` is appended if
            missing. Unsupported providers are dropped from the chains now, not per call.
        :raises RegistrationError: for a provider name the op does not have.
        """
        self._registry.ensure_loaded()
        self.priorities.set_layer("code", providers)

    @contextlib.contextmanager
    def set_priority(self, providers: Sequence[str]) -> Iterator[None]:
        """Scoped priority: the newest open scope wins; on exit this scope's entry leaves.

        Scopes may overlap across threads and close in any order: once all have closed,
        the priority is the one in force before the first opened. Use it outside
        ``torch.compile``-d functions (selection happens when the graph runs).
        """
        self._registry.ensure_loaded()
        with self.priorities.scope(providers):
            yield

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
                f"op {self.qualname!r}: provider {provider!r} is already registered"
                f"{runtime().plugins.journal.clash(self, provider)} (for key "
                f"{self._impls[provider].dispatch_key}); unregister it first or choose "
                f"another name",
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
                    f"op {self.qualname!r}: provider {provider!r} is already registered"
                    f"{runtime().plugins.journal.clash(self, provider)}",
                    op=self.qualname, provider=provider,
                )
            native = trace.wrap(self.qualname, NATIVE, self.native)  # itself unless traced
            holder, new_key = self.priorities.add_key(impl.dispatch_key, native)
            if new_key:
                kernel = make_kernel(f"{self.name}_{impl.dispatch_key.lower()}_kernel", holder,
                                     self._registry.loaded_flag, self._registry.ensure_loaded)
                self._registry.library(self.namespace).impl(self.name, kernel, impl.dispatch_key)
            self._impls[provider] = impl
            runtime().plugins.journal.record_impl(self, provider)
            self.priorities.rebuild()

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
            self.priorities.rebuild()

    def _check_predicate(self, provider: str, pred: Callable[..., bool]) -> None:
        if _same_signature(getattr(pred, "__wrapped__", pred), self.native, annotations=False):
            return  # the common case (a predicate or the impl it wraps), no inspect.Signature
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
        torch.library.register_fake(self.qualname, fn, lib=self._registry.library(self.namespace),
                                    allow_override=True)
        self._fake = fn
        return fn

    def register_meta(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        """Replace the shape function the op's Meta kernel runs, without a torch fake.

        FakeTensorMode (``torch.compile``, ``torch.library.opcheck``) runs an op's Meta
        kernel when no fake is registered with torch, so this serves tracing and meta-device
        calls as :meth:`register_fake` does, for a fake whose output sizes follow from its
        inputs. It skips ``torch.library.register_fake``, which reads its caller's source
        line, a noticeable part of ``opmux.load_plugins()`` for the catalog's fakes
        (``benchmarks/startup.py``). A fake that
        needs ``torch.library.get_ctx()`` (data-dependent sizes) must use
        :meth:`register_fake`; after it, a torch-registered fake takes precedence under
        FakeTensorMode.

        :raises RegistrationError: ``fn`` is not callable (the error would otherwise come at
            the next meta call).
        """
        if not callable(fn):
            raise RegistrationError(f"register_meta on op {self.qualname!r}: expected a "
                                    f"function with the op's signature, got "
                                    f"{type(fn).__name__}", op=self.qualname)
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


def _verdict(impl: OpImpl, chosen: OpImpl, order: list[str], key: str,
             args: tuple[Any, ...], kwargs: dict[str, Any]) -> str:
    """Why ``impl`` runs or not for a call (one line of :meth:`Op.explain`)."""
    name = impl.provider
    if impl is chosen:
        return "chosen"
    if name == NATIVE:
        return "not reached (an earlier provider was chosen)"
    if name not in order:
        return "skipped: not in the priority list " + str(order)
    if not impl.supported:
        return f"skipped: unsupported ({impl.reason or 'supported=False'})"
    if impl.dispatch_key != key:
        return f"skipped: serves dispatch key {impl.dispatch_key}, not {key}"
    if impl.supports_args is not None and (got := _pred_verdict(impl, args, kwargs)) is not True:
        return ("skipped: supports_args rejected these arguments" if got is False
                else f"skipped: supports_args raised {got} (counts as declining)")
    if order.index(name) > order.index(NATIVE):
        return "skipped: native comes first in the priority list"
    return "not reached (an earlier provider was chosen)"


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
