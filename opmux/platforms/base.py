"""The small :class:`Platform` interface every platform implements."""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any, ClassVar, Final

from opmux.core.errors import PlatformError

__all__ = ["Detection", "Platform", "check_forward_method"]

_FORWARD_NAME: Final = re.compile(r"forward_[A-Za-z0-9_]+")


class Platform:
    """What opmux needs to know about a platform, and nothing more.

    Subclasses set the three class attributes, either in the class body or as class
    keywords (``class MyPlatform(Platform, name="mine", device_type="cpu",
    dispatch_key="CPU")``), and may override the methods. A platform with a ``detector``
    is available when that detector claims the machine. Behaviour beyond this (kernels,
    priorities per op) comes from plugins.
    """

    #: short lower-case name, e.g. ``"cuda"``; matched against plugins' ``platforms``.
    name: ClassVar[str] = "base"
    #: the torch device type of this platform's tensors, e.g. ``"cuda"``.
    device_type: ClassVar[str] = "cpu"
    #: the dispatch key providers of this platform register on, e.g. ``"CUDA"``.
    dispatch_key: ClassVar[str] = "CPU"
    #: the :class:`~opmux.CustomOp` method layers run here when enabled, e.g.
    #: ``"forward_cuda"``. An out-of-tree platform may name its own (``"forward_acme"``):
    #: a layer that defines it runs it, and a layer that does not runs its catalog-op path
    #: (``forward_oot``), whose ops dispatch to this platform's providers by priority.
    #: Checked when the class is created (:func:`check_forward_method`).
    forward_method: ClassVar[str] = "forward_oot"
    #: the cheap detector of this platform (``None``: ``is_available`` decides alone).
    detector: ClassVar[Callable[[], Detection] | None] = None

    def __init_subclass__(cls, *, name: str | None = None, device_type: str | None = None,
                          dispatch_key: str | None = None, forward_method: str | None = None,
                          detector: Callable[[], Detection] | None = None,
                          **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        for attr, value in (("name", name), ("device_type", device_type),
                            ("dispatch_key", dispatch_key), ("forward_method", forward_method),
                            ("detector", detector)):
            if value is not None:
                setattr(cls, attr, value)
        check_forward_method(cls)

    @classmethod
    def is_available(cls) -> bool:
        """Whether this platform can run here (cheap; may import torch only): by default,
        whether its ``detector`` claims the machine."""
        detector = cls.detector
        return detector is not None and detector().claimed

    def default_priority(self, op_name: str) -> list[str]:
        """Platform default provider order for ``op_name`` (empty: no opinion)."""
        return []

    def describe(self) -> dict[str, Any]:
        """Facts for ``opmux info`` (versions, device names)."""
        return {"name": self.name, "device_type": self.device_type,
                "dispatch_key": self.dispatch_key, "forward_method": self.forward_method}

    def __repr__(self) -> str:
        return f"<Platform {self.name} ({self.device_type}, key {self.dispatch_key})>"


class Detection:
    """The outcome of one detector: the platform class path (or ``None``) and why."""

    __slots__ = ("name", "qualname", "reason")

    def __init__(self, name: str, qualname: str | None, reason: str) -> None:
        self.name = name
        self.qualname = qualname
        self.reason = reason

    @property
    def claimed(self) -> bool:
        return self.qualname is not None

    def as_dict(self) -> dict[str, Any]:
        return {"name": self.name, "claimed": self.claimed, "platform": self.qualname,
                "reason": self.reason}


def check_forward_method(cls: type[Platform]) -> None:
    """Raise unless ``cls.forward_method`` names a layer method: an identifier
    ``forward_<something>`` (``"forward"`` itself would make every layer call itself).

    :raises PlatformError: naming the platform, the value and what is expected.
    """
    method = getattr(cls, "forward_method", None)
    if not isinstance(method, str) or not _FORWARD_NAME.fullmatch(method):
        raise PlatformError(
            f"platform {getattr(cls, 'name', cls.__qualname__)!r} "
            f"({cls.__module__}.{cls.__qualname__}): forward_method must name a CustomOp "
            f"method 'forward_<name>' (e.g. 'forward_oot', 'forward_cuda', or the platform's "
            f"own 'forward_acme'), got {method!r}")
