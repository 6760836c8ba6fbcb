"""Checks of the values users hand the engine: sizes, token ids, sampling settings.

Each raises :class:`opmux.ConfigError` naming the argument, the value and the range, in the
shape of the op checks (``"generate: max_tokens expected an int in [0, 2147483647], got -1"``,
from :func:`opmux.ops.checks.check_int_range`); ``bool`` is never taken for an integer and a
float never truncated to one.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Sequence
from typing import Any, Final

from opmux.core.errors import ConfigError
from opmux.ops.checks import check_int_range

__all__ = ["MAX_BLOCK_SIZE", "MAX_INT32", "MAX_SEED", "check_sampling", "check_token_ids"]

MAX_BLOCK_SIZE: Final = 1 << 16
"""The largest KV-cache block size (tokens per block) the engine takes."""

MAX_SEED: Final = 2**63 - 1
"""The largest sampling seed (``torch.Generator.manual_seed`` takes 64-bit seeds)."""

MAX_INT32: Final = 2**31 - 1
"""The largest count (``max_tokens``, ``top_k``) the engine takes."""


def check_token_ids(prompts: Sequence[Sequence[Any]], vocab_size: int) -> list[int]:
    """All prompts' ids, flat, each an ``int`` in ``[0, vocab_size)``.

    :raises opmux.ConfigError: naming the first bad id, its prompt and position.
    """
    flat = []
    for i, prompt in enumerate(prompts):
        for j, t in enumerate(prompt):
            try:  # ints, numpy and 0-d tensor integers; never a float (1.7) nor a bool
                value = -1 if isinstance(t, bool) else operator.index(t)
            except TypeError:
                value = -1
            if not 0 <= value < vocab_size:
                raise ConfigError(f"generate: token ids must be in [0, {vocab_size}) and "
                                  f"integers, got {t!r} (prompt {i}, position {j})")
            flat.append(value)
    return flat


def check_sampling(temperature: Any, top_k: Any, top_p: Any, seed: Any) -> None:
    """The :class:`~opmux.models.SamplingParams` fields are in range.

    :raises opmux.ConfigError: naming the field.
    """
    for name, value, ok, expected in (
            ("temperature", temperature, lambda v: 0 <= v, ">= 0"),
            ("top_p", top_p, lambda v: 0 < v <= 1, "in (0, 1]")):
        if (not isinstance(value, int | float) or isinstance(value, bool)
                or not math.isfinite(value) or not ok(value)):
            raise ConfigError(f"SamplingParams: {name} must be a finite number {expected}, "
                              f"got {value!r}")
    check_int_range(top_k, "SamplingParams: top_k", low=0, high=MAX_INT32, error=ConfigError)
    check_int_range(seed, "SamplingParams: seed", low=0, high=MAX_SEED, error=ConfigError)
