"""``advance_step_flashattn`` on MindSpore tensors, through the ``_C_ops`` extension.

The op updates the caller's tensors in place (a ``PyboostRunner`` with the same tensors as
inputs and outputs). It runs in PyNative mode only. Dtype, shape and layout errors are raised
on the calling thread before anything is written; on the CPU backend a ``seq_lens`` /
``block_tables`` pair that points outside the table is detected inside the kernel, before it
writes, and reported by MindSpore at the next synchronisation (``asnumpy``,
``mindspore.runtime.synchronize``) as a ``RuntimeError`` naming the op.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from opmux.core.errors import OpInputError, ProviderUnavailableError

if TYPE_CHECKING:
    import mindspore

__all__ = ["PROVIDER", "advance_step_flashattn", "as_opmux_error", "kernel"]

PROVIDER = "mindspore"
"""Provider name used in error messages and by the DLPack bridge."""

_OP = "advance_step_flashattn"
_PREFIX = f"{_OP}: "
_kernel: Callable[..., Any] | None = None
_graph_mode_error: type[BaseException] = RuntimeError


def kernel() -> Callable[..., Any]:
    """The extension's ``advance_step_flashattn`` (builds or loads ``_C_ops`` on first use).

    :raises opmux.BuildError: the extension cannot be built or imported.
    """
    global _kernel, _graph_mode_error
    if _kernel is None:
        from opmux.plugins.ascend import build

        module = build.load()
        _graph_mode_error = module.GraphModeError
        _kernel = module.advance_step_flashattn
    return _kernel


def as_opmux_error(exc: BaseException, provider: str = PROVIDER) -> Exception:
    """Map an exception from the extension to opmux's error classes.

    ``ValueError`` (bad arguments) becomes :class:`opmux.OpInputError`, the graph-mode error
    :class:`opmux.ProviderUnavailableError`, a kernel-side range error (``RuntimeError`` whose
    message names the op) :class:`opmux.OpInputError`; anything else is returned unchanged.
    """
    text = str(exc).strip().split("\n", 1)[0]
    body = text[len(_PREFIX):] if text.startswith(_PREFIX) else text
    where = f"opmux::{_OP} (provider {provider!r})"
    if isinstance(exc, _graph_mode_error) and type(exc) is not RuntimeError:
        return ProviderUnavailableError(f"{where}: {body}")
    if isinstance(exc, ValueError):
        return OpInputError(f"{where}: {body}")
    if isinstance(exc, RuntimeError) and text.startswith(_PREFIX):
        return OpInputError(f"{where}: {body}")
    return exc if isinstance(exc, Exception) else RuntimeError(text)


def advance_step_flashattn(num_seqs: int, num_queries: int, block_size: int,
                           input_tokens: mindspore.Tensor, sampled_token_ids: mindspore.Tensor,
                           input_positions: mindspore.Tensor, seq_lens: mindspore.Tensor,
                           slot_mapping: mindspore.Tensor,
                           block_tables: mindspore.Tensor) -> None:
    """Advance ``num_seqs`` sequences by one decode step, in place (DESIGN.md section 5).

    :param num_seqs: rows of the state vectors (``num_queries`` real rows, then padding).
    :param num_queries: sequences that received a sampled token.
    :param block_size: tokens per KV-cache block.
    :param input_tokens: ``[num_seqs]`` int64, overwritten with the sampled tokens (0 for
        padding rows).
    :param sampled_token_ids: ``[num_queries, 1]`` int64.
    :param input_positions: ``[num_seqs]`` int64, overwritten with the new positions.
    :param seq_lens: ``[num_seqs]`` int32, incremented for the first ``num_queries`` rows.
    :param slot_mapping: ``[num_seqs]`` int64, overwritten with the KV slots (-1 for padding).
    :param block_tables: ``[num_seqs, max_blocks]`` int32.
    :raises opmux.OpInputError: wrong dtype, shape or layout; nothing is written.
    :raises opmux.ProviderUnavailableError: MindSpore is not in PyNative mode.
    :raises opmux.BuildError: the extension cannot be built.
    """
    fn = _kernel if _kernel is not None else kernel()
    try:
        fn(num_seqs, num_queries, block_size, input_tokens, sampled_token_ids, input_positions,
           seq_lens, slot_mapping, block_tables)
    except (ValueError, RuntimeError) as exc:
        raise as_opmux_error(exc) from None
