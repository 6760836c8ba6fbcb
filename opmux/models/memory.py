"""What a model and a generation will allocate, checked against the memory there is.

Sizes come from users (``config.json`` fields, ``Engine`` arguments, ``opmux generate``
options); a large one reaching ``torch.empty`` would end the process (an OOM kill, or a
raw ``RuntimeError`` under a memory limit). :func:`model_needs` and :func:`generation_needs`
estimate the allocations that follow from those sizes (weights, cos/sin caches, KV cache,
logits, step activations) and :func:`check_fits` compares them with
:func:`available_bytes` *before* anything is allocated, raising
:class:`MemoryBudgetError` that names the size responsible, what it implies
(``"KV cache of 12.8 GB"``) and what to do.

>>> format_bytes(12_800_000_000)
'12.8 GB'
"""

from __future__ import annotations

import os
import resource
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Final

import torch

from opmux.core.errors import OpmuxError

if TYPE_CHECKING:
    from opmux.models.config import ModelConfig

__all__ = ["MemoryBudgetError", "MemoryNeed", "available_bytes", "check_fits", "format_bytes",
           "generation_needs", "model_needs"]

_VOCAB_PAD: Final = 64
_ROPE_TEMPORARIES: Final = 3  # positions x inv_freq, cos and sin before the cache is cut


class MemoryBudgetError(OpmuxError, MemoryError):
    """What the sizes ask for does not fit the memory available.

    :ivar what: the allocation that does not fit (``"KV cache"``).
    :ivar needed: bytes asked for (all estimated allocations together).
    :ivar available: bytes available.
    """

    def __init__(self, message: str, *, what: str, needed: int, available: int) -> None:
        super().__init__(message)
        self.what, self.needed, self.available = what, needed, available


MemoryBudgetError.__module__ = "opmux.models"


@dataclass(frozen=True)
class MemoryNeed:
    """One estimated allocation.

    :ivar what: ``"weights"``, ``"KV cache"``, ``"cos/sin cache"``, ...
    :ivar nbytes: its size.
    :ivar cause: the sizes it follows from, named as the user gave them.
    :ivar fix: what to change when it does not fit.
    """

    what: str
    nbytes: int
    cause: str
    fix: str


def format_bytes(n: float) -> str:
    """``n`` bytes in decimal units, 3 significant digits (``'12.8 GB'``)."""
    for unit in ("B", "kB", "MB", "GB", "TB", "PB"):
        if abs(n) < 1000 or unit == "PB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.3g} {unit}"
        n /= 1000
    raise AssertionError("unreachable")


