"""Input checks of the Mamba-2 ops (:mod:`opmux.ops.ssd`), shared by every provider.

Providers call them with their own name and ``read_data=False`` where reading index values
would cost a device sync.
"""

from __future__ import annotations

from itertools import pairwise
from typing import Optional

import torch
from torch import Tensor

from opmux.ops.checks.input_errors import input_error, shape_text
from opmux.ops.checks.single_arguments import FLOAT_DTYPES, INDEX_DTYPES, check_tensor
from opmux.ops.checks.symbolic import has_data

__all__ = ["check_ssd_chunk_scan", "check_ssd_chunk_scan_values", "check_ssd_state_update",
           "check_ssd_state_update_values"]


def _floating(op: str, provider: str, name: str, t: Tensor, shape: tuple[int, ...],
              layout: str) -> None:
    if t.dtype not in FLOAT_DTYPES:
        raise input_error(op, provider, name, "a floating tensor", t.dtype)
    if tuple(t.shape) != shape:
        raise input_error(op, provider, name, f"shape {list(shape)} ({layout})", shape_text(t))


def _common(op: str, provider: str, x: Tensor, dt: Tensor, A: Tensor, B: Tensor, C: Tensor,
            ssm_state: Tensor, state_indices: Tensor, D: Optional[Tensor],
            z: Optional[Tensor], dt_bias: Optional[Tensor], dt_min: float,
            dt_max: Optional[float]) -> tuple[int, int]:
    """Checks shared by the scan and the decode update; returns ``(tokens, batch)``."""
    x = check_tensor(op, provider, "x", x)
    if x.dtype not in FLOAT_DTYPES or x.dim() != 3:
        raise input_error(op, provider, "x", "a floating tensor [tokens, heads, head_dim]",
                          f"{x.dtype} {shape_text(x)}")
    tokens, heads, head_dim = x.shape
    B = check_tensor(op, provider, "B", B)
    if B.dtype not in FLOAT_DTYPES or B.dim() != 3 or B.shape[0] != tokens:
        raise input_error(op, provider, "B", f"a floating tensor [{tokens}, groups, "
                          f"state_size]", f"{B.dtype} {shape_text(B)}")
    groups, state_size = B.shape[1], B.shape[2]
    if groups == 0 or heads % groups != 0:
        raise input_error(op, provider, "B", f"a group count dividing heads={heads}", groups)
    _floating(op, provider, "dt", check_tensor(op, provider, "dt", dt), (tokens, heads),
              "tokens, heads")
    _floating(op, provider, "A", check_tensor(op, provider, "A", A), (heads,), "heads")
    _floating(op, provider, "C", check_tensor(op, provider, "C", C), tuple(B.shape),
              "like B")
    ssm_state = check_tensor(op, provider, "ssm_state", ssm_state)
    if ssm_state.dtype not in FLOAT_DTYPES or ssm_state.dim() != 4 or tuple(
            ssm_state.shape[1:]) != (heads, head_dim, state_size):
        raise input_error(op, provider, "ssm_state", f"a floating tensor [slots, {heads}, "
                          f"{head_dim}, {state_size}]", f"{ssm_state.dtype} "
                          f"{shape_text(ssm_state)}")
    state_indices = check_tensor(op, provider, "state_indices", state_indices)
    if state_indices.dtype not in INDEX_DTYPES or state_indices.dim() != 1:
        raise input_error(op, provider, "state_indices", "a 1-d int32/int64 tensor [batch]",
                          f"{state_indices.dtype} {shape_text(state_indices)}")
    if D is not None:
        D = check_tensor(op, provider, "D", D)
        if D.dtype not in FLOAT_DTYPES or tuple(D.shape) not in ((heads,), (heads, head_dim)):
            raise input_error(op, provider, "D", f"None or a floating tensor [{heads}] or "
                              f"[{heads}, {head_dim}]", f"{D.dtype} {shape_text(D)}")
    if z is not None:
        _floating(op, provider, "z", check_tensor(op, provider, "z", z), tuple(x.shape), "like x")
    if dt_bias is not None:
        _floating(op, provider, "dt_bias", check_tensor(op, provider, "dt_bias", dt_bias),
                  (heads,), "heads")
    if dt_min < 0.0 or (dt_max is not None and dt_max < dt_min):
        raise input_error(op, provider, "dt_min/dt_max", "0 <= dt_min <= dt_max",
                          f"({dt_min}, {dt_max})")
    for name, t in (("dt", dt), ("A", A), ("B", B), ("C", C), ("ssm_state", ssm_state),
                    ("state_indices", state_indices), ("D", D), ("z", z),
                    ("dt_bias", dt_bias)):
        if t is not None and t.device != x.device:
            raise input_error(op, provider, name, f"device {x.device}", t.device)
    return tokens, state_indices.shape[0]


