"""The shared checks under torch.compile(fullgraph=True, dynamic=True).

Checks compare symbolic sizes through ``require`` (deferred runtime asserts), never call
``int()``/``bool()`` on them, so a model step calling the activations, the norms and rotary
serves many token counts from one graph.
"""

from __future__ import annotations

from typing import Any

import torch

import opmux.ops
from opmux.ops.rotary import make_cos_sin_cache


def test_one_graph_for_many_token_counts() -> None:
    graphs: list[Any] = []

    def backend(gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Any:
        graphs.append(gm)
        return gm.forward

    cache = make_cos_sin_cache(256, 32)
    weight = torch.ones(128)

    def step(x: torch.Tensor, residual: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        h, res = opmux.ops.fused_add_rms_norm(x, residual, weight, 1e-6)
        h = opmux.ops.rms_norm(h, weight, 1e-5)
        q, k = opmux.ops.rotary_embedding(positions, h, h[:, :64], cache, 32, True)
        up = torch.cat((q, q), dim=-1)
        return (opmux.ops.silu_and_mul(up) + opmux.ops.gelu_and_mul(up, "tanh") + res
                + k.sum(-1, keepdim=True))

    compiled = torch.compile(step, backend=backend, fullgraph=True, dynamic=True)
    torch._dynamo.reset()
    try:
        for tokens in range(3, 19):
            x, res = torch.randn(tokens, 128), torch.randn(tokens, 128)
            positions = torch.randint(0, 256, (tokens,))
            torch.testing.assert_close(compiled(x, res, positions), step(x, res, positions))
    finally:
        torch._dynamo.reset()
    assert 1 <= len(graphs) <= 2, f"{len(graphs)} compilations for 16 token counts"
