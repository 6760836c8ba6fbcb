"""A mixed decode/prefill batch for the Mamba-style layers, and its packed-sequence form.

The layer tests of :mod:`opmux.layers.mamba` and :mod:`opmux.layers.mamba2` run one batch of
two decode rows and two prefill sequences over shared state slots, and check the layers
against the sequential references of :mod:`opmux.testing.ssm_reference`, which take the
whole batch as packed sequences.

>>> from opmux.testing.mamba_batches import mixed_batch, packed_sequences
>>> qsl, idx, init = packed_sequences(mixed_batch())
>>> qsl.tolist(), idx.tolist(), init.tolist()
([0, 1, 2, 7, 11], [3, 0, 1, 2], [True, True, True, False])
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from opmux.layers.mamba import MambaMetadata

__all__ = ["assert_compiled_matches_eager", "init_ssm_layer", "mixed_batch", "packed_sequences"]


def init_ssm_layer(layer: torch.nn.Module, seed: int) -> None:
    """Seeded parameters a state-space layer is stable with: ``A`` negative, norm weights
    near one, small projections and biases."""
    g = torch.Generator().manual_seed(seed)
    for name, p in layer.named_parameters():
        if name == "A":
            p.copy_(-torch.exp(torch.randn(p.shape, generator=g) * 0.5))
        elif "norm" in name:
            p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=g))
        else:
            p.copy_(torch.randn(p.shape, generator=g) * (0.3 if p.dim() > 1 else 0.1))


def mixed_batch() -> MambaMetadata:
    """Two decode rows (slots 3 and 0), then prefills of 5 (slot 1, continuing) and 4 (slot 2,
    fresh) tokens: 11 tokens over 4 state slots."""
    return MambaMetadata(
        num_prefills=2, num_prefill_tokens=9, num_decode_tokens=2,
        query_start_loc_p=torch.tensor([0, 5, 9], dtype=torch.int32),
        state_indices_tensor_p=torch.tensor([1, 2], dtype=torch.int32),
        has_initial_states_p=torch.tensor([True, False]),
        state_indices_tensor_d=torch.tensor([3, 0], dtype=torch.int32))


def packed_sequences(m: MambaMetadata) -> tuple[Tensor, Tensor, Tensor]:
    """``(query_start_loc, cache_indices, has_initial_state)`` of the whole batch as packed
    sequences, decode rows first as one-token sequences that continue their state."""
    assert m.query_start_loc_p is not None and m.state_indices_tensor_p is not None
    assert m.has_initial_states_p is not None and m.state_indices_tensor_d is not None
    nd = m.num_decode_tokens
    qsl = torch.cat([torch.arange(nd), nd + m.query_start_loc_p.long()])
    idx = torch.cat([m.state_indices_tensor_d, m.state_indices_tensor_p])
    init = torch.cat([torch.ones(nd, dtype=torch.bool), m.has_initial_states_p])
    return qsl, idx, init


def assert_compiled_matches_eager(model: torch.nn.Module, layers: Sequence[Any],
                                  caches: Sequence[Sequence[Tensor]],
                                  steps: Sequence[tuple[Tensor, MambaMetadata]]) -> None:
    """Run ``model(hidden, metadata)`` for each of ``steps`` eagerly, then compiled with
    ``fullgraph=True`` (which raises on a graph break), each from its own copy of ``caches``
    (one list of state tensors per layer of ``layers``); assert that the outputs and the
    final states agree."""

    def run(states: list[list[Tensor]], fn: Any) -> list[Tensor]:
        for layer, c in zip(layers, states, strict=True):
            layer.kv_cache = tuple(c)
        return [fn(hidden, meta) for hidden, meta in steps]

    eager = [[t.clone() for t in c] for c in caches]
    compiled = [[t.clone() for t in c] for c in caches]
    want = run(eager, model)
    torch._dynamo.reset()
    got = run(compiled, torch.compile(model, fullgraph=True, backend="aot_eager"))
    torch.testing.assert_close(got, want)
    torch.testing.assert_close(compiled, eager)
