"""Input validation of the state-space ops (``causal_conv1d*``, ``selective_scan``,
``selective_state_update``), shared by the native references and the providers.

Same contract as every module of :mod:`opmux.ops.checks`: static properties always, index
values only when ``read_data`` and the tensors hold data; every failure is an
:class:`opmux.OpInputError` raised before anything is written.
"""

from __future__ import annotations

import itertools
from typing import Final

import torch
from torch import Tensor

from opmux.ops.checks.input_errors import input_error, shape_text
from opmux.ops.checks.single_arguments import (
    INDEX_DTYPES,
    check_floating,
    check_rank,
    check_same_device,
    check_tensor,
)
from opmux.ops.checks.symbolic import has_data

__all__ = [
    "ACTIVATIONS",
    "PAD_SLOT",
    "check_causal_conv1d",
    "check_causal_conv1d_update",
    "check_selective_scan",
    "check_selective_state_update",
    "check_ssm_index_values",
]

ACTIVATIONS: Final = (None, "silu", "swish")
"""Valid ``activation`` values of the causal convolutions (``swish`` is ``silu``)."""

PAD_SLOT: Final = -1
"""A state index of ``-1`` marks a padding entry: no state read or written, output zero."""

def _vector(op: str, provider: str, name: str, t: Tensor | None, n: int) -> None:
    if t is None:
        return
    t = check_tensor(op, provider, name, t)
    check_floating(op, provider, name, t)
    if t.dim() != 1 or t.shape[0] != n:
        raise input_error(op, provider, name, f"shape [{n}]", shape_text(t))


def _index(op: str, provider: str, name: str, t: Tensor | None, n: int,
           dtypes: tuple[torch.dtype, ...] = INDEX_DTYPES) -> None:
    if t is None:
        return
    t = check_tensor(op, provider, name, t)
    if t.dtype not in dtypes:
        want = " or ".join(str(d).removeprefix("torch.") for d in dtypes)
        raise input_error(op, provider, name, f"dtype {want}", t.dtype)
    if t.dim() != 1 or t.shape[0] != n:
        raise input_error(op, provider, name, f"shape [{n}]", shape_text(t))


def _slots(op: str, provider: str, name: str, t: Tensor | None, n_slots: int,
           read_data: bool) -> None:
    if t is None or not read_data or t.numel() == 0 or not has_data(t):
        return
    lo, hi = int(t.min()), int(t.max())
    if lo < PAD_SLOT or hi >= n_slots:
        raise input_error(op, provider, name, f"-1 (padding) or state indices in [0, {n_slots})",
                          f"values in [{lo}, {hi}]")


def _starts(op: str, provider: str, qsl: Tensor | None, tokens: int, read_data: bool) -> int:
    """Validate ``query_start_loc``; returns the number of sequences."""
    if qsl is None:
        return 1
    qsl = check_tensor(op, provider, "query_start_loc", qsl)
    if qsl.dtype not in INDEX_DTYPES or qsl.dim() != 1 or qsl.shape[0] < 1:
        raise input_error(op, provider, "query_start_loc", "an int32/int64 tensor [S+1]",
                          f"{qsl.dtype} {shape_text(qsl)}")
    if read_data:
        _start_values(op, provider, qsl, tokens)
    return int(qsl.shape[0]) - 1


def _start_values(op: str, provider: str, qsl: Tensor | None, tokens: int) -> None:
    if qsl is None or not has_data(qsl):
        return
    v = qsl.tolist()
    if v[0] != 0 or v[-1] != tokens or any(b < a for a, b in itertools.pairwise(v)):
        raise input_error(op, provider, "query_start_loc",
                          f"non-decreasing offsets from 0 to {tokens} (the token count)",
                          v if len(v) <= 16 else f"{v[:8]} ... {v[-4:]}")


def _rows(op: str, provider: str, name: str, t: Tensor, what: str) -> tuple[Tensor, int, int]:
    """``t`` is a floating ``[rows, dim]`` tensor (``what`` names the dims); returns it and
    its two sizes."""
    t = check_tensor(op, provider, name, t)
    check_floating(op, provider, name, t)
    check_rank(op, provider, name, t, 2, what)
    return t, int(t.shape[0]), int(t.shape[1])


def _float_shaped(op: str, provider: str, name: str, t: Tensor, shape: tuple[int, ...],
                  note: str = "") -> Tensor:
    """``t`` is a floating tensor of exactly ``shape`` (``note`` says why, in the error)."""
    t = check_tensor(op, provider, name, t)
    check_floating(op, provider, name, t)
    if tuple(t.shape) != shape:
        raise input_error(op, provider, name, f"[{', '.join(map(str, shape))}]{note}",
                          shape_text(t))
    return t


