"""paged_attention against an independent loop-per-query oracle, and its input errors."""

from __future__ import annotations

import math

import pytest
import torch

import opmux
from opmux.ops import paged_attention
from opmux.testing import cases_for
from opmux.testing.attention_cases import attention_case


def oracle(query, key_cache, value_cache, block_tables, seq_lens, query_start_loc, scale,
           sliding_window=None, soft_cap=None):  # type: ignore[no-untyped-def]
    """One query row and one head at a time, keys fetched slot by slot, float64."""
    t_total, heads, d = query.shape
    bs, hkv = key_cache.shape[1], key_cache.shape[2]
    out = torch.zeros(t_total, heads, d, dtype=torch.float64)
    qsl = query_start_loc.tolist()
    for i, kv_len in enumerate(seq_lens.tolist()):
        q_len = qsl[i + 1] - qsl[i]
        for j in range(q_len):
            p = kv_len - q_len + j
            visible = [t for t in range(kv_len)
                       if t <= p and (sliding_window is None or t > p - sliding_window)]
            for h in range(heads):
                kvh = h // (heads // hkv)
                q = query[qsl[i] + j, h].double()
                scores, values = [], []
                for t in visible:
                    blk = int(block_tables[i, t // bs])
                    k = key_cache[blk, t % bs, kvh].double()
                    s = float(q @ k) * scale
                    if soft_cap is not None:
                        s = soft_cap * math.tanh(s / soft_cap)
                    scores.append(s)
                    values.append(value_cache[blk, t % bs, kvh].double())
                m = max(scores)
                w = [math.exp(s - m) for s in scores]
                total = sum(w)
                out[qsl[i] + j, h] = sum(wi / total * v for wi, v in zip(w, values, strict=True))
    return out


@pytest.mark.parametrize("case", [c for c in cases_for("paged_attention")
                                  if "d128-long" not in c.name], ids=lambda c: c.name)
def test_native_matches_loop_per_query_oracle(case) -> None:  # type: ignore[no-untyped-def]
    got = paged_attention.native(*case.args)
    args = list(case.args)
    if len(args) == 10:  # a KV-cache format case: the oracle reads the canonical cache
        fmt = opmux.get_kv_cache_format(args.pop())
        args[1], args[2] = fmt.to_canonical(args[1], args[2])
    want = oracle(*args)
    tol = {torch.float32: 1e-5, torch.bfloat16: 1e-2, torch.float16: 2e-3}[got.dtype]
    torch.testing.assert_close(got.double(), want, atol=tol, rtol=tol, equal_nan=True)


def test_padding_rows_are_zero_and_qlen0_sequences_produce_no_rows() -> None:
    case = attention_case("pad", q_lens=[0, 2, 0], kv_lens=[5, 3, 9], pad_rows=2)
    out = paged_attention.native(*case.args)
    assert out.shape == (4, 8, 32)
    assert torch.equal(out[2:], torch.zeros(2, 8, 32))
    assert out[:2].abs().sum() > 0


def test_decode_row_sees_its_whole_window_and_nothing_more() -> None:
    # one query over 5 keys whose values are one-hot in the position: the output is the
    # softmax-weighted average, so only visible positions may carry weight
    kc = torch.zeros(1, 8, 1, 8)
    vc = torch.eye(8).view(8, 1, 8).unsqueeze(0).clone()
    q = torch.zeros(1, 1, 8)
    args = (q, kc, vc, torch.zeros(1, 1, dtype=torch.int32),
            torch.tensor([5], dtype=torch.int32), torch.tensor([0, 1], dtype=torch.int32), 1.0)
    full = paged_attention.native(*args)
    torch.testing.assert_close(full[0, 0], torch.tensor([0.2] * 5 + [0.0] * 3))
    window = paged_attention.native(*args, 2)
    torch.testing.assert_close(window[0, 0], torch.tensor([0, 0, 0, 0.5, 0.5, 0, 0, 0]))


def _args(**over):  # type: ignore[no-untyped-def]
    names = list(paged_attention.signature.parameters)
    return attention_case("err", q_lens=[2, 1], kv_lens=[5, 9]).args_with(names, **over)


@pytest.mark.parametrize(("over", "match"), [
    ({"seq_lens": torch.tensor([1, 9], dtype=torch.int32)},
     r"'seq_lens' expected kv_len >= q_len=2 .* for sequence 0, got 1"),
    ({"seq_lens": torch.tensor([5, 40], dtype=torch.int32)},
     r"'seq_lens' expected values in \[0, 32\]"),
    ({"query_start_loc": torch.tensor([0, 2, 4], dtype=torch.int32)},
     r"'query_start_loc' expected non-decreasing offsets from 0 to at most T=3"),
    ({"block_tables": torch.tensor([[99, 0], [1, 2]], dtype=torch.int32)},
     r"'block_tables' expected block ids in \[0, \d+\)"),
    ({"query": torch.randn(3, 7, 32)},
     r"'query' expected a head count divisible by the cache's Hkv=2, got H=7"),
    ({"query": torch.randn(3, 8, 32).half()}, r"'query' expected the cache's dtype"),
    ({"sliding_window": 0}, r"'sliding_window' expected None or a positive int, got 0"),
    ({"soft_cap": -1.0}, r"'soft_cap' expected None or a positive float"),
    ({"seq_lens": torch.tensor([5, 9, 1], dtype=torch.int32)},
     r"'seq_lens' expected shape \[2\] \(block_tables' S\)"),
])
def test_paged_attention_errors(over, match) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(opmux.OpInputError,
                       match=r"opmux::paged_attention \(provider 'native'\): argument " + match):
        paged_attention.native(*_args(**over))


def test_fake_does_not_read_data() -> None:
    from torch._subclasses.fake_tensor import FakeTensorMode

    case = attention_case("fake", q_lens=[3, 1], kv_lens=[7, 4])
    with FakeTensorMode() as mode:
        fake_args = [mode.from_tensor(a) if isinstance(a, torch.Tensor) else a
                     for a in case.args]
        out = paged_attention.torch_op(*fake_args)
    assert out.shape == case.args[0].shape
