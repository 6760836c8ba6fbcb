"""Fake (meta) implementations built from an op's check."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

__all__ = ["checked_fake"]


def checked_fake(check: Callable[..., None], like: str, position: int
                 ) -> Callable[..., Tensor]:
    """A fake (meta) implementation for an op whose output is a fresh contiguous tensor
    shaped like its argument ``like`` (at ``position``): it runs ``check`` on the op's
    arguments without reading index values, then returns that empty tensor."""

    def fake(*args: Any, **kwargs: Any) -> Tensor:
        check(*args, **kwargs, read_data=False)
        ref = args[position] if position < len(args) else kwargs[like]
        return torch.empty_like(ref, memory_format=torch.contiguous_format)

    return fake
