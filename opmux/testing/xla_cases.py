"""Conformance cases of ``xla_gpu::paged_attention`` (the XLA plugin's op).

They reuse the catalog ``paged_attention`` cases in the XLA layout: ``kv_cache`` stacks the
key and value caches as ``[2, num_blocks, block_size, Hkv, D]`` and ``num_seqs`` is a
1-element int32 tensor. Each case also comes as a padded batch bucket: two spare rows in the
tables and ``context_lens`` past ``num_seqs``, filled with values that must be ignored.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from opmux.testing.attention_cases import paged_attention_cases
from opmux.testing.case_table import Case, register_cases

__all__ = ["register_xla_cases", "xla_paged_attention_cases"]

OP = "xla_gpu::paged_attention"


def _to_xla(case: Case, pad: int) -> Case:
    query, kc, vc, tables, seq_lens, qsl, scale, window, soft_cap = case.args
    seqs = tables.shape[0]
    if pad:
        # garbage in the padding rows: block ids and lengths the op must not read
        g = torch.Generator().manual_seed(seqs * 31 + pad)
        junk = torch.randint(0, kc.shape[0], (pad, tables.shape[1]), generator=g,
                             dtype=tables.dtype)
        tables = torch.cat([tables, junk])
        seq_lens = torch.cat([seq_lens, torch.full((pad,), 7, dtype=seq_lens.dtype)])
        qsl = torch.cat([qsl, qsl[-1:].repeat(pad)])
    return Case(f"{case.name}-bucket{seqs + pad}" if pad else case.name,
                (query, torch.stack([kc, vc]), seq_lens, tables, qsl,
                 torch.tensor([seqs], dtype=torch.int32), scale, window, soft_cap),
                dtype=case.dtype, atol=case.atol, rtol=case.rtol)


def xla_paged_attention_cases() -> Iterator[Case]:
    """The catalog attention cases (non-empty batches), plain and as padded buckets."""
    for case in paged_attention_cases():
        if case.args[3].shape[0] == 0:
            continue  # the XLA op always has at least one sequence row
        if len(case.args) > 9:
            continue  # a KV-cache format case: the XLA op reads one fused canonical cache
        yield _to_xla(case, 0)
        if "decode" in case.name or "window" in case.name:
            yield _to_xla(case, 2)


def register_xla_cases() -> None:
    """Register :func:`xla_paged_attention_cases` for ``xla_gpu::paged_attention``."""
    register_cases(OP, xla_paged_attention_cases, replace=True)
