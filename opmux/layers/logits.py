"""The logits processor: LM-head projection, gather to the full vocabulary, soft cap, scale.

Follows vLLM 0.32's ``LogitsProcessor.forward(lm_head, hidden_states, embedding_bias=None,
skip_gather=False)``: ``hidden_states @ lm_head.weightᵀ (+ embedding_bias)``, all-gathered
along the vocabulary through the catalog op :func:`~opmux.ops.communication.all_gather`
when the LM head is vocabulary-parallel, cut to ``org_vocab_size`` (padding dropped), then
``soft_cap · tanh(logits / soft_cap)`` and ``logits *= scale``.

Differences from vLLM: every rank gets the full logits (vLLM gathers to rank 0 only on
platforms without ``use_all_gather``); ``head_dtype`` from vLLM's model config is not read
(logits have the hidden states' dtype); the top-token helpers are not provided. As in
vLLM, ``scale`` is applied in place, so with ``logits_as_input`` the caller's tensor is
scaled.

>>> import torch
>>> from opmux.layers import LogitsProcessor, ParallelLMHead
>>> head = ParallelLMHead(100, 8)
>>> head.weight_loader(head.weight, torch.randn(100, 8))
>>> tuple(LogitsProcessor(100, soft_cap=30.0)(head, torch.randn(3, 8)).shape)
(3, 100)
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from opmux.layers._gemm import dense_linear
from opmux.layers.custom_op import CustomOp
from opmux.layers.embedding import VocabParallelEmbedding
from opmux.ops.communication import all_gather

__all__ = ["LogitsProcessor"]


@CustomOp.register("logits_processor")
class LogitsProcessor(CustomOp):
    """Logits over the full vocabulary from hidden states and a (vocab-parallel) LM head.

    :param vocab_size: vocabulary size.
    :param org_vocab_size: base vocabulary size; logits are cut to it (default
        ``vocab_size``).
    :param scale: multiply the logits by this.
    :param logits_as_input: ``hidden_states`` already are logits (no projection, no gather).
    :param soft_cap: apply ``soft_cap * tanh(logits / soft_cap)`` (before ``scale``).
    """

    def __init__(self, vocab_size: int, org_vocab_size: Optional[int] = None,
                 scale: float = 1.0, logits_as_input: bool = False,
                 soft_cap: Optional[float] = None) -> None:
        super().__init__()
        self.scale = scale
        self.vocab_size = vocab_size
        self.logits_as_input = logits_as_input
        self.org_vocab_size = org_vocab_size or vocab_size
        self.soft_cap = soft_cap

    def forward_native(self, lm_head: VocabParallelEmbedding, hidden_states: Tensor,
                       embedding_bias: Optional[Tensor] = None,
                       skip_gather: bool = False) -> Tensor:
        if self.logits_as_input:
            logits = hidden_states
        else:
            logits = self._get_logits(hidden_states, lm_head, embedding_bias, skip_gather)
        if self.soft_cap is not None:
            logits = torch.tanh(logits / self.soft_cap) * self.soft_cap
        if self.scale != 1.0:
            logits *= self.scale
        return logits

    def _get_logits(self, hidden_states: Tensor, lm_head: VocabParallelEmbedding,
                    embedding_bias: Optional[Tensor], skip_gather: bool) -> Tensor:
        logits = dense_linear(hidden_states, lm_head.weight, embedding_bias)
        if skip_gather:
            return logits
        if lm_head.tp_size > 1:
            logits = all_gather(logits, -1, lm_head.tp_group_name)
        return logits[..., : self.org_vocab_size]

    def extra_repr(self) -> str:
        return (f"vocab_size={self.vocab_size}, org_vocab_size={self.org_vocab_size}, "
                f"scale={self.scale}, logits_as_input={self.logits_as_input}")
