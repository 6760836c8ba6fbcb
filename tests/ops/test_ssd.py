"""``ssd_chunk_scan`` and ``ssd_state_update`` (Mamba-2): every CPU provider (native, ``cpp``)
against the per-token reference in fp32 and bf16 on ragged batches with nonzero initial
states; prefill N then decode M equals prefill N+M; chunked prefill continues a prefill;
input errors write nothing; opcheck of the torch ops."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch

import opmux
from opmux.core.errors import OpInputError
from opmux.testing import TOLERANCES
from opmux.testing.conformance import run_opcheck
from opmux.testing.ssd_cases import ssd_inputs
from opmux.testing.ssd_reference import sequential_ssd

PROVIDERS = ("native", "cpp")


@pytest.fixture(autouse=True)
def _plugins() -> Iterator[None]:
    opmux.load_plugins()
    yield


def _impl(name: str, provider: str) -> Any:
    op = opmux.get_op(name)
    if provider not in op.impls or not op.impls[provider].supported:
        pytest.fail(f"{name}: provider {provider!r} missing or unsupported")
    return op.impls[provider].fn


def _as_op_runs(name: str, provider: str) -> Any:
    """``provider``'s impl as the op runs it: a call its supports_args declines runs native,
    whose check gives the error."""
    op = opmux.get_op(name)
    fn, supports = _impl(name, provider), op.impls[provider].supports_args

    def call(*args: Any, **kwargs: Any) -> Any:
        if supports is None or supports(*args, **kwargs):
            return fn(*args, **kwargs)
        return op.native(*args, **kwargs)

    return call


def _close(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype) -> None:
    atol, rtol = TOLERANCES[dtype]
    torch.testing.assert_close(got.float(), want.float(), atol=atol, rtol=rtol)


@pytest.mark.parametrize("provider", PROVIDERS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("groups", [1, 2])
def test_scan_matches_sequential(provider: str, dtype: torch.dtype, groups: int) -> None:
    i = ssd_inputs(f"seq-{dtype}-{groups}", [6, 1, 0, 11], dtype=dtype, groups=groups)
    args = (i["x"], i["dt"], i["A"], i["B"], i["C"])
    state = i["ssm_state"].clone()
    want, want_state = sequential_ssd(*args, i["ssm_state"], i["state_indices"],
                                      i["query_start_loc"], i["has_initial_state"], i["D"],
                                      i["z"], i["dt_bias"], True)
    got = _impl("ssd_chunk_scan", provider)(
        *args, state, i["state_indices"], i["query_start_loc"], i["has_initial_state"],
        i["D"], i["z"], i["dt_bias"], True, 0.0, None, 4)
    assert got.shape == want.shape and got.dtype == dtype
    _close(got, want, dtype)
    _close(state, want_state, torch.float32)
    unused = torch.ones(state.shape[0], dtype=torch.bool)
    unused[i["state_indices"].long()] = False
    assert torch.equal(state[unused], i["ssm_state"][unused])  # other slots untouched


@pytest.mark.parametrize("provider", PROVIDERS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_state_update_matches_sequential(provider: str, dtype: torch.dtype) -> None:
    i = ssd_inputs(f"dec-{dtype}", [1, 1, 1], dtype=dtype, state_dtype=dtype)
    args = (i["x"], i["dt"], i["A"], i["B"], i["C"])
    state = i["ssm_state"].clone()
    want, want_state = sequential_ssd(*args, i["ssm_state"], i["state_indices"], None, None,
                                      i["D"], i["z"], i["dt_bias"], True, 0.0, 2.0)
    got = _impl("ssd_state_update", provider)(*args, state, i["state_indices"], i["D"],
                                               i["z"], i["dt_bias"], True, 0.0, 2.0)
    _close(got, want, dtype)
    _close(state, want_state, dtype)


@pytest.mark.parametrize("provider", PROVIDERS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_prefill_then_decode_equals_longer_prefill(provider: str, dtype: torch.dtype) -> None:
    """Two sequences (7 and 4 prompt tokens, one continuing a nonzero state), then 3 decode
    steps each, against one prefill of all 10 and 7 tokens."""
    n, m = [7, 4], 3
    full = ssd_inputs(f"pd-{dtype}", [k + m for k in n], dtype=dtype)
    scan = _as_op_runs("ssd_chunk_scan", provider)
    update = _as_op_runs("ssd_state_update", provider)
    x, dt, A, B, C, D, z, bias = (full[k] for k in ("x", "dt", "A", "B", "C", "D", "z",
                                                      "dt_bias"))
    idx, init = full["state_indices"], torch.tensor([True, False])
    whole_state = full["ssm_state"].clone()
    qsl = full["query_start_loc"]
    whole = scan(x, dt, A, B, C, whole_state, idx, qsl, init, D, z, bias, True, 0.0, None, 4)

    starts = qsl[:-1].tolist()
    prompt = torch.cat([torch.arange(s, s + k) for s, k in zip(starts, n, strict=True)])
    state = full["ssm_state"].clone()
    y = scan(x[prompt], dt[prompt], A, B[prompt], C[prompt], state, idx,
             torch.tensor([0, n[0], n[0] + n[1]], dtype=torch.int32), init, D, z[prompt], bias,
             True, 0.0, None, 4)
    _close(y, whole[prompt], dtype)
    for step in range(m):
        rows = torch.tensor([s + k + step for s, k in zip(starts, n, strict=True)])
        y = update(x[rows], dt[rows], A, B[rows], C[rows], state, idx, D, z[rows], bias, True)
        _close(y, whole[rows], dtype)
    _close(state, whole_state, torch.float32)


@pytest.mark.parametrize("provider", PROVIDERS)
def test_chunked_prefill_continues(provider: str) -> None:
    """A prefill split in two calls (the second continuing the slot) equals one call, also
    across chunk_size boundaries."""
    i = ssd_inputs("chunked", [13])
    scan = _impl("ssd_chunk_scan", provider)
    args = (i["x"], i["dt"], i["A"], i["B"], i["C"])
    one = i["ssm_state"].clone()
    want = scan(*args, one, i["state_indices"], i["query_start_loc"], None, i["D"], i["z"],
                i["dt_bias"], True, 0.0, None, 5)
    two = i["ssm_state"].clone()
    parts = []
    for lo, hi in ((0, 6), (6, 13)):
        parts.append(scan(*(a[lo:hi] for a in args[:2]), args[2], args[3][lo:hi],
                          args[4][lo:hi], two, i["state_indices"],
                          torch.tensor([0, hi - lo]), None, i["D"], i["z"][lo:hi],
                          i["dt_bias"], True, 0.0, None, 5))
    _close(torch.cat(parts), want, torch.float32)
    _close(two, one, torch.float32)


@pytest.mark.parametrize("provider", PROVIDERS)
def test_errors_write_nothing(provider: str) -> None:
    i = ssd_inputs("errors", [3, 2])
    scan = _as_op_runs("ssd_chunk_scan", provider)
    update = _as_op_runs("ssd_state_update", provider)
    state = i["ssm_state"].clone()
    base = (i["x"], i["dt"], i["A"], i["B"], i["C"], state)
    with pytest.raises(OpInputError, match=rf"ssd_chunk_scan \(provider '{provider}'\): "
                       r"argument 'state_indices' expected values in \[0, 4\)"):
        scan(*base, torch.tensor([1, 4]), i["query_start_loc"])
    with pytest.raises(OpInputError, match=r"'state_indices' expected distinct slots"):
        scan(*base, torch.tensor([1, 1]), i["query_start_loc"])
    with pytest.raises(OpInputError, match=r"'query_start_loc' expected non-decreasing"):
        scan(*base, i["state_indices"], torch.tensor([0, 4, 3], dtype=torch.int32))
    with pytest.raises(OpInputError, match=r"'C' expected shape \[5, 2, 16\]"):
        scan(*base[:4], i["C"][:, :1], state, i["state_indices"], i["query_start_loc"])
    with pytest.raises(OpInputError, match=r"'B' expected a group count dividing heads=4"):
        scan(i["x"], i["dt"], i["A"], i["B"].repeat(1, 3, 1)[:, :3], i["C"][:, :1].repeat(
            1, 3, 1), state, i["state_indices"], i["query_start_loc"])
    with pytest.raises(OpInputError, match=r"ssd_state_update.*'state_indices' expected \[5\]"):
        update(*base, i["state_indices"])
    with pytest.raises(OpInputError, match=r"'dt_min/dt_max' expected 0 <= dt_min <= dt_max"):
        scan(*base, i["state_indices"], i["query_start_loc"], dt_min=0.5, dt_max=0.1)
    assert torch.equal(state, i["ssm_state"])


def test_dispatch_prefers_cpp_and_declines_odd_layouts() -> None:
    i = ssd_inputs("dispatch", [2, 3])
    op = opmux.get_op("ssd_chunk_scan")
    args = (i["x"], i["dt"], i["A"], i["B"], i["C"], i["ssm_state"], i["state_indices"],
            i["query_start_loc"])
    assert op.dispatch(*args).provider == "cpp"
    mixed = (i["x"], i["dt"].double(), *args[2:])  # dt of another dtype: native serves it
    assert op.dispatch(*mixed).provider == "native"
    got = op(*mixed[:5], i["ssm_state"].clone(), *args[6:])
    want = op(*args[:5], i["ssm_state"].clone(), *args[6:])
    _close(got, want, torch.float32)


@pytest.mark.parametrize("name", ["ssd_chunk_scan", "ssd_state_update"])
def test_opcheck(name: str) -> None:
    assert run_opcheck(name)


@pytest.mark.parametrize("name", ["ssd_chunk_scan", "ssd_state_update"])
def test_cpp_conformance(name: str) -> None:
    """Every conformance case (strided inputs, bf16/fp16, clamps, empty) through the kit."""
    from opmux.testing.conformance import check_provider

    report = check_provider(name, "cpp")
    assert report.status == "checked" and report.cases
    assert report.ok, [c for c in report.cases if c.status != "pass"]