def _slot_count(op: str, provider: str, name: str, indices: Tensor | None, n: int,
                states_name: str, states: Tensor, per: str) -> None:
    """``indices`` holds ``n`` state indices; without it, ``states`` needs ``n`` slots."""
    _index(op, provider, name, indices, n)
    if indices is None and n > states.shape[0]:
        raise input_error(op, provider, states_name, f"at least {n} slots (one per {per} when "
                          f"{name} is None)", shape_text(states))


def _activation(op: str, provider: str, activation: str | None) -> None:
    if activation not in ACTIVATIONS:
        raise input_error(op, provider, "activation", "None, 'silu' or 'swish'",
                          repr(activation))


def _conv_params(op: str, provider: str, dim: int, weight: Tensor, bias: Tensor | None,
                 state: Tensor) -> None:
    weight = check_tensor(op, provider, "weight", weight)
    check_floating(op, provider, "weight", weight)
    if weight.dim() != 2 or weight.shape[0] != dim or weight.shape[1] < 2:
        raise input_error(op, provider, "weight", f"[{dim}, width] with width >= 2",
                          shape_text(weight))
    _vector(op, provider, "bias", bias, dim)
    width = int(weight.shape[1])
    check_floating(op, provider, "conv_state", state)
    if state.dim() != 3 or tuple(state.shape[1:]) != (dim, width - 1):
        raise input_error(op, provider, "conv_state", f"[num_slots, {dim}, {width - 1}]",
                          shape_text(state))


def check_causal_conv1d(x: Tensor, weight: Tensor, bias: Tensor | None, conv_states: Tensor,
                        query_start_loc: Tensor | None = None,
                        cache_indices: Tensor | None = None,
                        has_initial_state: Tensor | None = None,
                        activation: str | None = "silu", *, provider: str = "native",
                        read_data: bool = True) -> None:
    """Validate ``causal_conv1d``; reads the index tensors when ``read_data``."""
    op = "causal_conv1d"
    x, tokens, dim = _rows(op, provider, "x", x, "[T, dim]")
    conv_states = check_tensor(op, provider, "conv_states", conv_states)
    _conv_params(op, provider, dim, weight, bias, conv_states)
    _activation(op, provider, activation)
    seqs = _starts(op, provider, query_start_loc, tokens, read_data)
    _slot_count(op, provider, "cache_indices", cache_indices, seqs, "conv_states", conv_states,
                "sequence")
    _index(op, provider, "has_initial_state", has_initial_state, seqs, (torch.bool,))
    check_same_device(op, provider, x, weight=weight, conv_states=conv_states)
    _slots(op, provider, "cache_indices", cache_indices, int(conv_states.shape[0]), read_data)


def check_causal_conv1d_update(x: Tensor, conv_state: Tensor, weight: Tensor,
                               bias: Tensor | None = None, activation: str | None = None,
                               conv_state_indices: Tensor | None = None, *,
                               provider: str = "native", read_data: bool = True) -> None:
    """Validate ``causal_conv1d_update``; reads ``conv_state_indices`` when ``read_data``."""
    op = "causal_conv1d_update"
    x, batch, dim = _rows(op, provider, "x", x, "[batch, dim]")
    conv_state = check_tensor(op, provider, "conv_state", conv_state)
    _conv_params(op, provider, dim, weight, bias, conv_state)
    _activation(op, provider, activation)
    _slot_count(op, provider, "conv_state_indices", conv_state_indices, batch, "conv_state",
                conv_state, "row")
    check_same_device(op, provider, x, weight=weight, conv_state=conv_state)
    _slots(op, provider, "conv_state_indices", conv_state_indices, int(conv_state.shape[0]),
           read_data)


def _ssm_params(op: str, provider: str, rows: int, dim: int, states: Tensor, A: Tensor,
                B: Tensor, C: Tensor, D: Tensor | None, z: Tensor | None,
                bias: Tensor | None, bias_name: str) -> int:
    check_floating(op, provider, "ssm_states", states)
    A = check_tensor(op, provider, "A", A)
    check_floating(op, provider, "A", A)
    if A.dim() != 2 or A.shape[0] != dim:
        raise input_error(op, provider, "A", f"[{dim}, dstate]", shape_text(A))
    n = int(A.shape[1])
    if states.dim() != 3 or tuple(states.shape[1:]) != (dim, n):
        raise input_error(op, provider, "ssm_states", f"[num_slots, {dim}, {n}]",
                          shape_text(states))
    for name, t in (("B", B), ("C", C)):
        _float_shaped(op, provider, name, t, (rows, n), " (one row per token)")
    _vector(op, provider, "D", D, dim)
    _vector(op, provider, bias_name, bias, dim)
    if z is not None:
        _float_shaped(op, provider, "z", z, (rows, dim))
    return n


