"""Triton kernels of the state-space ops (interpreter on CPU, or a GPU) against the sequential
per-token references, and decode continuing a prefill; plus the errors they raise before
writing anything. The conformance cases run in ``test_triton_kernel_cases.py``."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from cuda_refs import close

import opmux.ops
from opmux.core.errors import OpInputError
from opmux.testing.ssm_cases import make_scan_inputs
from opmux.testing.ssm_reference import sequential_causal_conv1d, sequential_selective_scan

pytestmark = pytest.mark.triton

KERNELS = "triton_ssm"
"""The kernel module the ``k`` fixture (conftest) imports."""


def test_sequential_and_decode_continuation(k: Any, device: torch.device) -> None:
    g = torch.Generator().manual_seed(0)
    qsl = torch.tensor([0, 3, 4, 9], dtype=torch.int32)
    idx = torch.tensor([2, -1, 0], dtype=torch.int32)
    init = torch.tensor([True, True, False])
    x, w = torch.randn(9, 20, generator=g), torch.randn(20, 4, generator=g)
    states = torch.randn(3, 20, 3, generator=g)
    want, want_states = sequential_causal_conv1d(x, w, None, states, qsl, idx, init, "silu")
    dev_states = states.to(device)
    got = k.causal_conv1d(x.to(device), w.to(device), None, dev_states, qsl.to(device),
                          idx.to(device), init.to(device), "silu")
    close(got, want.to(device), torch.float32)
    close(dev_states, want_states.to(device), torch.float32)

    p = make_scan_inputs(g, 9, 20, 8, torch.float32)
    ssm = torch.randn(3, 20, 8, generator=g)
    args = (p["u"], ssm, p["delta"], p["A"], p["B"], p["C"], p["D"], p["z"], p["delta_bias"],
            True, qsl, idx, init)
    want, want_ssm = sequential_selective_scan(*args)
    dev = [a.to(device) if isinstance(a, torch.Tensor) else a for a in args]
    close(k.selective_scan(*dev), want.to(device), torch.float32)
    close(dev[1], want_ssm.to(device), torch.float32)

    # prefill 5 tokens of one sequence, then decode 4: equals the prefill of all 9
    one = torch.tensor([0, 5], dtype=torch.int32, device=device)
    slot = torch.tensor([1], dtype=torch.int32, device=device)
    d = {key: v.to(device) for key, v in p.items()}
    full_states = torch.zeros(3, 20, 8, device=device)
    full = k.selective_scan(d["u"], full_states, d["delta"], d["A"], d["B"], d["C"], d["D"],
                            d["z"], d["delta_bias"], True)
    st = torch.zeros(3, 20, 8, device=device)
    k.selective_scan(d["u"][:5], st, d["delta"][:5], d["A"], d["B"][:5], d["C"][:5], d["D"],
                     d["z"][:5], d["delta_bias"], True, one, slot)
    for t in range(5, 9):
        y = k.selective_state_update(st, d["u"][t:t + 1], d["delta"][t:t + 1], d["A"],
                                     d["B"][t:t + 1], d["C"][t:t + 1], d["D"], d["z"][t:t + 1],
                                     d["delta_bias"], True, slot)
        close(y[0], full[t], torch.float32)
    close(st[1], full_states[0], torch.float32)


def test_errors(k: Any, device: torch.device) -> None:
    x, w = torch.randn(4, 8, device=device), torch.randn(8, 4, device=device)
    states = torch.randn(2, 8, 3, device=device)
    before = states.clone()
    # a shape error: triton declines, native's check says why
    assert not k.causal_conv1d_supports(x, w[:4], None, states)
    with pytest.raises(OpInputError, match=r"provider 'native'.*'weight' expected \[8, width\]"):
        opmux.ops.causal_conv1d.native(x, w[:4], None, states)
    # index values are data: triton checks them before the kernel runs
    with pytest.raises(OpInputError, match=r"provider 'triton'.*'conv_state_indices' expected "
                                           r"-1 \(padding\)"):
        k.causal_conv1d_update(x[:2], states, w, None, None,
                               torch.tensor([0, 9], dtype=torch.int32, device=device))
    assert torch.equal(states, before)
