"""Seeded conformance cases of the dense linear op (:mod:`opmux.ops.linear`): ``linear``.

The shapes cover what the providers branch on: one and two rows (a decode step, what the
``cpp`` kernel takes) and more (a prefill), output widths that are and are not multiples of 8
(the kernel's row groups), input widths around one cache line of each dtype (its chunks),
with and without bias, 1-d and 3-d ``x``, and the projections of a small Llama.
"""

from __future__ import annotations

from collections.abc import Iterator

from opmux.testing.case_table import Case, register_cases
from opmux.testing.seeded import DTYPES, seeded_generator, seeded_randn

__all__ = ["linear_cases", "register_linear_cases"]

# (name, x's shape, out): in is x's last dimension
_SHAPES: tuple[tuple[str, tuple[int, ...], int], ...] = (
    ("row-256x256", (1, 256), 256),
    ("row-in1", (1, 1), 9),
    ("row-in15-out7", (1, 15), 7),
    ("row-in33-out9", (1, 33), 9),
    ("row-in100-out300", (1, 100), 300),
    ("two-rows-in777-out61", (2, 777), 61),
    ("two-rows-1024x1024", (2, 1024), 1024),
    ("vector-in64-out24", (64,), 24),
    ("3d-one-token", (1, 1, 512), 1536),
    ("3d-two-sequences", (2, 1, 256), 1000),
    ("prefill-9-rows", (9, 128), 96),
    ("prefill-3d", (2, 5, 64), 40),
)


def linear_cases() -> Iterator[Case]:
    """Cases of ``linear``, every shape in every dtype, with and without bias."""
    for tag, dt in DTYPES:
        for name, x_shape, out in _SHAPES:
            for with_bias in (False, True):
                full = f"{tag}-{name}" + ("-bias" if with_bias else "")
                g = seeded_generator(full)
                x = seeded_randn(g, x_shape, dt, 1.0)
                w = seeded_randn(g, (out, x_shape[-1]), dt, x_shape[-1] ** -0.5)
                args = (x, w, seeded_randn(g, (out,), dt, 1.0)) if with_bias else (x, w)
                yield Case(full, args)


def register_linear_cases() -> None:
    """Register the generator above (replacing an earlier one)."""
    register_cases("linear", linear_cases, replace=True)
