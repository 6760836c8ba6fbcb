"""Seeded conformance cases of the Mamba-2 ops ``ssd_chunk_scan`` and ``ssd_state_update``.

Ragged batches (an empty sequence included), sequences with and without an initial state,
one and several groups, ``D`` per head and per channel, the ``z`` gate, ``dt`` clamping, a
state cache in float32 and in x's dtype, strided inputs (``x``, ``B``, ``C`` as column
slices of one projection, as Mamba-2 layers produce them) and a chunk size smaller than the
sequences. The state cache starts random, so unused slots that change are caught.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from opmux.testing.case_table import Case, register_cases
from opmux.testing.seeded import DTYPES, seeded_generator

__all__ = ["register_ssd_cases", "ssd_inputs"]



def ssd_inputs(name: str, lens: list[int], heads: int = 4, head_dim: int = 8,
               state_size: int = 16, groups: int = 2, dtype: torch.dtype = torch.float32,
               state_dtype: torch.dtype = torch.float32, strided: bool = False,
               slots: int = 0) -> dict[str, torch.Tensor]:
    """Seeded inputs for ``len(lens)`` sequences of the given token counts: ``x``, ``dt``,
    ``A``, ``B``, ``C``, ``D``, ``z``, ``dt_bias``, ``ssm_state``, ``state_indices``,
    ``query_start_loc`` (int32) and ``has_initial_state`` (every other sequence)."""
    g = seeded_generator(name)
    tokens, batch = sum(lens), len(lens)

    def rnd(*shape: int, scale: float = 1.0) -> torch.Tensor:
        return torch.randn(shape, generator=g) * scale

    width = heads * head_dim + 2 * groups * state_size
    if strided:  # x | B | C as column slices of one [T, width + 3] projection
        proj = rnd(tokens, width + 3).to(dtype)
        x = proj[:, :heads * head_dim].view(tokens, heads, head_dim)
        b0 = heads * head_dim
        B = proj[:, b0:b0 + groups * state_size].view(tokens, groups, state_size)
        C = proj[:, b0 + groups * state_size:width].view(tokens, groups, state_size)
    else:
        x = rnd(tokens, heads, head_dim).to(dtype)
        B = rnd(tokens, groups, state_size).to(dtype)
        C = rnd(tokens, groups, state_size).to(dtype)
    slots = max(slots, batch + 2)
    return {
        "x": x, "dt": rnd(tokens, heads, scale=0.5).to(dtype),
        "A": -torch.rand(heads, generator=g) - 0.2, "B": B, "C": C,
        "D": rnd(heads), "z": rnd(tokens, heads, head_dim).to(dtype),
        "dt_bias": rnd(heads, scale=0.3),
        "ssm_state": rnd(slots, heads, head_dim, state_size, scale=0.5).to(state_dtype),
        "state_indices": torch.randperm(slots, generator=g)[:batch].to(torch.int32),
        "query_start_loc": torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()],
                                        dtype=torch.int32),
        "has_initial_state": torch.arange(batch) % 2 == 0,
    }


def ssd_chunk_scan_cases() -> Iterator[Case]:
    """Cases of ``ssd_chunk_scan`` (chunk size 4 so that sequences span several chunks)."""
    for tag, dt in DTYPES:
        i = ssd_inputs(f"{tag}-ragged", [5, 1, 0, 9], dtype=dt)
        yield Case(f"{tag}-ragged", (i["x"], i["dt"], i["A"], i["B"], i["C"], i["ssm_state"],
                                     i["state_indices"], i["query_start_loc"],
                                     i["has_initial_state"], i["D"], i["z"], i["dt_bias"],
                                     True, 0.0, None, 4))
    i = ssd_inputs("bf16-state-strided", [3, 7], dtype=torch.bfloat16,
                   state_dtype=torch.bfloat16, strided=True, groups=1)
    yield Case("bf16-state-strided", (i["x"], i["dt"], i["A"], i["B"], i["C"], i["ssm_state"],
                                      i["state_indices"], i["query_start_loc"], None,
                                      i["D"].unsqueeze(-1) * torch.linspace(0.5, 1.5, 8),
                                      None, None, False, 0.0, None, 4))
    i = ssd_inputs("fp32-clamp-int64", [6, 2], heads=6, groups=3, state_size=5)
    yield Case("fp32-clamp-int64", (i["x"], i["dt"], i["A"], i["B"], i["C"], i["ssm_state"],
                                    i["state_indices"].long(), i["query_start_loc"].long(),
                                    i["has_initial_state"], None, i["z"], i["dt_bias"], True,
                                    0.05, 0.4, 3))
    i = ssd_inputs("fp32-one-long", [40], heads=2, head_dim=4, state_size=8, groups=1)
    yield Case("fp32-one-long", (i["x"], i["dt"], i["A"], i["B"], i["C"], i["ssm_state"],
                                 i["state_indices"], i["query_start_loc"]),
               {"D": i["D"], "dt_bias": i["dt_bias"], "dt_softplus": True, "chunk_size": 16})


def ssd_state_update_cases() -> Iterator[Case]:
    """Cases of ``ssd_state_update`` (one token per sequence)."""
    for tag, dt in DTYPES:
        i = ssd_inputs(f"{tag}-decode", [1, 1, 1], dtype=dt)
        yield Case(f"{tag}-decode", (i["x"], i["dt"], i["A"], i["B"], i["C"], i["ssm_state"],
                                     i["state_indices"], i["D"], i["z"], i["dt_bias"], True))
    i = ssd_inputs("bf16-state-strided", [1] * 5, dtype=torch.bfloat16,
                   state_dtype=torch.bfloat16, strided=True, groups=1)
    yield Case("bf16-state-strided", (i["x"], i["dt"], i["A"], i["B"], i["C"], i["ssm_state"],
                                      i["state_indices"].long(), None, None, None, False,
                                      0.0, 0.3))
    i = ssd_inputs("fp32-empty", [], heads=2, head_dim=4, state_size=8, groups=1)
    yield Case("fp32-empty", (i["x"], i["dt"], i["A"], i["B"], i["C"], i["ssm_state"],
                              i["state_indices"]))


def register_ssd_cases() -> None:
    """Register the generators above, ``<op>_cases`` for op ``<op>`` (replacing earlier
    ones)."""
    for generator in (ssd_chunk_scan_cases, ssd_state_update_cases):
        register_cases(generator.__name__.removesuffix("_cases"), generator, replace=True)