def _check_slots(op: str, provider: str, ssm_state: Tensor, state_indices: Tensor) -> None:
    if state_indices.numel() == 0 or not has_data(state_indices):
        return
    lo, hi = int(state_indices.min()), int(state_indices.max())
    slots = ssm_state.shape[0]
    if lo < 0 or hi >= slots:
        raise input_error(op, provider, "state_indices", f"values in [0, {slots}) (ssm_state "
                          "slots)", f"values in [{lo}, {hi}]")
    if torch.unique(state_indices).numel() != state_indices.numel():
        raise input_error(op, provider, "state_indices", "distinct slots (one per sequence)",
                          state_indices.tolist())


def check_ssd_chunk_scan(x: Tensor, dt: Tensor, A: Tensor, B: Tensor, C: Tensor,
                         ssm_state: Tensor, state_indices: Tensor, query_start_loc: Tensor,
                         has_initial_state: Optional[Tensor] = None,
                         D: Optional[Tensor] = None, z: Optional[Tensor] = None,
                         dt_bias: Optional[Tensor] = None, dt_softplus: bool = False,
                         dt_min: float = 0.0, dt_max: Optional[float] = None,
                         chunk_size: int = 256, *, provider: str = "native",
                         read_data: bool = True) -> None:
    """Validate ``ssd_chunk_scan``; with ``read_data``, also the index values (slots in
    range and distinct, ``query_start_loc`` from 0 to the token count, non-decreasing)."""
    op = "ssd_chunk_scan"
    _, batch = _common(op, provider, x, dt, A, B, C, ssm_state, state_indices, D, z,
                       dt_bias, dt_min, dt_max)
    qsl = check_tensor(op, provider, "query_start_loc", query_start_loc)
    if qsl.dtype not in INDEX_DTYPES or tuple(qsl.shape) != (batch + 1,):
        raise input_error(op, provider, "query_start_loc", f"an int32/int64 tensor "
                          f"[{batch + 1}] (state_indices' length + 1)",
                          f"{qsl.dtype} {shape_text(qsl)}")
    if has_initial_state is not None:
        his = check_tensor(op, provider, "has_initial_state", has_initial_state)
        if his.dtype != torch.bool or tuple(his.shape) != (batch,):
            raise input_error(op, provider, "has_initial_state", f"None or a bool tensor "
                              f"[{batch}]", f"{his.dtype} {shape_text(his)}")
    if chunk_size <= 0:
        raise input_error(op, provider, "chunk_size", "a positive int", chunk_size)
    if read_data:
        check_ssd_chunk_scan_values(x, ssm_state, state_indices, qsl, provider=provider)


def check_ssd_chunk_scan_values(x: Tensor, ssm_state: Tensor, state_indices: Tensor,
                                query_start_loc: Tensor, *, provider: str = "native") -> None:
    """The value checks of :func:`check_ssd_chunk_scan` alone (its static checks passed);
    nothing when ``query_start_loc`` holds no data."""
    if not has_data(query_start_loc):
        return
    op = "ssd_chunk_scan"
    tokens = x.shape[0]
    bounds = query_start_loc.tolist()
    if bounds[0] != 0 or bounds[-1] != tokens or any(
            a > b for a, b in pairwise(bounds)):
        raise input_error(op, provider, "query_start_loc", f"non-decreasing offsets from 0 "
                          f"to {tokens} (x's tokens)", bounds)
    _check_slots(op, provider, ssm_state, state_indices)


def check_ssd_state_update(x: Tensor, dt: Tensor, A: Tensor, B: Tensor, C: Tensor,
                           ssm_state: Tensor, state_indices: Tensor,
                           D: Optional[Tensor] = None, z: Optional[Tensor] = None,
                           dt_bias: Optional[Tensor] = None, dt_softplus: bool = False,
                           dt_min: float = 0.0, dt_max: Optional[float] = None, *,
                           provider: str = "native", read_data: bool = True) -> None:
    """Validate ``ssd_state_update`` (one token per sequence: ``state_indices`` has x's
    length); with ``read_data``, the slots must be in range and distinct."""
    op = "ssd_state_update"
    tokens, batch = _common(op, provider, x, dt, A, B, C, ssm_state, state_indices, D, z,
                            dt_bias, dt_min, dt_max)
    if batch != tokens:
        raise input_error(op, provider, "state_indices", f"[{tokens}] (one slot per row "
                          "of x)", shape_text(state_indices))
    if read_data:
        _check_slots(op, provider, ssm_state, state_indices)


def check_ssd_state_update_values(ssm_state: Tensor, state_indices: Tensor, *,
                                  provider: str = "native") -> None:
    """The value check of :func:`check_ssd_state_update` alone (its static checks passed):
    the slots are in range and distinct."""
    _check_slots("ssd_state_update", provider, ssm_state, state_indices)
