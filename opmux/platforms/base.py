"""The small :class:`Platform` interface every platform implements."""

from __future__ import annotations

from typing import Any, ClassVar

__all__ = ["Detection", "Platform"]


class Platform:
    """What opmux needs to know about a platform, and nothing more.

    Subclasses set the three class attributes and may override the methods. Behaviour
    beyond this (kernels, priorities per op) comes from plugins.
    """

    #: short lower-case name, e.g. ``"cuda"``; matched against plugins' ``platforms``.
    name: ClassVar[str] = "base"
    #: the torch device type of this platform's tensors, e.g. ``"cuda"``.
    device_type: ClassVar[str] = "cpu"
    #: the dispatch key providers of this platform register on, e.g. ``"CUDA"``.
    dispatch_key: ClassVar[str] = "CPU"

    @classmethod
    def is_available(cls) -> bool:
        """Whether this platform can run here (cheap; may import torch only)."""
        return False

    def default_priority(self, op_name: str) -> list[str]:
        """Platform default provider order for ``op_name`` (empty: no opinion)."""
        return []

    def describe(self) -> dict[str, Any]:
        """Facts for ``opmux info`` (versions, device names)."""
        return {"name": self.name, "device_type": self.device_type,
                "dispatch_key": self.dispatch_key}

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
