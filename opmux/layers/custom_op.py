"""The :class:`CustomOp` layer base class and its enablement switch.

A layer subclasses :class:`CustomOp`, implements ``forward_native`` and may override
``forward_cuda`` / ``forward_hip`` / ``forward_xla`` / ``forward_npu`` / ``forward_cpu`` /
``forward_oot``. The method is chosen once, at construction: the current platform names it
(:attr:`opmux.Platform.forward_method`, so an out-of-tree platform gets its own path; a
layer without that method runs its catalog-op path ``forward_oot``, by default its CPU path)
and the enablement setting decides whether it runs: a disabled layer always runs
``forward_native``.

Enablement follows vLLM's ``CompilationConfig.custom_ops``:

- forms: a string ``"all,-rms_norm"`` or a list ``["none", "+rms_norm"]``
  (:func:`set_custom_ops`, or the ``OPMUX_CUSTOM_OPS`` environment variable, string form);
  elements are ``all``, ``none``, ``+name`` and ``-name``; at most one of ``all``/``none``;
  ``+all``/``-all`` are errors, and so is naming one layer with both ``+`` and ``-``.
- without ``all``/``none`` the base is the compile-mode default: ``none`` when the caller
  declares it compiles with Inductor (:func:`set_compile_mode` ``("inductor")`` or
  ``OPMUX_COMPILE_MODE=inductor``), so that Inductor fuses the native code of the layers;
  ``all`` otherwise (eager, or another ``torch.compile`` backend).
- a layer is enabled iff ``(base is all or +name given) and -name not given``.
- names must be registered layer names. :func:`set_custom_ops` checks them when it is
  called, against the layers registered at that moment (opmux's own table is imported
  first, so every in-tree row is known; register out-of-tree layers before naming them);
  ``OPMUX_CUSTOM_OPS`` is checked when it is first resolved (the first layer built after
  it changed). An unknown name raises :class:`~opmux.ConfigError` listing the known ones.
  vLLM only warns here; a typo that silently keeps a slow path is worse than an error.

The settings, the counts and the out-of-tree replacements are a :class:`CustomOpSettings`,
the ``custom_ops`` field of the runtime object (:class:`opmux.core.state.Runtime`), built
on first use.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Callable, Sequence
from typing import Any, ClassVar, TypeVar

import torch

from opmux.core import config
from opmux.core.config import ENV_COMPILE_MODE, ENV_CUSTOM_OPS
from opmux.core.errors import ConfigError, RegistrationError
from opmux.core.state import claim, runtime
from opmux.core.torch_lib import validate_name
from opmux.platforms import current_platform

__all__ = ["ENV_COMPILE_MODE", "CustomOp", "CustomOpSettings", "compile_mode",
           "custom_op_counts", "custom_op_settings", "set_compile_mode",
           "set_custom_ops"]

_C = TypeVar("_C", bound=type["CustomOp"])

_NAME = re.compile(r"^[a-z_][a-z0-9_]*$")

#: ``(base or None, {name: enabled})``: a parsed enablement setting.
_Parsed = tuple[bool | None, dict[str, bool]]

class CustomOpSettings:
    """Enablement settings, layer counts and out-of-tree replacements (a field of the
    runtime object)."""

    def __init__(self) -> None:
        #: the explicit setting of :func:`set_custom_ops`, or ``None``
        self.explicit: _Parsed | None = None
        #: the compile mode of :func:`set_compile_mode`, or ``None``
        self.mode: str | None = None
        #: ``(text, parsed)`` of the last ``OPMUX_CUSTOM_OPS`` value (checked once per value)
        self.env: tuple[str, _Parsed] | None = None
        #: layers built enabled / disabled, by name
        self.counts: dict[str, Counter[str]] = {"enabled": Counter(), "disabled": Counter()}
        #: out-of-tree replacements by layer name or in-tree class name
        self.oot: dict[str, type[CustomOp]] = {}


def _settings() -> CustomOpSettings:
    rt = runtime()
    settings = rt.custom_ops
    if settings is None:
        with rt.lock:
            settings = rt.custom_ops = rt.custom_ops or CustomOpSettings()
    return settings


def _known_names() -> list[str]:
    # importing this module runs opmux.layers first (its package), which registers
    # opmux's own layer table
    return sorted(set(CustomOp.op_registry) | set(_settings().oot))


def _parse(spec: object, source: str, check_names: bool) -> _Parsed:
    """Parse vLLM's string or list form into ``(base, overrides)``; ``base`` None = default."""
    if isinstance(spec, str):
        items = [i.strip() for i in spec.split(",")]
    elif isinstance(spec, Sequence) and all(isinstance(i, str) for i in spec):
        items = [i.strip() for i in spec]
    else:
        raise ConfigError(f"{source}: expected a string like 'all,-rms_norm' or a list of "
                          f"strings like ['none', '+rms_norm'], got {type(spec).__name__} "
                          f"{spec!r}")
    base: bool | None = None
    overrides: dict[str, bool] = {}
    for item in filter(None, items):
        if item in ("all", "none"):
            if base is not None:
                raise ConfigError(f"{source}: {spec!r} gives 'all'/'none' more than once; "
                                  f"use exactly one base mode")
            base = item == "all"
        elif item[0] in "+-" and item[1:] in ("all", "none"):
            raise ConfigError(f"{source}: element {item!r} of {spec!r}: 'all' and 'none' take "
                              f"no sign; write 'all' or 'none'")
        elif item[0] in "+-" and _NAME.match(item[1:]):
            want = item[0] == "+"
            if overrides.get(item[1:], want) != want:
                raise ConfigError(f"{source}: {spec!r} both enables and disables "
                                  f"{item[1:]!r}; keep one of '+{item[1:]}' / '-{item[1:]}'")
            overrides[item[1:]] = want
        else:
            raise ConfigError(f"{source}: element {item!r} of {spec!r} is not 'all', 'none', "
                              f"'+name' or '-name'")
    if check_names and overrides:
        known = _known_names()
        unknown = sorted(set(overrides) - set(known))
        if unknown:
            raise ConfigError(f"{source}: unknown custom op layer name(s) {unknown}; known "
                              f"layers: {known}")
    return base, overrides


