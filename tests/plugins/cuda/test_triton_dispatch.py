"""Provider ``triton`` reached through opmux (torch dispatcher and eager bypass).

The ops live in a fresh registry and namespace; the provider is registered for the key of
the test device (``CPU`` under the interpreter) and put first.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from cuda_refs import close, close_outputs, paged_case

import opmux

pytestmark = pytest.mark.triton


def _inputs(device: torch.device) -> dict[str, tuple[tuple[Any, ...], torch.dtype]]:
    from opmux.ops.rotary import make_cos_sin_cache

    bf, f16, f32 = torch.bfloat16, torch.float16, torch.float32
    x = torch.randn(3, 2 * 40, device=device)
    case = paged_case([1] * 6, [17, 3, 9, 1, 30, 8], 16, 2, 32, 8, f16, device)
    return {
        "silu_and_mul": ((x.to(bf),), bf),
        "gelu_and_mul": ((x.to(f16), "tanh"), f16),
        "rms_norm": ((x, torch.randn(80, device=device), 1e-5), f32),
        "fused_add_rms_norm": ((x.to(bf), x.flip(0).to(bf), torch.randn(80, device=device)), bf),
        "rotary_embedding": ((torch.tensor([1, 4, 2], device=device), x[:, :64], x[:, 16:48],
                              make_cos_sin_cache(8, 16, device=device), 32, False), f32),
        "paged_attention": ((*case.values(), 32 ** -0.5, 6, 30.0), f16),
    }


@pytest.mark.parametrize("wrap", [True, False], ids=["dispatcher", "eager"])
def test_functional_ops_dispatch_to_triton(triton_catalog: dict[str, opmux.Op],
                                           device: torch.device, wrap: bool) -> None:
    for name, (args, dtype) in _inputs(device).items():
        op = triton_catalog[name]
        assert op.dispatch(*args).provider == "triton", op.explain(*args)
        with opmux.enable_torch_wrap(wrap):
            got = op(*args)
        want = op.native(*args)
        close_outputs(got, want, dtype)


def test_mutating_ops_dispatch_to_triton(triton_catalog: dict[str, opmux.Op],
                                         device: torch.device) -> None:
    rac = triton_catalog["reshape_and_cache"]
    key = torch.randn(4, 2, 8, device=device)
    kc = torch.zeros(3, 4, 2, 8, device=device)
    vc = torch.zeros_like(kc)
    slots = torch.tensor([5, -1, 0, 11], device=device)
    assert rac.dispatch(key, key, kc, vc, slots).provider == "triton"
    rac(key, -key, kc, vc, slots)
    assert torch.equal(kc[1, 1], key[0]) and torch.equal(vc[2, 3], -key[3])
    assert kc.view(-1, 2, 8)[[1, 2, 3, 4, 6, 7, 8, 9, 10]].eq(0).all()

    step = triton_catalog["advance_step_flashattn"]
    tokens = torch.zeros(3, dtype=torch.int64, device=device)
    positions = torch.zeros(3, dtype=torch.int64, device=device)
    seq_lens = torch.tensor([6, 8, 3], dtype=torch.int32, device=device)
    slot_mapping = torch.zeros(3, dtype=torch.int64, device=device)
    tables = torch.tensor([[0], [1], [2]], dtype=torch.int32, device=device)
    sampled = torch.tensor([[7], [8]], device=device)
    args = (3, 2, 128, tokens, sampled, positions, seq_lens, slot_mapping, tables)
    assert step.dispatch(*args).provider == "triton"
    step(*args)
    assert slot_mapping.tolist() == [6, 136, -1] and seq_lens.tolist() == [7, 9, 3]


def test_unsupported_args_fall_back_to_native(triton_catalog: dict[str, opmux.Op],
                                              device: torch.device) -> None:
    op = triton_catalog["rms_norm"]
    x = torch.randn(2, 8, dtype=torch.float64, device=device)
    w = torch.ones(8, dtype=torch.float64, device=device)
    assert op.dispatch(x, w).provider == "native"
    close(op(x, w).float(), op.native(x, w).float(), torch.float32)


def test_decode_only_batch_gqa8_window(device: torch.device) -> None:
    # q_len 1 everywhere takes the 16-row tiles: 2 query tokens x 8 heads per program
    from opmux.plugins.cuda import triton_attention

    case = paged_case([1] * 5, [40, 1, 16, 17, 33], 16, 2, 64, 16, torch.bfloat16, device)
    for window in (None, 7):
        got = triton_attention.paged_attention(**case, scale=0.125, sliding_window=window)
        want = opmux.ops.paged_attention.native(**case, scale=0.125, sliding_window=window)
        close(got, want, torch.bfloat16)