def _scan_inputs(op: str, provider: str, names: tuple[str, str, str], layout: str, x: Tensor,
                 dt: Tensor, states: Tensor, A: Tensor, B: Tensor, C: Tensor,
                 D: Tensor | None, z: Tensor | None, bias: Tensor | None
                 ) -> tuple[Tensor, Tensor, Tensor, int]:
    """What the scan and its single-step update share: ``x [rows, dim]`` (``layout``), its
    time steps of the same shape, the states and the SSM parameters (``names``: those of
    ``x``, the time steps and their bias). Returns ``(x, dt, states, rows)``."""
    x_name, dt_name, bias_name = names
    x, rows, dim = _rows(op, provider, x_name, x, layout)
    dt = _float_shaped(op, provider, dt_name, dt, (rows, dim), f" ({x_name}'s shape)")
    states = check_tensor(op, provider, "ssm_states", states)
    _ssm_params(op, provider, rows, dim, states, A, B, C, D, z, bias, bias_name)
    return x, dt, states, rows


def check_selective_scan(u: Tensor, ssm_states: Tensor, delta: Tensor, A: Tensor, B: Tensor,
                         C: Tensor, D: Tensor | None = None, z: Tensor | None = None,
                         delta_bias: Tensor | None = None, delta_softplus: bool = False,
                         query_start_loc: Tensor | None = None,
                         cache_indices: Tensor | None = None,
                         has_initial_state: Tensor | None = None, *,
                         provider: str = "native", read_data: bool = True) -> None:
    """Validate ``selective_scan``; reads the index tensors when ``read_data``."""
    op = "selective_scan"
    u, delta, ssm_states, tokens = _scan_inputs(op, provider, ("u", "delta", "delta_bias"),
                                                "[T, dim]", u, delta, ssm_states, A, B, C, D,
                                                z, delta_bias)
    seqs = _starts(op, provider, query_start_loc, tokens, read_data)
    _slot_count(op, provider, "cache_indices", cache_indices, seqs, "ssm_states", ssm_states,
                "sequence")
    _index(op, provider, "has_initial_state", has_initial_state, seqs, (torch.bool,))
    check_same_device(op, provider, u, delta=delta, A=A, B=B, C=C, ssm_states=ssm_states)
    _slots(op, provider, "cache_indices", cache_indices, int(ssm_states.shape[0]), read_data)


def check_selective_state_update(ssm_states: Tensor, x: Tensor, dt: Tensor, A: Tensor,
                                 B: Tensor, C: Tensor, D: Tensor | None = None,
                                 z: Tensor | None = None, dt_bias: Tensor | None = None,
                                 dt_softplus: bool = False,
                                 state_batch_indices: Tensor | None = None, *,
                                 provider: str = "native", read_data: bool = True) -> None:
    """Validate ``selective_state_update``; reads ``state_batch_indices`` when ``read_data``."""
    op = "selective_state_update"
    x, dt, ssm_states, batch = _scan_inputs(op, provider, ("x", "dt", "dt_bias"),
                                            "[batch, dim]", x, dt, ssm_states, A, B, C, D, z,
                                            dt_bias)
    _slot_count(op, provider, "state_batch_indices", state_batch_indices, batch, "ssm_states",
                ssm_states, "row")
    check_same_device(op, provider, x, dt=dt, A=A, B=B, C=C, ssm_states=ssm_states)
    _slots(op, provider, "state_batch_indices", state_batch_indices,
           int(ssm_states.shape[0]), read_data)


def check_ssm_index_values(op: str, provider: str, states: Tensor, indices_name: str,
                           indices: Tensor | None, query_start_loc: Tensor | None = None,
                           tokens: int = 0) -> None:
    """The value checks of a state-space op's check alone (its static checks passed):
    ``query_start_loc`` (when given) runs from 0 to ``tokens`` without decreasing, and the
    state indices are -1 (padding) or slots of ``states``; tensors that hold no data are
    not read.

    :param indices_name: the op's name for ``indices`` (``cache_indices``, ...).
    """
    _start_values(op, provider, query_start_loc, tokens)
    _slots(op, provider, indices_name, indices, int(states.shape[0]), True)
