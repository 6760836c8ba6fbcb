"""Vocabulary-parallel embedding and LM head (vLLM 0.32 contract, DESIGN §7 and §9).

The vocabulary is padded to a multiple of ``padding_size`` (64) and split in equal
contiguous shards across the TP ranks; added (LoRA) tokens, if any, are padded and split
separately and sit after the base shard on each rank, as in vLLM. A lookup maps each
token id into this rank's shard, looks it up (ids outside the shard read row 0 and are
zeroed) and all-reduces the partial embeddings through the catalog op
:func:`~opmux.ops.communication.all_reduce_` (in place on the fresh lookup); exactly one
rank contributes each row.

Differences from vLLM: ``quant_config`` must be ``None``, and ``quant_method`` /
``parallel_group`` (a vLLM ``GroupCoordinator``) are not accepted: the TP group comes
from :mod:`opmux.distributed`.

>>> import torch
>>> from opmux.layers import VocabParallelEmbedding
>>> emb = VocabParallelEmbedding(100, 8)
>>> emb.num_embeddings_padded, tuple(emb.weight.shape)
(128, (128, 8))
>>> emb.weight_loader(emb.weight, torch.randn(100, 8))
>>> tuple(emb(torch.tensor([[1, 99]])).shape)
(1, 2, 8)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Final, overload

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.nn import Parameter

from opmux.core.errors import OpmuxError
from opmux.distributed import divide
from opmux.layers._tensor_parallel import (
    copy_checked,
    narrow_full,
    new_param,
    reject_quant_config,
    tp_coords,
)
from opmux.layers.custom_op import CustomOp
from opmux.ops.communication import all_reduce_

__all__ = [
    "DEFAULT_VOCAB_PADDING_SIZE",
    "ParallelLMHead",
    "VocabParallelEmbedding",
    "VocabParallelEmbeddingShardIndices",
    "pad_vocab_size",
]

DEFAULT_VOCAB_PADDING_SIZE: Final = 64
"""The vocabulary is padded to a multiple of this before it is split."""


def pad_vocab_size(vocab_size: int, pad_to: int = DEFAULT_VOCAB_PADDING_SIZE) -> int:
    """``vocab_size`` rounded up to a multiple of ``pad_to``."""
    return -(-vocab_size // pad_to) * pad_to


class _Span:
    """Read-only attribute: ``getattr(obj, end) - getattr(obj, start)``."""

    __slots__ = ("end", "start")

    def __init__(self, start: str, end: str) -> None:
        self.start = start
        self.end = end

    @overload
    def __get__(self, obj: None, owner: type) -> _Span: ...

    @overload
    def __get__(self, obj: object, owner: type | None = None) -> int: ...

    def __get__(self, obj: object, owner: type | None = None) -> int | _Span:
        if obj is None:
            return self
        return int(getattr(obj, self.end)) - int(getattr(obj, self.start))


@dataclass(frozen=True)
class VocabParallelEmbeddingShardIndices:
    """Which token ids one rank holds: base (``org``) and added ranges, padded and not.

    Padded ranges are positions in the padded vocabulary; unpadded ones are the token
    ids that really exist there (clipped to the vocabulary).
    """

    padded_org_vocab_start_index: int
    padded_org_vocab_end_index: int
    padded_added_vocab_start_index: int
    padded_added_vocab_end_index: int
    org_vocab_start_index: int
    org_vocab_end_index: int
    added_vocab_start_index: int
    added_vocab_end_index: int

    num_org_elements = _Span("org_vocab_start_index", "org_vocab_end_index")
    num_added_elements = _Span("added_vocab_start_index", "added_vocab_end_index")
    num_org_elements_padded = _Span("padded_org_vocab_start_index", "padded_org_vocab_end_index")
    num_added_elements_padded = _Span("padded_added_vocab_start_index",
                                      "padded_added_vocab_end_index")

    @property
    def num_org_vocab_padding(self) -> int:
        return self.num_org_elements_padded - self.num_org_elements

    @property
    def num_elements_padded(self) -> int:
        return self.num_org_elements_padded + self.num_added_elements_padded


def _shard_indices(vocab_size_padded: int, org_vocab_size_padded: int, vocab_size: int,
                   org_vocab_size: int, rank: int, world: int, what: str
                   ) -> VocabParallelEmbeddingShardIndices:
    org_per = divide(org_vocab_size_padded, world, f"{what} padded vocab size")
    added_per = divide(vocab_size_padded - org_vocab_size_padded, world,
                       f"{what} padded added vocab size")
    org_lo, org_hi = rank * org_per, (rank + 1) * org_per
    added_lo = org_vocab_size + rank * added_per
    added_hi = added_lo + added_per
    return VocabParallelEmbeddingShardIndices(
        org_lo, org_hi, added_lo, added_hi,
        min(org_lo, org_vocab_size), min(org_hi, org_vocab_size),
        min(added_lo, vocab_size), min(added_hi, vocab_size))


@CustomOp.register("vocab_parallel_embedding")
class VocabParallelEmbedding(CustomOp):
    """Token embedding with the vocabulary split across TP ranks.

    :param num_embeddings: vocabulary size (base plus added tokens).
    :param embedding_dim: hidden size.
    :param params_dtype: parameter dtype (default: torch's default dtype).
    :param org_num_embeddings: base vocabulary size without added (LoRA) tokens
        (default ``num_embeddings``).
    :param padding_size: pad the vocabulary to a multiple of this (default 64).
    :param disable_tp: do not shard.
    :param reduce_results: all-reduce the partial lookups (default); otherwise each rank
        returns its partial embedding.
    :raises opmux.distributed.ParallelSizeError: the TP size does not divide the padded
        vocabulary.
    """

    weight: Parameter

    def __init__(self, num_embeddings: int, embedding_dim: int,
                 params_dtype: torch.dtype | None = None, org_num_embeddings: int | None = None,
                 padding_size: int = DEFAULT_VOCAB_PADDING_SIZE, quant_config: Any = None,
                 prefix: str = "", *, disable_tp: bool = False,
                 reduce_results: bool = True) -> None:
        super().__init__()
        name = type(self).__name__
        reject_quant_config(name, quant_config)
        self.disable_tp = disable_tp
        self.reduce_results = reduce_results
        self.tp_rank, self.tp_size, self.tp_group_name = tp_coords(disable_tp)
        self.num_embeddings = num_embeddings
        self.padding_size = padding_size
        self.org_vocab_size = org_num_embeddings or num_embeddings
        self.num_added_embeddings = num_embeddings - self.org_vocab_size
        self.org_vocab_size_padded = pad_vocab_size(self.org_vocab_size, padding_size)
        self.num_embeddings_padded = pad_vocab_size(
            self.org_vocab_size_padded + self.num_added_embeddings, padding_size)
        self.shard_indices = _shard_indices(
            self.num_embeddings_padded, self.org_vocab_size_padded, num_embeddings,
            self.org_vocab_size, self.tp_rank, self.tp_size, name)
        self.embedding_dim = embedding_dim
        self.num_embeddings_per_partition = divide(self.num_embeddings_padded, self.tp_size,
                                                   f"{name} padded vocab size")
        self.num_org_embeddings_per_partition = self.shard_indices.num_org_elements
        self.num_added_embeddings_per_partition = self.shard_indices.num_added_elements
        self.input_size = self.input_size_per_partition = embedding_dim
        self.output_size = self.num_embeddings_padded
        self.output_size_per_partition = self.num_embeddings_per_partition
        self.output_partition_sizes = [self.output_size_per_partition]
        self.prefix = prefix
        self.params_dtype = params_dtype if params_dtype is not None else torch.get_default_dtype()
        self.weight = self._new_param(self.num_embeddings_per_partition, embedding_dim,
                                      input_dim=1, output_dim=0)

    def _new_param(self, *shape: int, **attrs: Any) -> Parameter:
        return new_param(self.params_dtype, self.weight_loader, *shape, **attrs)

    def weight_loader(self, param: Parameter, loaded_weight: Tensor) -> None:
        """Keep this rank's base-vocabulary rows of the full ``[org_vocab, ...]`` tensor;
        zero the padding (and added-token) rows."""
        name = type(self).__name__
        dim = getattr(param, "output_dim", None)
        if dim is None:
            copy_checked(name, param.data, loaded_weight)
            return
        idx = self.shard_indices
        shard = narrow_full(name, loaded_weight, dim, self.org_vocab_size,
                            idx.org_vocab_start_index, idx.num_org_elements)
        n = shard.shape[dim]
        copy_checked(name, param.data.narrow(dim, 0, n), shard)
        with torch.no_grad():
            param.data.narrow(dim, n, param.shape[dim] - n).zero_()

    def forward_native(self, input_: Tensor) -> Tensor:
        if self.tp_size == 1:
            return F.embedding(input_.long(), self.weight)
        idx = self.shard_indices
        in_org = (input_ >= idx.org_vocab_start_index) & (input_ < idx.org_vocab_end_index)
        in_added = ((input_ >= idx.added_vocab_start_index)
                    & (input_ < idx.added_vocab_end_index))
        # added tokens sit right after this rank's padded base rows
        added_offset = (idx.added_vocab_start_index - idx.num_org_elements
                        - idx.num_org_vocab_padding)
        offset = idx.org_vocab_start_index * in_org + added_offset * in_added
        mine = in_org | in_added
        local = (input_ - offset) * mine
        output = F.embedding(local.long(), self.weight)
        output = output.masked_fill(~mine.unsqueeze(-1), 0)
        if self.reduce_results:
            all_reduce_(output, self.tp_group_name)  # our own fresh tensor: no copy
        return output

    def extra_repr(self) -> str:
        return (f"num_embeddings={self.num_embeddings}, "
                f"num_embeddings_per_partition={self.num_embeddings_per_partition}, "
                f"embedding_dim={self.embedding_dim}, org_vocab_size={self.org_vocab_size}, "
                f"num_embeddings_padded={self.num_embeddings_padded}, tp_size={self.tp_size}")


@CustomOp.register("parallel_lm_head")
class ParallelLMHead(VocabParallelEmbedding):
    """The output projection's weights, vocabulary-parallel; used by
    :class:`~opmux.layers.logits.LogitsProcessor`, never called itself.

    :param bias: add a ``bias`` parameter ``[num_embeddings_per_partition]`` (sharded
        like the weight).
    """

    bias: Parameter | None

    def __init__(self, num_embeddings: int, embedding_dim: int, bias: bool = False,
                 params_dtype: torch.dtype | None = None, org_num_embeddings: int | None = None,
                 padding_size: int = DEFAULT_VOCAB_PADDING_SIZE, quant_config: Any = None,
                 prefix: str = "", *, disable_tp: bool = False) -> None:
        self.has_bias = bias
        super().__init__(num_embeddings, embedding_dim, params_dtype, org_num_embeddings,
                         padding_size, quant_config, prefix, disable_tp=disable_tp)
        self.bias = (self._new_param(self.num_embeddings_per_partition, output_dim=0)
                     if bias else None)

    def tie_weights(self, embed_tokens: VocabParallelEmbedding) -> ParallelLMHead:
        """Share the embedding's weight (tied input and output embeddings)."""
        self.weight = embed_tokens.weight
        return self

    def forward_native(self, input_: Tensor) -> Tensor:
        raise OpmuxError("ParallelLMHead holds the output projection for LogitsProcessor; "
                         "call logits_processor(lm_head, hidden_states) instead")