def set_custom_ops(spec: str | Sequence[str] | None) -> None:
    """Set which CustomOp layers use their platform path; applies to layers built afterwards.

    :param spec: ``"all,-rms_norm"``, ``["none", "+rms_norm"]``, or ``None`` to return to
        ``OPMUX_CUSTOM_OPS`` (and, without a base mode, the compile-mode default).
    :raises ConfigError: malformed setting or unknown layer name (nothing changes).
    """
    parsed = None if spec is None else _parse(spec, "set_custom_ops", check_names=True)
    _settings().explicit = parsed


def set_compile_mode(mode: str | None) -> None:
    """Declare how the caller compiles the model; it sets the enablement default.

    :param mode: ``"inductor"`` (layers default to disabled, as vLLM does with Inductor),
        ``"none"`` (eager) or another ``torch.compile`` backend name (layers default to
        enabled); ``None`` returns to ``OPMUX_COMPILE_MODE`` (unset: ``none``).
    :raises ConfigError: ``mode`` is not a backend-like name.
    """
    if mode is not None:
        _check_mode(mode, "set_compile_mode")
    _settings().mode = mode


def _check_mode(mode: object, source: str) -> str:
    if not isinstance(mode, str) or not _NAME.match(mode):
        raise ConfigError(f"{source}: expected 'inductor', 'none' or a torch.compile backend "
                          f"name, got {mode!r}")
    return mode


def compile_mode() -> str:
    """The declared compile mode: :func:`set_compile_mode`, else ``OPMUX_COMPILE_MODE``."""
    mode = _settings().mode
    if mode is not None:
        return mode
    env = _env_compile_mode()
    return _check_mode(env, ENV_COMPILE_MODE) if env else "none"


