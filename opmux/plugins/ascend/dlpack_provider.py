"""Provider ``mindspore``: torch tensors run through the MindSpore custom op, sharing memory.

Every torch tensor argument is viewed as a MindSpore tensor through DLPack
(``ms.from_dlpack(torch.utils.dlpack.to_dlpack(t))``): no copy, the MindSpore op writes
straight into the torch tensor's memory.

MindSpore runs PyNative ops asynchronously, but torch may read the results as soon as the
provider returns, so the provider ends with MindSpore's pipeline barrier
(``_pynative_executor.sync()``), which also raises the kernel's own errors. Waiting for the
asynchronous pipeline costs a thread hand-off, slow on a busy machine; to avoid it the
provider switches MindSpore's ``pynative_synchronize`` flag on for the duration of the call
(when it is not on already). In a process whose pipeline has not gone asynchronous yet, the op
then runs inline and the barrier is cheap; once other MindSpore ops have run asynchronously,
MindSpore keeps dispatching through its pipeline and the barrier pays the hand-off.

Creating a DLPack view costs more than the op itself (``benchmarks/advance_step.py``), and an
inference engine passes the same persistent state buffers every step. Views are therefore
cached per torch tensor object: an entry lives exactly as long as the tensor (a weak reference
drops it; the view is made from a detached alias so that it does not keep the tensor object
alive) and is used only while the tensor still has the data pointer it had when the view was
made (``resize_`` or ``set_`` that move the storage make a new view).

Registered on dispatch key ``CPU`` (the tensors of this machine); on an Ascend machine with
torch_npu the same bridge serves key ``PrivateUse1``.
"""

# no ``from __future__ import annotations``: opmux infers the torch schema from the annotations
import importlib.util
import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from opmux.ops.checks import (
    check_advance_step_flashattn,
    check_advance_step_flashattn_values,
    static_check_passes,
)
from opmux.plugins.ascend import mindspore_ops

if TYPE_CHECKING:
    from opmux.plugins.registration import RegistryLike

__all__ = ["PROVIDER", "advance_step_flashattn", "advance_step_flashattn_supports",
           "cached_view_count", "forget_views", "register", "to_mindspore"]

PROVIDER = mindspore_ops.PROVIDER
"""Provider name: ``"mindspore"``."""

_to_dlpack: Callable[[Tensor], Any] = torch.utils.dlpack.to_dlpack  # type: ignore[attr-defined]
# id(tensor) -> (weak reference, data pointer, MindSpore view): a module cache beside the
# MindSpore bindings it uses, cleared by forget_views()
_views: dict[int, tuple[Any, int, Any]] = {}
_from_dlpack: Callable[[Any], Any] | None = None


def forget_views() -> None:
    """Drop every cached MindSpore view (the torch tensors are untouched)."""
    _views.clear()
_SyncFlag = tuple[Callable[[Any], bool], Callable[[Any, bool], None], Any]
# (get_param, set_param, key) of MindSpore's context flag pynative_synchronize
_sync_flag: _SyncFlag | None = None
_barrier: Callable[[], None] | None = None


def cached_view_count() -> int:
    """How many torch tensors have a cached MindSpore view now (an entry goes with its
    tensor: the count comes back down once the tensors are collected)."""
    return len(_views)


def _bind_mindspore() -> tuple[Callable[[Any], Any], _SyncFlag, Callable[[], None]]:
    """Look up MindSpore's DLPack import, synchronous-execution flag and barrier (once)."""
    global _from_dlpack, _sync_flag, _barrier
    import mindspore as ms
    from mindspore._c_expression import MSContext, ms_ctx_param

    try:
        from mindspore.graph.api import _pynative_executor
    except ImportError:  # MindSpore < 2.9
        from mindspore.common.api import _pynative_executor
    ctx = MSContext.get_instance()
    _from_dlpack = ms.from_dlpack
    _sync_flag = (ctx.get_param, ctx.set_param, ms_ctx_param.pynative_synchronize)
    _barrier = _pynative_executor.sync
    return _from_dlpack, _sync_flag, _barrier


def _forget(key: int) -> Callable[[Any], None]:
    def drop(_: Any) -> None:
        _views.pop(key, None)

    return drop


def to_mindspore(t: Tensor) -> Any:
    """A MindSpore tensor sharing ``t``'s memory (cached while ``t`` lives and keeps its storage).

    :param t: a torch tensor (not requiring grad).
    """
    key = id(t)
    entry = _views.get(key)
    ptr = t.data_ptr()
    if entry is not None and entry[0]() is t and entry[1] == ptr:
        return entry[2]
    from_dlpack = _from_dlpack if _from_dlpack is not None else _bind_mindspore()[0]
    # Export a detached alias, not ``t`` itself: the capsule keeps its tensor alive, and torch
    # keeps a tensor's Python object alive as long as its C++ tensor is referenced, so
    # exporting ``t`` would pin ``t`` (and this cache entry) forever.
    view = from_dlpack(_to_dlpack(t.detach()))
    _views[key] = (weakref.ref(t, _forget(key)), ptr, view)
    return view


