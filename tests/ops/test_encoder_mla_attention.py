"""encoder_attention, concat_and_cache_mla and mla_attention against plain sequential
references (one sequence, one head, one query row at a time, float64), on every provider
registered for the CPU; decode continuing a prefill; input errors."""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable
from typing import Any

import pytest
import torch

import opmux
from opmux.testing import Case, cases_for
from opmux.testing.attention_cases import mla_case

opmux.load_plugins()

_TOL = {torch.float32: 2e-5, torch.bfloat16: 2e-2, torch.float16: 3e-3}


def _providers(name: str) -> list[str]:
    return sorted(p for p in opmux.get_op(name).supported_providers())


def _impl(name: str, provider: str) -> Callable[..., Any]:
    return opmux.get_op(name).impls[provider].fn


def _taker(name: str, provider: str, *args: Any) -> str:
    """``provider`` when its supports_args takes ``args``, else ``native`` (a declined call
    runs native, whose check gives the error)."""
    pred = opmux.get_op(name).impls[provider].supports_args
    return provider if pred is None or pred(*args) else "native"


def _softmax_sum(scores: list[float], values: list[torch.Tensor]) -> torch.Tensor:
    m = max(scores)
    w = [math.exp(s - m) for s in scores]
    total = sum(w)
    return sum((wi / total * v for wi, v in zip(w, values, strict=True)),
               torch.zeros_like(values[0]))