def _env_custom_ops() -> str:
    """``OPMUX_CUSTOM_OPS`` (empty when unset)."""
    return config.custom_ops_spec()


def _env_compile_mode() -> str:
    """``OPMUX_COMPILE_MODE``, stripped and lower-cased (empty when unset)."""
    return config.compile_mode_spec()


def _current_config() -> tuple[bool, dict[str, bool]]:
    settings = _settings()
    parsed = settings.explicit
    if parsed is None:
        text = _env_custom_ops()
        cached = settings.env
        if cached is None or cached[0] != text:
            cached = (text, _parse(text, ENV_CUSTOM_OPS, check_names=True))
            settings.env = cached
        parsed = cached[1]
    base, overrides = parsed
    if base is None:
        base = compile_mode() != "inductor"
    return base, overrides


def custom_op_counts() -> dict[str, dict[str, int]]:
    """How many layers of each CustomOp name were built enabled / disabled."""
    return {k: dict(v) for k, v in _settings().counts.items()}


def custom_op_settings() -> dict[str, Any]:
    """The resolved enablement: base mode, overrides, compile mode, where they came from and
    ``layers``, whether each registered layer name is enabled now."""
    base, overrides = _current_config()
    explicit = _settings().explicit is not None
    return {
        "layers": {n: overrides.get(n, base) for n in _known_names()},
        "base": "all" if base else "none",
        "overrides": {k: overrides[k] for k in sorted(overrides)},
        "compile_mode": compile_mode(),
        "source": "set_custom_ops" if explicit else (
            ENV_CUSTOM_OPS if _env_custom_ops().strip() else "default"),
    }


def _runs(method: str) -> Callable[..., Any]:
    """A forward path that runs ``self.<method>``, looked up on the instance so that a
    subclass's override counts: ``forward_cpu = forward_cuda = _runs("forward_op")`` in a
    class body gives those platforms one path."""

    def path(self: CustomOp, *args: Any, **kwargs: Any) -> Any:
        return getattr(self, method)(*args, **kwargs)

    path.__name__ = path.__qualname__ = f"runs_{method}"
    path._opmux_runs = method  # type: ignore[attr-defined]  # dispatch_forward follows it
    return path


class _OotTable:
    """``CustomOp.op_registry_oot``: the runtime object's table of out-of-tree replacements
    (a descriptor, so the name stays vLLM's while a reset gives a fresh table)."""

    def __get__(self, instance: object, owner: type | None = None) -> dict[str, type[CustomOp]]:
        return _settings().oot


