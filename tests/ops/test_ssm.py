"""The state-space ops (``causal_conv1d``, ``causal_conv1d_update``, ``selective_scan``,
``selective_state_update``) of providers ``native`` and ``cpp`` against the sequential
per-token references: ragged batches, nonzero initial states, padding, fp32 and bf16, and
decode continuing a prefill (prefill N then decode M equals prefill N+M)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

import opmux
from opmux.core.errors import OpInputError
from opmux.testing import TOLERANCES, Case, cases_for
from opmux.testing.ssm_cases import make_scan_inputs
from opmux.testing.ssm_reference import sequential_causal_conv1d, sequential_selective_scan

OPS = ("causal_conv1d", "causal_conv1d_update", "selective_scan", "selective_state_update")
DTYPES = (torch.float32, torch.bfloat16)


@pytest.fixture(scope="module")
def cpp_ops() -> dict[str, Callable[..., Any]]:
    from opmux.plugins.cpu import build

    ok, message = build.build_status()
    assert ok, message
    from opmux.plugins.cpu import cpp_ssm

    return {name: fn for name, (fn, _) in cpp_ssm.OPS.items()}


@pytest.fixture(params=["native", "cpp"])
def impl(request: pytest.FixtureRequest) -> dict[str, Callable[..., Any]]:
    if request.param == "native":
        return {name: opmux.get_op(name).native for name in OPS}
    result: dict[str, Callable[..., Any]] = request.getfixturevalue("cpp_ops")
    return result


def _as_op_runs(impl: dict[str, Any], name: str) -> Any:
    """``impl[name]`` as the op runs it: a call ``cpp``'s supports_args declines runs native,
    whose check gives the error."""
    op = opmux.get_op(name)
    fn, native = impl[name], op.native
    supports = None if fn is native else op.impls["cpp"].supports_args

    def call(*args: Any, **kwargs: Any) -> Any:
        if supports is None or supports(*args, **kwargs):
            return fn(*args, **kwargs)
        return native(*args, **kwargs)

    return call


def _close(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype) -> None:
    atol, rtol = TOLERANCES[dtype]
    assert got.shape == want.shape and got.dtype == want.dtype
    torch.testing.assert_close(got.float(), want.float(), atol=atol, rtol=rtol)


def _ragged() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    qsl = torch.tensor([0, 7, 8, 20, 20, 23], dtype=torch.int32)  # one empty sequence
    idx = torch.tensor([3, 0, 5, 1, -1], dtype=torch.int32)
    init = torch.tensor([True, True, False, True, True])
    return qsl, idx, init


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_causal_conv1d_matches_sequential(impl: dict[str, Any], dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(1)
    qsl, idx, init = _ragged()
    x = torch.randn(23, 48, generator=g).to(dtype)
    w = torch.randn(48, 4, generator=g).to(dtype)
    b = torch.randn(48, generator=g).to(dtype)
    states = torch.randn(6, 48, 3, generator=g).to(dtype)
    want, want_states = sequential_causal_conv1d(x, w, b, states, qsl, idx, init, "silu")
    got = impl["causal_conv1d"](x, w, b, states, qsl, idx, init, "silu")
    _close(got, want, dtype)
    _close(states, want_states, dtype)
    assert torch.equal(got[20:], torch.zeros(3, 48, dtype=dtype))  # the padding sequence


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_selective_scan_matches_sequential(impl: dict[str, Any], dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(2)
    qsl, idx, init = _ragged()
    p = make_scan_inputs(g, 23, 40, 16, dtype)
    states = torch.randn(6, 40, 16, generator=g)
    args = (p["u"], states, p["delta"], p["A"], p["B"], p["C"], p["D"], p["z"],
            p["delta_bias"], True, qsl, idx, init)
    want, want_states = sequential_selective_scan(*args)
    got = impl["selective_scan"](*args)
    _close(got, want, dtype)
    _close(states, want_states, torch.float32)
    assert torch.equal(got[20:], torch.zeros(3, 40, dtype=dtype))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_conv_decode_continues_prefill(impl: dict[str, Any], dtype: torch.dtype) -> None:
    """Prefill N tokens then decode M one at a time equals a prefill of N+M tokens."""
    g = torch.Generator().manual_seed(3)
    n, m, dim = (5, 2), 4, 32
    seqs = [torch.randn(k + m, dim, generator=g).to(dtype) for k in n]
    w = torch.randn(dim, 3, generator=g).to(dtype)
    b = torch.randn(dim, generator=g).to(dtype)
    init_states = torch.randn(2, dim, 2, generator=g).to(dtype)
    slots = torch.tensor([1, 0], dtype=torch.int32)
    has_init = torch.tensor([True, False])

    full_states = init_states.clone()
    lens = [k + m for k in n]
    qsl = torch.tensor([0, lens[0], sum(lens)], dtype=torch.int32)
    full = impl["causal_conv1d"](torch.cat(seqs), w, b, full_states, qsl, slots, has_init)

    states = init_states.clone()
    qsl_n = torch.tensor([0, n[0], sum(n)], dtype=torch.int32)
    prefix = torch.cat([s[:k] for s, k in zip(seqs, n, strict=True)])
    first = impl["causal_conv1d"](prefix, w, b, states, qsl_n, slots, has_init)
    _close(first[:n[0]], full[:n[0]], dtype)
    for step in range(m):
        xs = torch.stack([s[k + step] for s, k in zip(seqs, n, strict=True)])
        y = impl["causal_conv1d_update"](xs, states, w, b, "silu", slots)
        _close(y[0], full[n[0] + step], dtype)
        _close(y[1], full[lens[0] + n[1] + step], dtype)
    _close(states, full_states, dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_scan_decode_continues_prefill(impl: dict[str, Any], dtype: torch.dtype) -> None:
    """Prefill N tokens then decode M one at a time equals a prefill of N+M tokens."""
    g = torch.Generator().manual_seed(4)
    n, m, dim, ns = (6, 3), 5, 24, 16
    lens = [k + m for k in n]
    p = make_scan_inputs(g, sum(lens), dim, ns, dtype)
    init_states = torch.randn(3, dim, ns, generator=g)
    slots = torch.tensor([2, 0], dtype=torch.int32)
    has_init = torch.tensor([True, False])
    tok = {k: p[k] for k in ("u", "delta", "B", "C", "z")}

    full_states = init_states.clone()
    qsl = torch.tensor([0, lens[0], sum(lens)], dtype=torch.int32)
    full = impl["selective_scan"](p["u"], full_states, p["delta"], p["A"], p["B"], p["C"],
                                  p["D"], p["z"], p["delta_bias"], True, qsl, slots, has_init)

    rows = [list(range(0, n[0])), list(range(lens[0], lens[0] + n[1]))]
    pre = {k: v[rows[0] + rows[1]] for k, v in tok.items()}
    states = init_states.clone()
    qsl_n = torch.tensor([0, n[0], sum(n)], dtype=torch.int32)
    first = impl["selective_scan"](pre["u"], states, pre["delta"], p["A"], pre["B"], pre["C"],
                                   p["D"], pre["z"], p["delta_bias"], True, qsl_n, slots,
                                   has_init)
    _close(first[:n[0]], full[:n[0]], dtype)
    for step in range(m):
        at = [n[0] + step, lens[0] + n[1] + step]
        d = {k: v[at] for k, v in tok.items()}
        y = impl["selective_state_update"](states, d["u"], d["delta"], p["A"], d["B"], d["C"],
                                           p["D"], d["z"], p["delta_bias"], True, slots)
        _close(y, full[at], dtype)
    _close(states, full_states, torch.float32)


def test_errors_write_nothing(impl: dict[str, Any]) -> None:
    impl = {name: _as_op_runs(impl, name) for name in OPS}
    x, w = torch.randn(6, 8), torch.randn(8, 4)
    states = torch.randn(2, 8, 3)
    before = states.clone()
    qsl = torch.tensor([0, 2, 6], dtype=torch.int32)
    with pytest.raises(OpInputError, match=r"causal_conv1d.*'cache_indices' expected -1 "
                                           r"\(padding\) or state indices in \[0, 2\)"):
        impl["causal_conv1d"](x, w, None, states, qsl, torch.tensor([0, 2], dtype=torch.int32))
    with pytest.raises(OpInputError, match=r"'query_start_loc' expected non-decreasing"):
        impl["causal_conv1d"](x, w, None, states, torch.tensor([0, 4, 3], dtype=torch.int32))
    with pytest.raises(OpInputError, match=r"'activation' expected None, 'silu' or 'swish'"):
        impl["causal_conv1d_update"](x[:2], states, w, None, "gelu")
    with pytest.raises(OpInputError, match=r"'conv_state' expected \[num_slots, 8, 3\]"):
        impl["causal_conv1d_update"](x[:2], states[:, :, :2], w)
    ssm = torch.randn(2, 8, 4)
    ssm_before = ssm.clone()
    p = make_scan_inputs(torch.Generator().manual_seed(0), 6, 8, 4, torch.float32)
    with pytest.raises(OpInputError, match=r"selective_scan.*'B' expected \[6, 4\]"):
        impl["selective_scan"](p["u"], ssm, p["delta"], p["A"], p["B"][:, :3], p["C"])
    with pytest.raises(OpInputError, match=r"'state_batch_indices' expected -1"):
        impl["selective_state_update"](ssm, p["u"][:2], p["delta"][:2], p["A"], p["B"][:2],
                                       p["C"][:2], state_batch_indices=torch.tensor([0, 5]))
    assert torch.equal(states, before) and torch.equal(ssm, ssm_before)


def _all_cases() -> list[tuple[str, Case]]:
    return [(name, c) for name in OPS for c in cases_for(name)]


@pytest.mark.parametrize("name,case", _all_cases(), ids=lambda v: v if isinstance(v, str)
                         else v.name)
def test_cpp_conformance(cpp_ops: dict[str, Any], name: str, case: Case) -> None:
    from opmux.testing import run_case

    result = run_case(name, "cpp", case)
    assert result.ok, result.describe()


def test_dispatch_serves_cpp_and_compiles() -> None:
    """The global ops pick ``cpp`` on CPU and trace as one node each under torch.compile."""
    opmux.load_plugins()
    p = make_scan_inputs(torch.Generator().manual_seed(5), 4, 16, 8, torch.float32)
    states = torch.zeros(2, 16, 8)
    op = opmux.get_op("selective_scan")
    assert op.dispatch(p["u"], states, p["delta"], p["A"], p["B"], p["C"]).provider == "cpp"

    def f(u: torch.Tensor, st: torch.Tensor) -> torch.Tensor:
        return opmux.ops.selective_scan(u, st, p["delta"], p["A"], p["B"], p["C"], p["D"],
                                        p["z"], p["delta_bias"], True)

    want_states = states.clone()
    want = f(p["u"], want_states)
    got = torch.compile(f, fullgraph=True, backend="eager")(p["u"], states)
    torch.testing.assert_close(got, want)
    torch.testing.assert_close(states, want_states)
