"""The :class:`CustomOp` layer base class and its enablement switch.

A layer subclasses :class:`CustomOp`, implements ``forward_native`` and may override
``forward_cuda`` / ``forward_hip`` / ``forward_xla`` / ``forward_npu`` / ``forward_cpu``.
The method is chosen once, at construction, from the current platform and the enablement
string (``opmux.set_custom_ops("all,-rms_norm")`` or ``OPMUX_CUSTOM_OPS``): a disabled
layer always runs ``forward_native``. The default, with nothing configured, is ``all``.
"""

from __future__ import annotations

import os
import threading
from collections import Counter
from collections.abc import Callable
from typing import Any, ClassVar, TypeVar

import torch

from opmux.core.config import ENV_CUSTOM_OPS, parse_custom_ops
from opmux.core.errors import RegistrationError
from opmux.core.torch_lib import validate_name

__all__ = ["CustomOp", "custom_op_counts", "set_custom_ops"]

_C = TypeVar("_C", bound=type["CustomOp"])

_config_lock = threading.Lock()
_config: list[tuple[bool, dict[str, bool]] | None] = [None]
_counts: dict[str, Counter[str]] = {"enabled": Counter(), "disabled": Counter()}


def set_custom_ops(spec: str | None) -> None:
    """Set which CustomOp layers are enabled: ``"all,-name"`` or ``"none,+name"``.

    ``None`` returns to ``OPMUX_CUSTOM_OPS`` (or ``all``). Applies to layers built
    afterwards.

    :raises ConfigError: on a malformed string (nothing changes).
    """
    parsed = None if spec is None else parse_custom_ops(spec, source="set_custom_ops")
    with _config_lock:
        _config[0] = parsed


def _current_config() -> tuple[bool, dict[str, bool]]:
    cfg = _config[0]
    if cfg is not None:
        return cfg
    return parse_custom_ops(os.environ.get(ENV_CUSTOM_OPS, ""), source=ENV_CUSTOM_OPS)


def custom_op_counts() -> dict[str, dict[str, int]]:
    """How many layers of each CustomOp name were built enabled / disabled."""
    return {k: dict(v) for k, v in _counts.items()}


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
    #: out-of-tree replacements by name.
    op_registry_oot: ClassVar[dict[str, type[CustomOp]]] = {}

    def __new__(cls, *args: Any, **kwargs: Any) -> CustomOp:
        replacement = CustomOp.op_registry_oot.get(cls.name) if cls.name else None
        target = replacement if replacement is not None and not issubclass(
            cls, replacement) else cls
        return super().__new__(target)

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__()
        self._forward_method: Callable[..., Any] = self.dispatch_forward()

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self._forward_method(*args, **kwargs)

    def forward_native(self, *args: Any, **kwargs: Any) -> Any:
        """The reference PyTorch implementation (required)."""
        raise NotImplementedError(f"{type(self).__name__} must implement forward_native")

    def forward_cuda(self, *args: Any, **kwargs: Any) -> Any:
        return self.forward_native(*args, **kwargs)

    def forward_hip(self, *args: Any, **kwargs: Any) -> Any:
        return self.forward_cuda(*args, **kwargs)

    def forward_xla(self, *args: Any, **kwargs: Any) -> Any:
        return self.forward_native(*args, **kwargs)

    def forward_npu(self, *args: Any, **kwargs: Any) -> Any:
        return self.forward_native(*args, **kwargs)

    def forward_cpu(self, *args: Any, **kwargs: Any) -> Any:
        return self.forward_native(*args, **kwargs)

    @classmethod
    def enabled(cls) -> bool:
        """Whether this layer uses its platform path (per the enablement string)."""
        default, overrides = _current_config()
        return overrides.get(cls.name, default)

    def dispatch_forward(self) -> Callable[..., Any]:
        """Pick the forward method for the current platform (called once, in ``__init__``)."""
        from opmux.platforms import current_platform

        enabled = self.enabled()
        _counts["enabled" if enabled else "disabled"][self.name or type(self).__name__] += 1
        if not enabled:
            return self.forward_native
        method = _PLATFORM_METHOD.get(current_platform().name, "forward_native")
        return getattr(self, method)  # type: ignore[no-any-return]

    @classmethod
    def register(cls, name: str) -> Callable[[_C], _C]:
        """Class decorator: register an in-tree layer under ``name``."""
        validate_name("custom op", name)

        def decorator(layer_cls: _C) -> _C:
            existing = CustomOp.op_registry.get(name)
            if existing is not None and existing is not layer_cls:
                raise RegistrationError(
                    f"CustomOp name {name!r} is already registered by "
                    f"{existing.__module__}.{existing.__qualname__}; use register_oot to "
                    f"replace it out of tree")
            layer_cls.name = name
            CustomOp.op_registry[name] = layer_cls
            return layer_cls

        return decorator

    @classmethod
    def register_oot(cls, _decorated: _C | None = None, name: str | None = None
                     ) -> _C | Callable[[_C], _C]:
        """Replace an in-tree layer out of tree: building the in-tree class builds this one.

        Usable as ``@CustomOp.register_oot`` (replaces the in-tree class of the same
        ``name`` attribute), ``@CustomOp.register_oot(name="rms_norm")``, or
        ``CustomOp.register_oot(MyLayer, name="rms_norm")``.
        """

        def decorator(layer_cls: _C) -> _C:
            key = name or layer_cls.name
            if not key:
                raise RegistrationError(
                    f"register_oot({layer_cls.__qualname__}): give name= or set the class's "
                    f"name attribute to the in-tree layer it replaces")
            validate_name("custom op", key)
            layer_cls.name = key
            CustomOp.op_registry_oot[key] = layer_cls
            return layer_cls

        if _decorated is not None:
            return decorator(_decorated)
        return decorator


_PLATFORM_METHOD: dict[str, str] = {
    "cuda": "forward_cuda",
    "rocm": "forward_hip",
    "xla": "forward_xla",
    "ascend": "forward_npu",
    "cpu": "forward_cpu",
}
"""Platform name → CustomOp method; out-of-tree platforms fall back to forward_native."""


def _reset_for_tests() -> None:
    """Clear the enablement override, the counts and out-of-tree replacements."""
    with _config_lock:
        _config[0] = None
    for counter in _counts.values():
        counter.clear()
    CustomOp.op_registry_oot.clear()
