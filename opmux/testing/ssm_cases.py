"""Conformance cases of the state-space ops (``causal_conv1d``, ``causal_conv1d_update``,
``selective_scan``, ``selective_state_update``).

Each op gets fp32 and bf16, ragged packed batches mixing fresh sequences and sequences that
continue from a nonzero cached state, a padding entry (slot ``-1``), state slots in a
shuffled order, a single sequence with every optional argument left out, a bf16 input with an
fp32 state cache, and a transposed (strided) activation, so providers that decline strided
input are seen declining and those that take it are checked on it.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import torch

from opmux.testing.case_table import Case, register_cases
from opmux.testing.seeded import seeded_generator

__all__ = ["make_scan_inputs", "register_ssm_cases"]

_DTYPES: tuple[tuple[str, torch.dtype], ...] = (("fp32", torch.float32), ("bf16", torch.bfloat16))


def _randn(g: torch.Generator, shape: Sequence[int], dtype: torch.dtype = torch.float32,
           scale: float = 1.0) -> torch.Tensor:
    return (torch.randn(tuple(shape), generator=g) * scale).to(dtype)


def _batch(lens: Sequence[int], slots: Sequence[int], init: Sequence[bool]
           ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    qsl = torch.tensor([0, *torch.tensor(list(lens), dtype=torch.int64).cumsum(0).tolist()],
                       dtype=torch.int32)
    return qsl, torch.tensor(list(slots), dtype=torch.int32), torch.tensor(list(init))


#: (name, sequence lengths, slots, has_initial_state, number of slots)
_BATCHES: tuple[tuple[str, tuple[int, ...], tuple[int, ...], tuple[bool, ...], int], ...] = (
    ("ragged", (5, 1, 9, 3), (2, 0, 4, 1), (True, False, True, True), 5),
    ("padding", (4, 2, 6), (1, -1, 0), (False, True, True), 3),
    ("short-long", (1, 2, 17), (0, 1, 2), (True, True, False), 3),
)


def causal_conv1d_cases() -> Iterator[Case]:
    """Cases of ``causal_conv1d``: widths 2-4, bias or not, silu or none."""
    for tag, dt in _DTYPES:
        for name, lens, slots, init, n_slots in _BATCHES:
            for width, act in ((4, "silu"), (2, None), (3, "swish")):
                g = seeded_generator(f"conv-{tag}-{name}-{width}")
                dim = 24
                x = _randn(g, (sum(lens), dim), dt)
                w = _randn(g, (dim, width), dt, 0.5)
                b = _randn(g, (dim,), dt) if act != "swish" else None
                states = _randn(g, (n_slots, dim, width - 1), dt)
                qsl, idx, hi = _batch(lens, slots, init)
                yield Case(f"{tag}-{name}-w{width}-{act}", (x, w, b, states, qsl, idx, hi, act))
    g = seeded_generator("conv-single")
    x = _randn(g, (11, 20))
    yield Case("fp32-single-defaults", (x, _randn(g, (20, 4)), None, torch.zeros(1, 20, 3)))
    qsl, idx, hi = _batch((6, 5), (1, 0), (True, True))
    yield Case("bf16-fp32-states", (x.to(torch.bfloat16), _randn(g, (20, 4), torch.bfloat16),
                                    None, _randn(g, (2, 20, 3)), qsl, idx, hi, "silu"))
    xt = _randn(g, (20, 11)).t()  # [11, 20] transposed view
    yield Case("fp32-transposed", (xt, _randn(g, (20, 4)), _randn(g, (20,)),
                                   _randn(g, (2, 20, 3)), qsl, idx, hi, "silu"))
    yield Case("fp32-empty", (torch.zeros(0, 8), _randn(g, (8, 4)), None, torch.zeros(1, 8, 3),
                              torch.tensor([0], dtype=torch.int32),
                              torch.zeros(0, dtype=torch.int32), torch.zeros(0, dtype=torch.bool)))


def causal_conv1d_update_cases() -> Iterator[Case]:
    """Cases of ``causal_conv1d_update``: shuffled slots, a padding row, no indices."""
    for tag, dt in _DTYPES:
        for width, act in ((4, "silu"), (2, None)):
            g = seeded_generator(f"conv-update-{tag}-{width}")
            dim = 40
            x = _randn(g, (5, dim), dt)
            w = _randn(g, (dim, width), dt, 0.5)
            states = _randn(g, (7, dim, width - 1), dt)
            idx = torch.tensor([6, 0, -1, 3, 2], dtype=torch.int32)
            yield Case(f"{tag}-w{width}-{act}", (x, states, w, _randn(g, (dim,), dt), act, idx))
            yield Case(f"{tag}-w{width}-no-indices", (x, states, w, None, act))
    g = seeded_generator("conv-update-t")
    xt = _randn(g, (16, 3)).t()
    yield Case("fp32-transposed", (xt, _randn(g, (3, 16, 3)), _randn(g, (16, 4)), None,
                                   "silu", torch.tensor([2, 0, 1], dtype=torch.int64)))
    yield Case("bf16-fp32-states", (_randn(g, (3, 16), torch.bfloat16), _randn(g, (3, 16, 3)),
                                    _randn(g, (16, 4), torch.bfloat16), None, "silu"))


def make_scan_inputs(g: torch.Generator, tokens: int, dim: int, dstate: int,
                     dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Mamba-like scan inputs: ``u``, ``delta`` (pre-softplus), ``A`` (negative, fp32),
    ``B``, ``C``, ``D`` and ``delta_bias`` (fp32), ``z``."""
    return {
        "u": _randn(g, (tokens, dim), dtype),
        "delta": _randn(g, (tokens, dim), dtype, 0.5) - 1.0,
        "A": -torch.exp(_randn(g, (dim, dstate), scale=0.5)),
        "B": _randn(g, (tokens, dstate), dtype),
        "C": _randn(g, (tokens, dstate), dtype),
        "D": _randn(g, (dim,)),
        "z": _randn(g, (tokens, dim), dtype),
        "delta_bias": _randn(g, (dim,), scale=0.1),
    }