class CustomOp(torch.nn.Module):
    """Base class of layers with per-platform forward paths.

    >>> import torch, opmux
    >>> @opmux.CustomOp.register("doc_double")
    ... class Double(opmux.CustomOp):
    ...     def forward_native(self, x):
    ...         return x * 2
    >>> Double()(torch.ones(1)).item()
    2.0
    """

    #: the registered name (set by :meth:`register`).
    name: ClassVar[str] = ""
    #: in-tree layer classes by name.
    op_registry: ClassVar[dict[str, type[CustomOp]]] = {}
    #: out-of-tree replacements by name (see :meth:`register_oot`).
    op_registry_oot = _OotTable()

    def __new__(cls, *args: Any, **kwargs: Any) -> CustomOp:
        oot = _settings().oot
        replacement = oot.get(cls.__name__) if oot else None
        # a registered-name key replaces the class registered under it, not its subclasses
        # (QKVParallelLinear inherits column_parallel_linear's name but has its own constructor)
        if replacement is None and oot and cls.name and CustomOp.op_registry.get(cls.name) is cls:
            replacement = oot.get(cls.name)
        target = replacement if replacement is not None and not issubclass(
            cls, replacement) else cls
        return super().__new__(target)

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__()
        # the chosen path is the instance's forward, so torch's Module call runs it directly
        # (tests/layers/test_custom_op.py counts the frames of a layer call)
        self.forward = self.dispatch_forward()  # type: ignore[method-assign]

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """The path :meth:`dispatch_forward` chooses (the instance holds it once built)."""
        return self._choose_forward()(*args, **kwargs)

    def forward_native(self, *args: Any, **kwargs: Any) -> Any:
        """The reference PyTorch implementation (required)."""
        raise NotImplementedError(f"{type(self).__name__} must implement forward_native")

    forward_cuda = forward_xla = forward_npu = forward_cpu = _runs("forward_native")
    forward_hip = _runs("forward_cuda")
    #: the catalog-op path, run on a platform whose own method (``forward_acme``) this layer
    #: does not define: the CPU path calls catalog ops, which dispatch on the tensors'
    #: device to that platform's providers by priority.
    forward_oot = _runs("forward_cpu")

    @classmethod
    def enabled(cls) -> bool:
        """Whether this layer uses its platform path (per the enablement string)."""
        default, overrides = _current_config()
        return overrides.get(cls.name, default)

    def dispatch_forward(self) -> Callable[..., Any]:
        """Pick the forward method for the current platform (called once, in ``__init__``):
        the one the platform names (:attr:`opmux.Platform.forward_method`), the catalog-op
        path ``forward_oot`` when the layer has no such method, and ``forward_native`` when
        the layer is disabled."""
        counts = _settings().counts
        counts["enabled" if self.enabled() else "disabled"][self.name or type(self).__name__] += 1
        return self._choose_forward()

    def _choose_forward(self) -> Callable[..., Any]:
        if not self.enabled():
            return self.forward_native
        forward: Callable[..., Any] = getattr(self, current_platform().forward_method,
                                              self.forward_oot)
        while (target := getattr(forward, "_opmux_runs", None)) is not None:
            forward = getattr(self, target)  # a _runs path: call its target directly
        return forward

    @classmethod
    def register(cls, name: str) -> Callable[[_C], _C]:
        """Class decorator: register an in-tree layer under ``name``."""
        validate_name("custom op", name)

        def decorator(layer_cls: _C) -> _C:
            entry: type[CustomOp] = layer_cls
            existing = claim(CustomOp.op_registry, name, entry)
            if existing is not None:
                raise RegistrationError(
                    f"CustomOp name {name!r} is already registered by "
                    f"{existing.__module__}.{existing.__qualname__}; use register_oot to "
                    f"replace it out of tree")
            layer_cls.name = name
            return layer_cls

        return decorator

    @classmethod
    def register_oot(cls, _decorated: _C | None = None, name: str | None = None
                     ) -> _C | Callable[[_C], _C]:
        """Replace an in-tree layer out of tree: building the in-tree class builds this one.

        Usable as ``@CustomOp.register_oot`` (replaces the in-tree class of the same
        ``name`` attribute), ``@CustomOp.register_oot(name="rms_norm")``, or
        ``CustomOp.register_oot(MyLayer, name="rms_norm")``. ``name`` is either a registered
        layer name (replaces exactly the class registered under it, not its subclasses) or,
        as in vLLM, an in-tree class name such as ``"RMSNorm"`` or ``"QKVParallelLinear"``
        (replaces that class).
        """

        def decorator(layer_cls: _C) -> _C:
            key = name or layer_cls.name
            if not key:
                raise RegistrationError(
                    f"register_oot({layer_cls.__qualname__}): give name= or set the class's "
                    f"name attribute to the in-tree layer it replaces")
            if _NAME.match(key):
                validate_name("custom op", key)
                layer_cls.name = key
            elif not key.isidentifier():
                raise RegistrationError(
                    f"register_oot({layer_cls.__qualname__}): name {key!r} is neither a layer "
                    f"name like 'rms_norm' nor a class name like 'RMSNorm'")
            _settings().oot[key] = layer_cls
            return layer_cls

        if _decorated is not None:
            return decorator(_decorated)
        return decorator


class _OpLayer(CustomOp):
    """A layer whose platform paths all run ``forward_op`` (its catalog op)."""

    def forward_op(self, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError(f"{type(self).__name__} must implement forward_op")

    forward_cuda = forward_xla = forward_npu = forward_cpu = _runs("forward_op")
