"""A small generation engine: paged KV cache, ragged batched prefill, decode steps.

A step is one ragged batch (``query_start_loc`` marks where each sequence's rows start):
the running sequences' decode rows (one token each, moved on in place by
``advance_step_flashattn`` from the last sampled tokens) followed by the prompt rows of the
sequences admitted in this step, so prefill and decode share a step. By default every
prompt is admitted in the first step; with ``max_num_seqs`` the rest wait for a free place.
The KV cache is a pool of fixed-size blocks handed out by a :class:`BlockAllocator`; a
sequence owns ``ceil((prompt + max_tokens) / block_size)`` blocks and gives them back when
it stops (EOS or ``max_tokens``), and the decode state shrinks to the live sequences.

Sampling: greedy when ``temperature == 0``; otherwise logits / temperature, then top-k,
then top-p (nucleus, the smallest set whose probability reaches ``top_p``), drawn from a
``torch.Generator`` seeded with ``seed`` (same seed, same tokens).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from contextlib import nullcontext
from dataclasses import dataclass, field

import torch
from torch import Tensor

import opmux.ops as ops
from opmux.core.errors import ConfigError, OpmuxError
from opmux.core.forward_context import forward_context
from opmux.models._value_checks import (
    MAX_BLOCK_SIZE,
    MAX_INT32,
    check_sampling,
    check_token_ids,
)
from opmux.models.decoder import AttentionBatch, CausalLM
from opmux.models.memory import check_fits, generation_needs
from opmux.ops.checks import check_int_range

__all__ = ["BlockAllocator", "Engine", "GenerationOutput", "SamplingParams"]


class BlockAllocator:
    """A free list of KV-cache block ids ``0 .. num_blocks - 1``."""

    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        self._free = list(range(num_blocks - 1, -1, -1))

    @property
    def num_free(self) -> int:
        """Blocks not handed out."""
        return len(self._free)

    def allocate(self, n: int) -> list[int]:
        """Hand out ``n`` blocks.

        :raises OpmuxError: fewer than ``n`` blocks are free.
        """
        if n > len(self._free):
            raise OpmuxError(f"KV cache exhausted: {n} blocks asked for, {len(self._free)} of "
                             f"{self.num_blocks} free")
        return [self._free.pop() for _ in range(n)]

    def free(self, blocks: Sequence[int]) -> None:
        """Give blocks back."""
        self._free.extend(reversed(blocks))


@dataclass(frozen=True)
class SamplingParams:
    """How tokens are chosen. ``temperature == 0`` is greedy (top-k / top-p unused).

    :ivar top_k: keep the ``top_k`` most likely tokens (``0``: all).
    :ivar top_p: keep the smallest set of tokens whose probability reaches ``top_p``.
    :ivar ignore_eos: do not stop at the model's EOS tokens.
    """

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        check_sampling(self.temperature, self.top_k, self.top_p, self.seed)


@dataclass
class GenerationOutput:
    """Generated ids per prompt (in order), and timings."""

    outputs: list[list[int]]
    prefill_s: float
    decode_s: float
    steps: int
    extra: dict[str, object] = field(default_factory=dict)

    @property
    def tokens_per_s(self) -> float:
        """Generated tokens per second of prefill + decode."""
        n = sum(len(o) for o in self.outputs)
        return n / max(self.prefill_s + self.decode_s, 1e-9)


def sample(logits: Tensor, params: SamplingParams, generator: torch.Generator | None) -> Tensor:
    """Token ids ``[S]`` (int64) from float logits ``[S, vocab]``."""
    if params.temperature == 0.0:
        return logits.argmax(dim=-1)
    logits = logits / params.temperature
    if 0 < params.top_k < logits.shape[-1]:
        kth = logits.topk(params.top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        probs = sorted_logits.softmax(dim=-1)
        before = probs.cumsum(dim=-1) - probs  # mass of the tokens ranked above
        drop = before >= params.top_p
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        logits = torch.empty_like(logits).scatter_(-1, order, sorted_logits)
    probs = logits.softmax(dim=-1)
    return torch.multinomial(probs.cpu(), 1, generator=generator).view(-1).to(logits.device)


class Engine:
    """Runs a :class:`~opmux.models.decoder.CausalLM` on a paged KV cache.

    :param model: the loaded model.
    :param block_size: tokens per KV-cache block.
    :param device: where caches and step tensors live (default: the model's parameters').
    :param pack_weights: give the model's CPU linear weights copies laid out for the GEMM
        libraries (:meth:`~opmux.models.decoder.CausalLM.pack_weights`; float32, and bfloat16
        on CPUs with native bfloat16 compute), which its steps then use (this moves the data of
        float32 weights onto huge pages; the parameters and values stay);
        ``False`` drops copies an earlier ``Engine`` gave the model.
    :raises opmux.models.MemoryBudgetError: the packed copies do not fit the memory available.
    """

    def __init__(self, model: CausalLM, block_size: int = 16,
                 device: torch.device | None = None, pack_weights: bool = True) -> None:
        check_int_range(block_size, "Engine: block_size", low=1, high=MAX_BLOCK_SIZE,
                        error=ConfigError)
        self.model = model
        self.block_size = block_size
        self.device = device or next(model.parameters()).device
        self._moe = model.moe_layers()
        model.pack_weights(pack_weights)

    def forward_step(self, tokens: Tensor, positions: Tensor, cache: list[tuple[Tensor, Tensor]],
                 meta: AttentionBatch) -> Tensor:
        """One model step (the MoE forward context set): last-row logits per sequence."""
        ctx = forward_context(layers=self._moe) if self._moe else nullcontext()
        with ctx, torch.inference_mode():
            out: Tensor = self.model(tokens, positions, cache, meta)
            return out

    def generate(self, prompts: Sequence[Sequence[int]], max_tokens: int,
                 sampling: SamplingParams | None = None,
                 progress: Callable[[int], None] | None = None,
                 max_num_seqs: int | None = None) -> GenerationOutput:
        """Generate up to ``max_tokens`` ids after each prompt.

        :param progress: called with the number of decode-only steps done.
        :param max_num_seqs: at most this many sequences in flight (default: all prompts).
            A prompt waits until a running sequence stops; it is then prefilled in the same
            ragged step as the others' decode rows, and the KV blocks freed by finished
            sequences are reused (the pool holds the largest ``max_num_seqs`` needs).
        :raises opmux.ConfigError: an empty prompt, a token id outside the vocabulary, a
            negative ``max_tokens``, or a sequence longer than ``max_position_embeddings``.
        """
        sampling = sampling or SamplingParams()
        cfg, dev, bs = self.model.config, self.device, self.block_size
        lens = [len(p) for p in prompts]
        if not prompts or min(lens) == 0:
            raise ConfigError("generate: every prompt needs at least one token")
        check_int_range(max_tokens, "generate: max_tokens", low=0, high=MAX_INT32,
                        error=ConfigError)
        check_token_ids(prompts, cfg.vocab_size)
        if max(lens) + max_tokens > cfg.max_position:
            raise ConfigError(f"generate: prompt ({max(lens)}) + max_tokens ({max_tokens}) "
                              f"exceeds max_position_embeddings = {cfg.max_position}")
        s = len(prompts)
        outputs: list[list[int]] = [[] for _ in range(s)]
        if max_tokens == 0:
            return GenerationOutput(outputs, 0.0, 0.0, 0)
        cap = s if max_num_seqs is None else max_num_seqs
        if cap < 1:
            raise ConfigError(f"generate: max_num_seqs must be >= 1, got {max_num_seqs}")
        need = [(n + max_tokens + bs - 1) // bs for n in lens]
        width = max(need)
        alloc = BlockAllocator(sum(sorted(need, reverse=True)[:cap]))
        # the sizes' consequences, checked before the cache is allocated
        check_fits(generation_needs(
            cfg, self.model.dtype, num_blocks=alloc.num_blocks, block_size=bs,
            num_seqs=min(cap, s), step_tokens=sum(sorted(lens, reverse=True)[:cap]),
            tp=self.model.tp_size), dev, "generate")
        # the format the winning paged_attention provider prefers (opmux.kv_cache_format)
        fmt = self.model.kv_cache_format(bs, dev).name
        cache = self.model.new_kv_cache(alloc.num_blocks, bs, dev, fmt)
        owned: dict[int, list[int]] = {}
        eos = set() if sampling.ignore_eos else set(cfg.eos_token_ids)
        gen = (torch.Generator().manual_seed(sampling.seed) if sampling.temperature > 0
               else None)
        waiting = list(range(s))
        live: list[int] = []  # prompt index of each decode-state row
        i64, i32 = torch.int64, torch.int32
        tokens = torch.zeros(0, dtype=i64, device=dev)
        pos, slot = torch.zeros_like(tokens), torch.zeros_like(tokens)
        seq_lens = torch.zeros(0, dtype=i32, device=dev)
        block_tables = torch.zeros(0, width, dtype=i32, device=dev)
        sampled = torch.zeros(0, dtype=i64, device=dev)
        steps, prefill_s, decode_s = 0, 0.0, 0.0
        while live or waiting:
            t0 = time.perf_counter()
            n = len(live)
            if n:  # decode rows: the sampled token at the next position, in place
                ops.advance_step_flashattn(n, n, bs, tokens, sampled.view(n, 1), pos,
                                           seq_lens, slot, block_tables)
            new = waiting[:cap - n]
            del waiting[:len(new)]
            step_tokens, step_pos, step_slot = tokens, pos, slot
            qsl = torch.arange(n + 1, dtype=i32)
            if new:  # prompt rows join the same ragged step after the decode rows
                table = torch.zeros(len(new), width, dtype=i32)
                for row, i in enumerate(new):
                    owned[i] = alloc.allocate(need[i])
                    table[row, :need[i]] = torch.tensor(owned[i], dtype=i32)
                new_lens = [lens[i] for i in new]
                ar = [torch.arange(k) for k in new_lens]
                step_tokens = torch.cat([tokens, torch.tensor(
                    [t for i in new for t in prompts[i]], dtype=i64, device=dev)])
                step_pos = torch.cat([pos, torch.cat(ar).to(dev)])
                step_slot = torch.cat([slot, torch.cat(
                    [table[r, a // bs].long() * bs + a % bs for r, a in enumerate(ar)]
                ).to(dev)])
                qsl = torch.cat([qsl, n + torch.tensor(new_lens).cumsum(0).to(i32)])
                live += new
                seq_lens = torch.cat([seq_lens, torch.tensor(new_lens, dtype=i32, device=dev)])
                block_tables = torch.cat([block_tables, table.to(dev)])
                pad = torch.zeros(len(new), dtype=i64, device=dev)  # set by advance_step
                tokens, pos, slot = (torch.cat([tokens, pad]), torch.cat([pos, pad]),
                                     torch.cat([slot, pad]))
            meta = AttentionBatch(step_slot, block_tables, seq_lens, qsl.to(dev), fmt)
            logits = self.forward_step(step_tokens, step_pos, cache, meta)
            sampled = sample(logits, sampling, gen)
            keep = []
            for row, tok in enumerate(sampled.tolist()):
                i = live[row]
                outputs[i].append(tok)
                if tok in eos or len(outputs[i]) >= max_tokens:
                    alloc.free(owned.pop(i))
                else:
                    keep.append(row)
            if len(keep) < len(live):  # drop the finished rows from the decode state
                idx = torch.tensor(keep, dtype=i64, device=dev)
                live = [live[r] for r in keep]
                sampled, tokens, pos, slot = sampled[idx], tokens[idx], pos[idx], slot[idx]
                seq_lens, block_tables = seq_lens[idx], block_tables[idx]
            elapsed = time.perf_counter() - t0
            if new:
                prefill_s += elapsed
            else:
                decode_s += elapsed
                steps += 1
                if progress is not None:
                    progress(steps)
        return GenerationOutput(outputs, prefill_s, decode_s, steps)
