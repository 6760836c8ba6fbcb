"""``supports_args`` predicates built from an op's static check."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from opmux.core.errors import OpInputError

__all__ = ["static_check_passes", "with_static_check"]


def static_check_passes(check: Callable[..., Any], *args: Any, provider: str,
                        **kwargs: Any) -> bool:
    """Whether ``check(*args, **kwargs, provider=provider, read_data=False)`` passes."""
    try:
        check(*args, **kwargs, provider=provider, read_data=False)
    except OpInputError:
        return False
    return True


def with_static_check(impl: Callable[..., Any], check: Callable[..., Any], provider: str,
                      also: Callable[..., bool] | None = None) -> Callable[..., bool]:
    """The ``supports_args`` of ``impl`` for a provider whose acceptance test would repeat
    most of native's static check: native's ``check`` on metadata (no index values read),
    then ``also`` (the provider's own conditions, same parameters), both on every argument.

    It declines exactly what ``check`` refuses statically, so the impl checks only the index
    values its kernel does not. Meant for ops whose check is long and whose calls are few; a
    hot op writes its conditions inline instead.
    """

    def supports(*args: Any, **kwargs: Any) -> bool:
        return (static_check_passes(check, *args, provider=provider, **kwargs)
                and (also is None or also(*args, **kwargs)))

    supports.__name__ = supports.__qualname__ = f"_{impl.__name__}_supports"
    supports.__module__ = impl.__module__
    supports.__wrapped__ = impl  # type: ignore[attr-defined]  # its signature is impl's
    return supports
