"""The base of the rotary layers: vLLM's dimension attributes, checked once."""

from __future__ import annotations

import math

import torch

from opmux.core.errors import ConfigError
from opmux.layers.custom_op import CustomOp
from opmux.ops.checks import check_int_range


class _RopeLayer(CustomOp):
    """What the rotary layers hold: vLLM's dimension attributes, checked."""

    head_size: int
    rotary_dim: int
    max_position_embeddings: int
    base: float
    is_neox_style: bool
    dtype: torch.dtype

    def _init_rope(self, head_size: int, rotary_dim: int, max_position_embeddings: int,
                   base: float, is_neox_style: bool, dtype: torch.dtype) -> None:
        layer = type(self).__name__
        check_int_range(head_size, f"{layer}: head_size", low=1, error=ConfigError)
        if isinstance(rotary_dim, int) and rotary_dim % 2:
            raise ConfigError(f"{layer}: rotary_dim must be even and in [2, head_size="
                              f"{head_size}], got rotary_dim={rotary_dim}")
        check_int_range(rotary_dim, f"{layer}: rotary_dim", low=2, high=head_size,
                        error=ConfigError)
        if (not isinstance(base, int | float) or isinstance(base, bool)
                or not math.isfinite(base) or base <= 0):
            raise ConfigError(f"{layer}: base (rope_theta) must be a finite number > 0, got "
                              f"{base!r}; the config's rope_theta is the frequency base, "
                              f"usually 10000")
        check_int_range(max_position_embeddings, f"{layer}: max_position_embeddings", low=1,
                        error=ConfigError)
        self.head_size = head_size
        self.rotary_dim = rotary_dim
        self.max_position_embeddings = max_position_embeddings
        self.base = base
        self.is_neox_style = is_neox_style
        self.dtype = dtype
