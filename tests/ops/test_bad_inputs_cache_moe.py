"""Bad inputs of the KV-cache and MoE ops, beyond the generic table test.

The rows themselves live in :mod:`opmux.testing.bad_inputs_cache` and
:mod:`opmux.testing.bad_inputs_moe` and run through native and every CPU provider in
``tests/ops/test_bad_inputs.py``. Here: their coverage, Python scalars of the wrong type
(called directly: through the op, torch's schema parser refuses them before opmux runs).
The Triton kernels of the cache ops meet every row in ``tests/ops/test_bad_inputs.py``
(triton lane).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

import opmux
from opmux.testing.bad_inputs import BadInput, bad_inputs_for

CACHE_OPS = ("reshape_and_cache", "paged_attention", "advance_step_flashattn")
MOE_OPS = ("topk_softmax", "grouped_topk", "fused_moe")


def test_registry_covers_cache_and_moe_ops() -> None:
    counts = {name: len(bad_inputs_for(name)) for name in CACHE_OPS + MOE_OPS}
    assert all(n >= 5 for n in counts.values()), counts
    assert sum(counts.values()) >= 80, counts


def _scalar_rows() -> list[Any]:
    """(op, args, argument): wrong Python types for scalar arguments."""
    kc = torch.zeros(4, 4, 2, 8)
    tables = torch.zeros(1, 2, dtype=torch.int32)
    attn = [torch.zeros(1, 2, 8), kc, kc, tables, torch.ones(1, dtype=torch.int32),
            torch.tensor([0, 1], dtype=torch.int32), 0.35, None, None]
    step = [4, 3, 4, torch.zeros(4, dtype=torch.int64), torch.zeros(3, 1, dtype=torch.int64),
            torch.zeros(4, dtype=torch.int64), torch.ones(4, dtype=torch.int32),
            torch.zeros(4, dtype=torch.int64), torch.zeros(4, 2, dtype=torch.int32)]
    logits = torch.randn(3, 8)
    rows = []
    for i, value, argument in ((6, "0.35", "scale"), (7, 2.5, "sliding_window"),
                               (7, True, "sliding_window"), (8, "1", "soft_cap")):
        rows.append(("paged_attention", (*attn[:i], value, *attn[i + 1:]), argument))
    for i, value, argument in ((0, "4", "num_seqs"), (0, 4.0, "num_seqs"),
                               (1, None, "num_queries"), (2, 4.5, "block_size")):
        rows.append(("advance_step_flashattn", (*step[:i], value, *step[i + 1:]), argument))
    rows += [("reshape_and_cache", (torch.zeros(1, 2, 8), torch.zeros(1, 2, 8), kc, kc, [0]),
              "slot_mapping"),
             ("topk_softmax", (logits, 2.0, True), "topk"),
             ("topk_softmax", (logits, None, True), "topk"),
             ("topk_softmax", (logits, 2, "yes"), "renormalize"),
             ("grouped_topk", (logits, 2, True, 4.0, 2), "num_expert_group"),
             ("grouped_topk", (logits, 2, True, 4, 2, None), "scoring_func"),
             ("grouped_topk", (logits, 2, True, 4, 2, "softmax", [0.0] * 8),
              "e_score_correction_bias"),
             ("grouped_topk", (logits, 2, True, 4, 2, "softmax", None, "2"),
              "routed_scaling_factor")]
    return [pytest.param(*r, id=f"{r[0]}-{r[2]}-{i}") for i, r in enumerate(rows)]


@pytest.mark.parametrize(("name", "args", "argument"), _scalar_rows())
def test_wrong_scalar_types_are_input_errors(name: str, args: tuple[Any, ...],
                                             argument: str) -> None:
    opmux.load_plugins()
    op = opmux.get_op(name)
    for provider, impl in op.impls.items():
        if not impl.supported or impl.dispatch_key not in ("CPU", "CompositeExplicitAutograd"):
            continue
        # the predicates never raise on such input; one that declines sends the call to
        # native (checked in this loop too), else the impl refuses it itself
        accepts = impl.supports_args is None or impl.supports_args(*args)
        assert accepts in (True, False)
        if not accepts:
            continue
        with pytest.raises(opmux.OpInputError) as info:
            impl.fn(*args)
        assert (info.value.argument, info.value.provider) == (argument, provider)


@pytest.mark.parametrize(("name", "row"), [
    pytest.param(name, row, id=f"{name}-cuda_c-{row.label}")
    for name in ("reshape_and_cache", "advance_step_flashattn") for row in bad_inputs_for(name)])
def test_bad_input_cuda_c_cache_ops(name: str, row: BadInput) -> None:
    """cuda_c's supports_args declines the row (here for the CPU tensors at least), so the op
    runs native, whose check refuses it."""
    from opmux.plugins.cuda import cuda_c

    assert not getattr(cuda_c, f"{name}_supports")(*row.args, **row.kwargs)
    with pytest.raises(opmux.OpInputError) as info:
        opmux.get_op(name).native(*row.args, **row.kwargs)
    err = info.value
    assert (err.op, err.provider, err.argument) == (f"opmux::{name}", "native", row.argument)