def _proc_kib(path: str, key: str) -> int | None:
    try:
        with open(path, encoding="ascii", errors="replace") as fh:
            for line in fh:
                if line.startswith(key + ":"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def _cgroup_headroom() -> int | None:
    try:
        with open("/sys/fs/cgroup/memory.max", encoding="ascii") as fh:
            limit = fh.read().strip()
        with open("/sys/fs/cgroup/memory.current", encoding="ascii") as fh:
            current = int(fh.read().strip())
    except (OSError, ValueError):
        return None
    return None if limit == "max" or not limit.isdigit() else max(0, int(limit) - current)


def available_bytes(device: torch.device | str | None = None) -> int | None:
    """Bytes this process can still allocate on ``device``; ``None`` when unknown.

    CPU: the least of the system's available memory (``MemAvailable``), the cgroup's
    headroom and the address-space limit's (``RLIMIT_AS``) headroom. CUDA: the free device
    memory. Other devices: unknown (no check).
    """
    dev = torch.device(device or "cpu")
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            return None
        free, _ = torch.cuda.mem_get_info(dev)
        return int(free)
    if dev.type != "cpu":
        return None
    bounds = [b for b in (_proc_kib("/proc/meminfo", "MemAvailable"), _cgroup_headroom())
              if b is not None]
    soft, _ = resource.getrlimit(resource.RLIMIT_AS)
    if soft != resource.RLIM_INFINITY:
        used = _proc_kib(f"/proc/{os.getpid()}/status", "VmSize") or 0
        bounds.append(max(0, soft - used))
    return min(bounds) if bounds else None


def check_fits(needs: Sequence[MemoryNeed], device: torch.device | str | None,
               where: str) -> None:
    """Raise :class:`MemoryBudgetError` when ``needs`` together exceed what is available.

    :param where: who asks, for the message (``"config.json"``, ``"generate"``).
    """
    available = available_bytes(device)
    total = sum(n.nbytes for n in needs)
    if available is None or total <= available:
        return
    big = max(needs, key=lambda n: n.nbytes)
    others = ", ".join(f"{n.what} {format_bytes(n.nbytes)}" for n in needs if n is not big)
    raise MemoryBudgetError(
        f"{where}: {big.what} of {format_bytes(big.nbytes)} ({big.cause})"
        f"{' plus ' + others if others else ''} does not fit the "
        f"{format_bytes(available)} of memory available on {torch.device(device or 'cpu')}; "
        f"{big.fix}", what=big.what, needed=total, available=available)


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def _padded_vocab(cfg: ModelConfig) -> int:
    return -(-cfg.vocab_size // _VOCAB_PAD) * _VOCAB_PAD


def model_needs(cfg: ModelConfig, dtype: torch.dtype, tp: int = 1) -> list[MemoryNeed]:
    """The weights and cos/sin caches that building ``cfg`` allocates on one rank."""
    h, d, inter = cfg.hidden_size, cfg.head_dim, cfg.intermediate_size
    attn = h * (cfg.num_heads + 2 * cfg.num_kv_heads) * d + cfg.num_heads * d * h
    mlp = (cfg.num_experts * (3 * h * inter + h) if cfg.num_experts else 3 * h * inter)
    emb = _padded_vocab(cfg) * h * (1 if cfg.tie_word_embeddings else 2)
    params = (cfg.num_layers * (attn + mlp) + emb) // tp + cfg.num_layers * 4 * h + h
    weights = MemoryNeed(
        "weights", params * _itemsize(dtype),
        f"vocab_size={cfg.vocab_size}, hidden_size={h}, intermediate_size={inter}, "
        f"num_hidden_layers={cfg.num_layers}"
        + (f", num_local_experts={cfg.num_experts}" if cfg.num_experts else ""),
        "check these config.json fields, use a smaller dtype or more tensor-parallel ranks")
    scale = cfg.rope_parameters.get("factor", 1.0)
    stretch = scale if cfg.rope_parameters.get("rope_type", cfg.rope_parameters.get(
        "type")) in ("linear", "dynamic") and isinstance(scale, int | float) else 1.0
    positions = int(cfg.max_position * max(1.0, float(stretch)))
    rope = MemoryNeed(
        "cos/sin cache", positions * d * 4 * _ROPE_TEMPORARIES,
        f"max_position_embeddings={cfg.max_position}, head_dim={d}"
        + (f", rope factor {stretch:g}" if stretch > 1 else ""),
        "check max_position_embeddings in config.json")
    return [weights, rope]


def generation_needs(cfg: ModelConfig, dtype: torch.dtype, *, num_blocks: int,
                     block_size: int, num_seqs: int, step_tokens: int,
                     tp: int = 1) -> list[MemoryNeed]:
    """The KV cache, logits and step activations of one ``Engine.generate`` on one rank."""
    kv_heads = max(1, cfg.num_kv_heads // tp)
    kv = MemoryNeed(
        "KV cache", 2 * cfg.num_layers * num_blocks * block_size * kv_heads * cfg.head_dim
        * _itemsize(dtype),
        f"{num_blocks} blocks of block_size {block_size} for {num_seqs} sequence(s), "
        f"{cfg.num_layers} layers x {kv_heads} KV heads x head_dim {cfg.head_dim}",
        "lower the block size (--block-size), max_tokens (--max-tokens), the prompts' length "
        "or their number")
    logits = MemoryNeed(
        "logits", num_seqs * _padded_vocab(cfg) * 4 * 3,
        f"{num_seqs} sequence(s) x vocab_size {cfg.vocab_size}",
        "generate for fewer prompts at once (max_num_seqs)")
    width = max(4 * cfg.hidden_size, 3 * cfg.intermediate_size // tp,
                (cfg.num_heads + 2 * cfg.num_kv_heads) * cfg.head_dim // tp)
    activations = MemoryNeed(
        "step activations", step_tokens * width * 4 * 2,
        f"{step_tokens} prompt tokens in one prefill step",
        "generate for fewer or shorter prompts at once (max_num_seqs)")
    return [kv, logits, activations]
