"""vLLM's layers expose their constructor arguments as same-named attributes; :func:`keep`
sets them in one call (each class declares the attributes' types in its body)."""

from __future__ import annotations

import torch

__all__ = ["keep"]


def keep(layer: torch.nn.Module, **arguments: object) -> None:
    """Set every keyword of ``arguments`` as the attribute of that name on ``layer``."""
    for name, value in arguments.items():
        setattr(layer, name, value)