def _scan_args(p: dict[str, torch.Tensor], states: torch.Tensor, full: bool) -> tuple[Any, ...]:
    if full:
        return (p["u"], states, p["delta"], p["A"], p["B"], p["C"], p["D"], p["z"],
                p["delta_bias"], True)
    # without softplus the time step is taken as given: keep it positive (decaying states)
    delta = torch.nn.functional.softplus(p["delta"].float()).to(p["delta"].dtype)
    return (p["u"], states, delta, p["A"], p["B"], p["C"])


def selective_scan_cases() -> Iterator[Case]:
    """Cases of ``selective_scan``: with and without D/z/bias/softplus, dstate 16 and 5."""
    for tag, dt in _DTYPES:
        for name, lens, slots, init, n_slots in _BATCHES:
            for dstate, full in ((16, True), (5, False)):
                g = seeded_generator(f"scan-{tag}-{name}-{dstate}")
                dim = 20
                p = make_scan_inputs(g, sum(lens), dim, dstate, dt)
                states = _randn(g, (n_slots, dim, dstate), scale=0.5)
                qsl, idx, hi = _batch(lens, slots, init)
                kw = {"query_start_loc": qsl, "cache_indices": idx, "has_initial_state": hi}
                yield Case(f"{tag}-{name}-n{dstate}{'-full' if full else ''}",
                           _scan_args(p, states, full), kw, dtype=dt)
        g = seeded_generator(f"scan-{tag}-bf16-state")
        p = make_scan_inputs(g, 9, 16, 8, dt)
        yield Case(f"{tag}-single-defaults", _scan_args(p, torch.zeros(1, 16, 8, dtype=dt), True),
                   dtype=dt)
    g = seeded_generator("scan-t")
    p = make_scan_inputs(g, 7, 18, 4, torch.float32)
    p["u"] = _randn(g, (18, 7)).t()
    p["delta"] = (_randn(g, (18, 7)) * 0.5 - 1.0).t()
    qsl, idx, hi = _batch((3, 4), (1, 0), (True, False))
    yield Case("fp32-transposed", _scan_args(p, _randn(g, (2, 18, 4)), True),
               {"query_start_loc": qsl, "cache_indices": idx, "has_initial_state": hi})


def selective_state_update_cases() -> Iterator[Case]:
    """Cases of ``selective_state_update``: shuffled slots, a padding row, no indices."""
    for tag, dt in _DTYPES:
        for dstate, full in ((16, True), (3, False)):
            g = seeded_generator(f"ssu-{tag}-{dstate}")
            dim = 36
            p = make_scan_inputs(g, 5, dim, dstate, dt)
            states = _randn(g, (6, dim, dstate), scale=0.5)
            args: tuple[Any, ...] = (states, p["u"], p["delta"], p["A"], p["B"], p["C"])
            if full:
                args += (p["D"], p["z"], p["delta_bias"], True)
            idx = torch.tensor([5, -1, 0, 2, 3], dtype=torch.int32)
            yield Case(f"{tag}-n{dstate}{'-full' if full else ''}", args,
                       {"state_batch_indices": idx}, dtype=dt)
            yield Case(f"{tag}-n{dstate}-no-indices", args, dtype=dt)


def register_ssm_cases() -> None:
    """Register the generators above, ``<op>_cases`` for op ``<op>`` (replacing earlier
    ones)."""
    for generator in (causal_conv1d_cases, causal_conv1d_update_cases, selective_scan_cases,
                      selective_state_update_cases):
        register_cases(generator.__name__.removesuffix("_cases"), generator, replace=True)