# -------------------------------------------------------------------------- encoder attention
def encoder_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                      cu_seqlens: torch.Tensor, max_seqlen: int | None,
                      scale: float) -> torch.Tensor:
    tokens, heads, d = q.shape
    group = heads // k.shape[1]
    out = torch.zeros(tokens, heads, d, dtype=torch.float64)
    cu = cu_seqlens.tolist()
    for s0, s1 in itertools.pairwise(cu):
        for i in range(s0, s1):
            for h in range(heads):
                qi = q[i, h].double()
                scores = [float(qi @ k[j, h // group].double()) * scale for j in range(s0, s1)]
                out[i, h] = _softmax_sum(scores, [v[j, h // group].double()
                                                  for j in range(s0, s1)])
    return out


def test_encoder_attention_sequences_do_not_see_each_other() -> None:
    q = torch.zeros(4, 1, 4)
    k = torch.zeros(4, 1, 4)
    v = torch.arange(16, dtype=torch.float32).view(4, 1, 4)
    out = opmux.ops.encoder_attention(q, k, v, torch.tensor([0, 1, 4], dtype=torch.int32), 3,
                                      1.0)
    torch.testing.assert_close(out[0, 0], v[0, 0])
    torch.testing.assert_close(out[1:, 0], v[1:, 0].mean(0).expand(3, 4))


@pytest.mark.parametrize(("over", "match"), [
    ({3: torch.tensor([0, 4, 3], dtype=torch.int32)},
     r"'cu_seqlens' expected non-decreasing offsets from 0 to at most T=6"),
    ({4: 2}, r"'max_seqlen' expected an upper bound of the sequence lengths \(>= 4\), got 2"),
    ({1: torch.randn(6, 3, 8)}, r"'k' expected \[6, Hkv, 8\] with Hkv dividing H=4"),
    ({2: torch.randn(6, 2, 8).double()}, r"'v' expected dtype torch.float32"),
    ({3: torch.tensor([0, 2, 6], dtype=torch.int16)}, r"'cu_seqlens' expected dtype int32"),
    ({5: 0.0}, r"'scale' expected a positive float"),
])
def test_encoder_attention_errors(over: dict[int, Any], match: str) -> None:
    args: list[Any] = [torch.randn(6, 4, 8), torch.randn(6, 2, 8), torch.randn(6, 2, 8),
                       torch.tensor([0, 2, 6], dtype=torch.int32), 4, 0.3]
    for i, value in over.items():
        args[i] = value
    for provider in _providers("encoder_attention"):
        provider = _taker("encoder_attention", provider, *args)
        with pytest.raises(opmux.OpInputError, match=rf"opmux::encoder_attention \(provider "
                           rf"'{provider}'\): argument " + match):
            _impl("encoder_attention", provider)(*args)


# ------------------------------------------------------------------------------------- MLA
def mla_reference(q: torch.Tensor, kv_cache: torch.Tensor, kv_b_weight: torch.Tensor,
                  block_tables: torch.Tensor, seq_lens: torch.Tensor,
                  query_start_loc: torch.Tensor, scale: float, nope: int) -> torch.Tensor:
    """Per query row and head: every visible token's latent up-projected to its key and
    value one at a time (no absorption), float64."""
    tokens, heads, _ = q.shape
    bs, width = kv_cache.shape[1], kv_cache.shape[2]
    lora = kv_b_weight.shape[1]
    w = kv_b_weight.double().view(heads, -1, lora)
    v_dim = w.shape[1] - nope
    out = torch.zeros(tokens, heads, v_dim, dtype=torch.float64)
    qsl = query_start_loc.tolist()
    for i, kv_len in enumerate(seq_lens.tolist()):
        q_len = qsl[i + 1] - qsl[i]
        rows = [kv_cache[int(block_tables[i, t // bs]), t % bs].double() for t in range(kv_len)]
        for j in range(q_len):
            p = kv_len - q_len + j
            for h in range(heads):
                qi = q[qsl[i] + j, h].double()
                scores, values = [], []
                for t in range(p + 1):
                    kv_c, k_pe = rows[t][:lora], rows[t][lora:width]
                    key = torch.cat([w[h, :nope] @ kv_c, k_pe])
                    scores.append(float(qi @ key) * scale)
                    values.append(w[h, nope:] @ kv_c)
                out[qsl[i] + j, h] = _softmax_sum(scores, values)
    return out


def _reference_params() -> list[Any]:
    """(op, provider, case, reference) rows (the encoder's ``long`` cases excepted, as
    before: the sequential reference loops over every query, key and head)."""
    references: dict[str, Callable[..., torch.Tensor]] = {
        "encoder_attention": encoder_reference, "mla_attention": mla_reference}
    return [pytest.param(op, provider, case, ref, id=f"{op}-{provider}-{case.name}")
            for op, ref in references.items() for provider in _providers(op)
            for case in cases_for(op) if not (op == "encoder_attention" and "long" in case.name)]


@pytest.mark.parametrize(("op", "provider", "case", "reference"), _reference_params())
def test_attention_matches_sequential_reference(op: str, provider: str, case: Case,
                                                reference: Callable[..., torch.Tensor]) -> None:
    args, _ = case.materialize("cpu")
    got = _impl(op, provider)(*args)
    want = reference(*args)
    assert got.shape == want.shape and got.dtype == args[0].dtype and got.is_contiguous()
    tol = _TOL[got.dtype]
    torch.testing.assert_close(got.double(), want, atol=tol, rtol=tol)


@pytest.mark.parametrize("provider", _providers("concat_and_cache_mla"))
@pytest.mark.parametrize("case", cases_for("concat_and_cache_mla"), ids=lambda c: c.name)
def test_concat_and_cache_mla_matches_loop(provider: str, case: Case) -> None:
    (kv_c, k_pe, cache, slots), _ = case.materialize("cpu")
    want = cache.clone()
    for t, s in enumerate(slots.tolist()):
        if s >= 0:
            want[s // cache.shape[1], s % cache.shape[1]] = torch.cat([kv_c[t], k_pe[t]])
    _impl("concat_and_cache_mla", provider)(kv_c, k_pe, cache, slots)
    assert torch.equal(cache, want)


def test_concat_and_cache_mla_bad_slot_writes_nothing() -> None:
    cache = torch.zeros(2, 4, 12)
    for provider in _providers("concat_and_cache_mla"):
        with pytest.raises(opmux.OpInputError, match=r"'slot_mapping' expected -1 \(skip\) or "
                           r"slots in \[0, 8\)"):
            _impl("concat_and_cache_mla", provider)(
                torch.ones(2, 8), torch.ones(2, 4), cache, torch.tensor([3, 8]))
        assert not cache.any()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("provider", _providers("mla_attention"))
def test_mla_decode_continues_prefill(provider: str, dtype: torch.dtype) -> None:
    """Prefill N tokens, then decode M one at a time (cache write, then attention), equals a
    prefill of N + M tokens, for two sequences of different lengths in one batch."""
    heads, nope, rope, lora, v_dim, bs = 4, 16, 8, 32, 16, 4
    n, m = [5, 3], 4
    g = torch.Generator().manual_seed(7)
    full = [n_i + m for n_i in n]
    q = [torch.randn(f, heads, nope + rope, generator=g).to(dtype) for f in full]
    kv_c = [torch.randn(f, lora, generator=g).to(dtype) for f in full]
    k_pe = [torch.randn(f, rope, generator=g).to(dtype) for f in full]
    weight = (torch.randn(heads * (nope + v_dim), lora, generator=g) * lora ** -0.5).to(dtype)
    tables = torch.tensor([[0, 1, 2], [3, 4, 5]], dtype=torch.int32)
    scale = (nope + rope) ** -0.5
    attend = _impl("mla_attention", provider)
    write = _impl("concat_and_cache_mla", provider)

    def slots(i: int, positions: range) -> list[int]:
        return [int(tables[i, p // bs]) * bs + p % bs for p in positions]

    def run(q_rows: list[torch.Tensor], kv_rows: list[torch.Tensor], pe_rows: list[torch.Tensor],
            starts: list[int], cache: torch.Tensor) -> torch.Tensor:
        lens = [s + r.shape[0] for s, r in zip(starts, q_rows, strict=True)]
        slot = [x for i, (s, e) in enumerate(zip(starts, lens, strict=True))
                for x in slots(i, range(s, e))]
        write(torch.cat(kv_rows), torch.cat(pe_rows), cache, torch.tensor(slot))
        qsl = torch.tensor([0, *torch.tensor([r.shape[0] for r in q_rows]).cumsum(0).tolist()],
                           dtype=torch.int32)
        return attend(torch.cat(q_rows), cache, weight, tables,
                      torch.tensor(lens, dtype=torch.int32), qsl, scale, nope)

    one_shot = run(q, kv_c, k_pe, [0, 0], torch.zeros(6, bs, lora + rope, dtype=dtype))
    cache = torch.zeros(6, bs, lora + rope, dtype=dtype)
    stepped = [run([x[:n_i] for x, n_i in zip(q, n, strict=True)],
                   [x[:n_i] for x, n_i in zip(kv_c, n, strict=True)],
                   [x[:n_i] for x, n_i in zip(k_pe, n, strict=True)], [0, 0], cache)]
    for step in range(m):
        pos = [n_i + step for n_i in n]
        stepped.append(run([x[p:p + 1] for x, p in zip(q, pos, strict=True)],
                           [x[p:p + 1] for x, p in zip(kv_c, pos, strict=True)],
                           [x[p:p + 1] for x, p in zip(k_pe, pos, strict=True)], pos, cache))
    # reorder the stepped rows into sequence order
    pre = stepped[0].split(n)
    dec = [torch.stack([s[i] for s in stepped[1:]]) for i in range(2)]
    got = torch.cat([torch.cat([pre[i], dec[i]]) for i in range(2)])
    tol = _TOL[dtype]
    torch.testing.assert_close(got.float(), one_shot.float(), atol=tol, rtol=tol)
    want = mla_reference(torch.cat(q), cache, weight, tables,
                         torch.tensor(full, dtype=torch.int32),
                         torch.tensor([0, full[0], sum(full)], dtype=torch.int32), scale, nope)
    torch.testing.assert_close(got.double(), want, atol=tol, rtol=tol)


def _mla_args(**over: Any) -> list[Any]:
    names = list(opmux.get_op("mla_attention").signature.parameters)
    return mla_case("err", q_lens=[2, 1], kv_lens=[5, 9]).args_with(names, **over)


@pytest.mark.parametrize(("over", "match"), [
    ({"seq_lens": torch.tensor([1, 9], dtype=torch.int32)},
     r"'seq_lens' expected kv_len >= q_len=2 .* for sequence 0, got 1"),
    ({"query_start_loc": torch.tensor([0, 2, 4], dtype=torch.int32)},
     r"'query_start_loc' expected non-decreasing offsets from 0 to at most T=3"),
    ({"block_tables": torch.tensor([[99, 0, 0], [1, 2, 3]], dtype=torch.int32)},
     r"'block_tables' expected block ids in \[0, \d+\)"),
    ({"qk_nope_head_dim": 24}, r"'qk_nope_head_dim' expected an int in \(0, 24\)"),
    ({"kv_b_weight": torch.randn(4 * 32, 31)}, r"'kv_b_weight' expected \[4 \* \(16 \+ "
                                               r"v_head_dim\), 32\]"),
    ({"q": torch.randn(3, 4, 24).half()}, r"'q' expected dtype torch.float32"),
])
def test_mla_attention_errors(over: dict[str, Any], match: str) -> None:
    for provider in _providers("mla_attention"):
        args = _mla_args(**over)
        provider = _taker("mla_attention", provider, *args)
        with pytest.raises(opmux.OpInputError, match=rf"opmux::mla_attention \(provider "
                           rf"'{provider}'\): argument " + match):
            _impl("mla_attention", provider)(*args)


def test_fakes_do_not_read_data() -> None:
    from torch._subclasses.fake_tensor import FakeTensorMode

    enc = cases_for("encoder_attention")[0]
    mla = mla_case("fake", q_lens=[3, 1], kv_lens=[7, 4])
    with FakeTensorMode() as mode:
        def fake(args: tuple[Any, ...]) -> list[Any]:
            return [mode.from_tensor(a) if isinstance(a, torch.Tensor) else a for a in args]

        out = opmux.ops.encoder_attention.torch_op(*fake(enc.args))
        assert out.shape == enc.args[0].shape
        out = opmux.ops.mla_attention.torch_op(*fake(mla.args))
        assert out.shape == (4, 4, 16)
