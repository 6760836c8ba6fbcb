"""opmux.testing.views: the views hold the case's values, and the harness catches a provider
that ignores strides."""

from __future__ import annotations

import pytest
import torch
from torch import Tensor

import opmux
from opmux.testing import Case
from opmux.testing.views import VIEW_KINDS, run_variant, strided_variants, strided_view


@pytest.mark.parametrize("kind", VIEW_KINDS)
def test_views_keep_values_and_change_layout(kind: str) -> None:
    t = torch.arange(24.0).reshape(2, 3, 4)
    v = strided_view(t, kind)
    assert v is not None and v.shape == t.shape and v.data_ptr() != t.data_ptr()
    if kind == "expanded":
        assert v.stride(0) == 0 and torch.equal(v, t[:1].expand(t.shape))
        return
    assert torch.equal(v, t)
    if kind == "offset":
        assert v.storage_offset() == 7
    else:
        assert not v.is_contiguous()


def test_views_that_do_not_apply() -> None:
    assert strided_view(torch.tensor(1.0), "noncontiguous") is None
    assert strided_view(torch.arange(3.0), "transposed") is None
    assert strided_view(torch.ones(1, 4), "expanded") is None
    with pytest.raises(ValueError, match="unknown view kind 'diagonal'"):
        strided_view(torch.ones(2), "diagonal")


def test_mutated_arguments_get_no_expanded_view() -> None:
    case = Case("c", (torch.ones(3, 2), torch.ones(3, 2)))
    names = [v.name for v in strided_variants(case, names=["a", "out"], mutated=["out"])]
    assert "a-expanded" in names and "out-expanded" not in names
    assert "out-noncontiguous" in names


def test_harness_fails_a_provider_that_ignores_strides(registry: opmux.OpRegistry,
                                                       ns: str) -> None:
    def double(x: Tensor) -> Tensor:
        return x * 2

    op = registry.register_op(double, name="double", namespace=ns)

    @op.register_impl("flat", dispatch_key="CPU")
    def _(x: Tensor) -> Tensor:  # reads the storage as if x were contiguous
        raw = torch.as_strided(x, x.shape, torch.empty(x.shape).stride(), x.storage_offset())
        return raw * 2

    case = Case("c", (torch.arange(12.0).reshape(3, 4),))
    results = {v.kind: run_variant(op, "flat", v) for v in strided_variants(case)}
    assert results["offset"].status == "pass"
    for kind in ("noncontiguous", "transposed"):
        assert results[kind].status == "fail", (kind, results[kind].describe())
    # the expanded view's storage holds one row: reading it as contiguous runs out of bounds
    assert results["expanded"].status == "error"
