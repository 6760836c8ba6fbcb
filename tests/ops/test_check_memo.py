"""The static-check memo: a layout that passed is not checked again, everything else is."""

from __future__ import annotations

import pytest
import torch

from opmux import OpInputError
from opmux.ops.checks import _memo as _check_memo
from opmux.ops.checks import check_paged_attention, check_reshape_and_cache, check_rms_norm
from opmux.ops.checks.cache import _RESHAPE_AND_CACHE
from opmux.ops.checks.layernorm import _RMS_NORM
from opmux.testing import reset_for_tests


def _cache_args() -> tuple[torch.Tensor, ...]:
    kv = torch.zeros(4, 2, 8, 2, 16)
    key, value = torch.randn(3, 2, 16), torch.randn(3, 2, 16)
    return key, value, kv[:, 0], kv[:, 1], torch.tensor([0, 9, 17])


def test_a_passing_layout_is_remembered_once() -> None:
    reset_for_tests()
    assert len(_RESHAPE_AND_CACHE) == 0
    args = _cache_args()
    check_reshape_and_cache(*args, provider="p")
    check_reshape_and_cache(*args, provider="p")
    assert len(_RESHAPE_AND_CACHE) == 1
    check_reshape_and_cache(*args, provider="q")  # per provider
    assert len(_RESHAPE_AND_CACHE) == 2
    reset_for_tests()
    assert len(_RESHAPE_AND_CACHE) == 0


def test_values_are_checked_on_every_call() -> None:
    key, value, kc, vc, slots = _cache_args()
    check_reshape_and_cache(key, value, kc, vc, slots)
    with pytest.raises(OpInputError, match="slot_mapping"):
        check_reshape_and_cache(key, value, kc, vc, torch.tensor([0, 9, 64]))
    with pytest.raises(OpInputError, match="repeated"):
        check_reshape_and_cache(key, value, kc, vc, torch.tensor([0, 9, 9]))


def test_a_failing_layout_raises_every_time_and_is_not_remembered() -> None:
    reset_for_tests()
    x, w = torch.randn(2, 8), torch.randn(7)
    for _ in range(3):
        with pytest.raises(OpInputError, match="weight"):
            check_rms_norm(x, w, 1e-6)
    assert len(_RMS_NORM) == 0


def test_layouts_differ_by_strides_dtype_and_scalar_type() -> None:
    key, value, kc, vc, slots = _cache_args()
    check_reshape_and_cache(key, value, kc, vc, slots)
    # the same shapes with an overlapping (stride-0) cache: a new layout, checked, refused
    overlapping = kc[:1].expand(4, 8, 2, 16)
    with pytest.raises(OpInputError, match="overlap"):
        check_reshape_and_cache(key, value, overlapping, vc, slots)
    with pytest.raises(OpInputError, match="dtype"):
        check_reshape_and_cache(key.double(), value.double(), kc, vc, slots)
    x, w = torch.randn(2, 8), torch.randn(8)
    check_rms_norm(x, w, 1)       # an int eps is a number
    with pytest.raises(OpInputError, match="eps"):
        check_rms_norm(x, w, True)  # a bool is not, even though True == 1


def test_a_models_parameters_are_described_like_tensors(monkeypatch: pytest.MonkeyPatch
                                                        ) -> None:
    # a layer passes its weight as an nn.Parameter: once its layout passed, the static
    # checks are not run again for it
    from opmux.ops.checks import layernorm

    reset_for_tests()
    x, w = torch.randn(2, 8), torch.nn.Parameter(torch.randn(8))
    assert _check_memo._layout("p", (x, w)) == _check_memo._layout("p", (x, w.detach()))
    check_rms_norm(x, w, 1e-6)
    assert len(_RMS_NORM) == 1
    runs: list[int] = []
    real = layernorm._check_norm
    monkeypatch.setattr(layernorm, "_check_norm", lambda *a: runs.append(1) or real(*a))
    check_rms_norm(torch.randn(2, 8), w, 1e-6)
    assert runs == [] and len(_RMS_NORM) == 1
    check_rms_norm(torch.randn(3, 8), w, 1e-6)  # a new layout is checked
    assert runs == [1] and len(_RMS_NORM) == 2


def test_tensors_that_cannot_be_described_are_checked_every_time() -> None:
    from torch._subclasses.fake_tensor import FakeTensorMode

    assert _check_memo._layout("p", (torch.zeros(2), [1, 2])) is None
    assert _check_memo._layout("p", (torch.zeros(2).to_sparse(),)) is None
    with FakeTensorMode() as mode:
        fake = mode.from_tensor(torch.zeros(2))
        assert _check_memo._layout("p", (fake,)) is None


def test_the_memo_starts_over_when_full(monkeypatch: pytest.MonkeyPatch) -> None:
    reset_for_tests()
    monkeypatch.setattr(_check_memo, "LIMIT", 2)
    w = torch.randn(8)
    for rows in (1, 2, 3):
        check_rms_norm(torch.randn(rows, 8), w, 1e-6)
    assert len(_RMS_NORM) == 1


def test_paged_attention_values_still_checked_after_a_hit() -> None:
    kv = torch.zeros(4, 2, 8, 2, 16)
    q = torch.randn(3, 4, 16)
    bt = torch.tensor([[0, 1], [2, 3]], dtype=torch.int32)
    qsl = torch.tensor([0, 1, 3], dtype=torch.int32)
    ok = torch.tensor([5, 9], dtype=torch.int32)
    check_paged_attention(q, kv[:, 0], kv[:, 1], bt, ok, qsl, 0.25)
    with pytest.raises(OpInputError, match="seq_lens"):
        check_paged_attention(q, kv[:, 0], kv[:, 1], bt, torch.tensor([5, 99], dtype=torch.int32),
                              qsl, 0.25)
    with pytest.raises(OpInputError, match="block_tables"):
        check_paged_attention(q, kv[:, 0], kv[:, 1], torch.tensor([[0, 1], [2, 7]],
                                                                  dtype=torch.int32),
                              ok, qsl, 0.25)