def advance_step_flashattn(num_seqs: int, num_queries: int, block_size: int,
                           input_tokens: Tensor, sampled_token_ids: Tensor,
                           input_positions: Tensor, seq_lens: Tensor, slot_mapping: Tensor,
                           block_tables: Tensor) -> None:
    """The catalog op on torch tensors, computed by the MindSpore extension in place.

    :func:`advance_step_flashattn_supports` is its acceptance test; the extension checks
    again. Index values are checked before anything is written: by the CPU kernel itself, and
    here for device tensors (the AscendC kernel does not check them).

    :raises opmux.OpInputError: wrong dtype, shape or layout (nothing written), or a
        ``seq_lens`` value outside the block table (detected before writing).
    :raises opmux.ProviderUnavailableError: MindSpore is not in PyNative mode.
    """
    if not input_tokens.is_cpu:  # index values: the AscendC kernel does not check them
        check_advance_step_flashattn_values(num_queries, block_size, seq_lens, block_tables,
                                            provider=PROVIDER)
    fn = mindspore_ops.kernel()
    if _sync_flag is not None and _barrier is not None:
        (get, set_, key), barrier = _sync_flag, _barrier
    else:
        _, (get, set_, key), barrier = _bind_mindspore()
    view = to_mindspore
    args = (num_seqs, num_queries, block_size, view(input_tokens), view(sampled_token_ids),
            view(input_positions), view(seq_lens), view(slot_mapping), view(block_tables))
    try:
        if get(key):
            fn(*args)
        else:
            set_(key, True)
            try:
                fn(*args)
            finally:
                set_(key, False)
        barrier()
    except (ValueError, RuntimeError) as exc:
        raise mindspore_ops.as_opmux_error(exc) from None


def advance_step_flashattn_supports(num_seqs: int, num_queries: int, block_size: int,
                                    input_tokens: Tensor, sampled_token_ids: Tensor,
                                    input_positions: Tensor, seq_lens: Tensor,
                                    slot_mapping: Tensor, block_tables: Tensor) -> bool:
    """Dtypes and layouts the extension takes, and native's static check (metadata only):
    anything else is left to the next provider, down to native, whose check gives the error.

    The kernel reads ``sampled_token_ids`` as consecutive elements and ``block_tables`` by
    rows of consecutive columns, and writes contiguous state vectors, so strided views of
    those decline (native serves them).
    """
    i64 = torch.int64
    tensors = (input_tokens, sampled_token_ids, input_positions, seq_lens, slot_mapping,
               block_tables)
    return (all(isinstance(t, Tensor) for t in tensors)
            and all(t.device == input_tokens.device for t in tensors)
            and input_tokens.is_contiguous() and input_positions.is_contiguous()
            and seq_lens.is_contiguous() and slot_mapping.is_contiguous()
            and input_tokens.dtype == i64 and input_positions.dtype == i64
            and slot_mapping.dtype == i64 and sampled_token_ids.dtype == i64
            and seq_lens.dtype == torch.int32 and block_tables.dtype == torch.int32
            and sampled_token_ids.is_contiguous() and block_tables.is_contiguous()
            and static_check_passes(check_advance_step_flashattn, num_seqs, num_queries,
                                    block_size, input_tokens, sampled_token_ids,
                                    input_positions, seq_lens, slot_mapping, block_tables,
                                    provider=PROVIDER))


def register(registry: "RegistryLike", dispatch_key: str = "CPU", *, lazy: bool = False
             ) -> list[str]:
    """Register provider ``mindspore`` for ``advance_step_flashattn`` (the registration contract).

    Eager (the Ascend platform): the extension is built or loaded now, and a failed build
    registers the provider as unsupported with the build output as its reason. Lazy (other
    platforms): nothing of MindSpore is imported now; the provider is supported when
    MindSpore is installed and builds or loads the extension on its first call, where a
    failure raises :class:`opmux.BuildError` with the build output.

    :param registry: the op registry.
    :param dispatch_key: the torch dispatch key of the tensors it serves.
    :param lazy: defer the build (and the MindSpore import) to the first call.
    :returns: the ``op:provider`` pairs registered.
    """
    from opmux.plugins.ascend import build
    from opmux.plugins.registration import register_table

    if lazy:
        ok = importlib.util.find_spec("mindspore") is not None
        message = "built on first use" if ok else "MindSpore is not installed"
    else:
        ok, message = build.build_status()
    table = {"advance_step_flashattn": (advance_step_flashattn, advance_step_flashattn_supports)}
    return register_table(registry, PROVIDER, dispatch_key, table, supported=ok,
                          reason=None if ok else message)
