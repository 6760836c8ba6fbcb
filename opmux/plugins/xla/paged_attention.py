"""``torch.ops.xla_gpu.paged_attention``: paged attention over one fused KV cache.

Layout (vLLM/TPU style, chosen so that a whole decode step is one static-shape graph):

* ``query`` ``[T, H, D]``: the query rows of every sequence, back to back. ``T`` may be a
  padded bucket: rows at or past ``query_start_loc[num_seqs]`` are padding and come out
  **zero** (so a padded bucket never leaks stale values into later layers).
* ``kv_cache`` ``[2, num_blocks, block_size, Hkv, D]``: keys at index 0, values at index 1,
  same dtype as ``query``.
* ``context_lens`` ``[S]`` int32: cached tokens of each sequence (its ``kv_len``, the new
  tokens included).
* ``block_tables`` ``[S, max_blocks]`` int32: the cache blocks of each sequence, in order.
* ``query_start_loc`` ``[S + 1]`` int32: sequence ``i`` owns query rows
  ``query_start_loc[i]:query_start_loc[i + 1]``.
* ``num_seqs`` ``[1]`` int32: how many of the ``S`` rows of ``block_tables`` /
  ``context_lens`` are live. ``S`` is the padded batch bucket: rows past ``num_seqs`` (and
  ``query_start_loc`` entries past ``num_seqs``) are padding and are never read for
  output. Passing the count as a tensor keeps it out of the graph's shape, so a changing
  batch size does not recompile.

Semantics are those of the catalog ``paged_attention`` (DESIGN §5): query row ``j`` of
sequence ``i`` sits at position ``p = kv_len - q_len + j`` and sees key ``t`` iff
``t <= p`` and (no window or ``t > p - sliding_window``); scores ``(q·k) * scale``, soft
capped as ``soft_cap * tanh(s / soft_cap)``, softmax in fp32; query head ``h`` reads kv
head ``h // (H // Hkv)``. Block-table entries past a sequence's length may hold anything.

Providers (one per dispatch key):

* ``static_xla`` (key ``XLA``): the static-shape PyTorch code of
  :mod:`opmux.plugins.xla.static_attention` (the native implementation too): every size
  comes from tensor shapes, nothing is read back to the host, so lazy tracing and
  ``torch.compile(backend="openxla")`` compile one graph per shape bucket.
* ``catalog_cuda`` (key ``CUDA``): the CUDA plugin's ``triton`` provider of the catalog
  ``paged_attention`` when it is registered, supported and accepts the arguments (the
  layout is converted without a host sync); else the static code.
* ``catalog_cpu`` (key ``CPU``): the catalog ``paged_attention``'s ``cpp`` provider when it
  is built and accepts the arguments, else the catalog native.
"""

import importlib.util
import inspect
from collections.abc import Callable
from typing import Any, Final, Optional, cast

import torch
from torch import Tensor

from opmux.core.errors import OpInputError, UnknownOpError
from opmux.core.op import Op, OpImpl
from opmux.core.registry import global_registry
from opmux.plugins.registration import RegistryLike
from opmux.plugins.xla.static_attention import (
    PagedArgs,
    check_inputs,
    static_paged_attention,
)

__all__ = ["NAMESPACE", "PROVIDERS", "QUALNAME", "paged_attention_op", "register",
           "xla_gpu_paged_attention"]

NAMESPACE: Final = "xla_gpu"
QUALNAME: Final = "xla_gpu::paged_attention"
CATALOG_OP: Final = "paged_attention"
"""The catalog op whose providers the CPU and CUDA paths reuse."""

PROVIDERS: Final = ("static_xla", "catalog_cuda", "catalog_cpu")
"""Providers this module registers, in default priority order."""


_SIGNATURE: Final = inspect.signature(static_paged_attention)
_COUNT: Final = len(_SIGNATURE.parameters)
_DEFAULTS: Final = static_paged_attention.__defaults__ or ()
_FEWEST: Final = _COUNT - len(_DEFAULTS)


def _full(args: tuple[Any, ...], kwargs: dict[str, Any]) -> PagedArgs:
    """The op's arguments in schema order, defaults filled in.

    The dispatcher passes the arguments positionally, leaving out trailing ones equal to
    their defaults (filled in from the signature's defaults); calls with keywords are bound
    to the signature first.
    """
    if kwargs or len(args) != _COUNT:
        if not kwargs and _FEWEST <= len(args) < _COUNT:
            args += _DEFAULTS[len(args) - _COUNT:]
        else:
            bound = _SIGNATURE.bind(*args, **kwargs)
            bound.apply_defaults()
            args = bound.args
    return cast(PagedArgs, args)


def _entry(name: str, body: Callable[[PagedArgs], Tensor], doc: str,
           checked_as: str | None = None) -> Callable[..., Tensor]:
    """A function with :func:`static_paged_attention`'s signature (the op's schema) that
    returns ``body(args)``, after :func:`check_inputs` under the name ``checked_as`` when
    given (native and the fake; a provider's :func:`_accepts` is its check)."""

    def entry(*args: Any, **kwargs: Any) -> Tensor:
        full = _full(args, kwargs)
        if checked_as is not None:
            check_inputs(checked_as, full)
        return body(full)

    entry.__name__ = entry.__qualname__ = name
    entry.__doc__ = doc
    entry.__signature__ = _SIGNATURE  # type: ignore[attr-defined]
    entry.__annotations__ = dict(static_paged_attention.__annotations__)
    return entry


def _accepts(provider: str) -> Callable[..., bool]:
    """The ``supports_args`` of a provider: whether :func:`check_inputs` passes (shapes and
    dtypes only). A call it declines runs native, whose check gives the error."""

    def supports(*args: Any, **kwargs: Any) -> bool:
        try:
            check_inputs(provider, _full(args, kwargs))
        except OpInputError:
            return False
        return True

    supports.__name__ = supports.__qualname__ = f"{provider}_supports"
    supports.__signature__ = _SIGNATURE.replace(  # type: ignore[attr-defined]
        return_annotation=bool)
    return supports


def _static(args: PagedArgs) -> Tensor:
    return static_paged_attention(*args)


xla_gpu_paged_attention = _entry("xla_gpu_paged_attention", _static, """\
Paged attention over a fused ``[2, num_blocks, block_size, Hkv, D]`` KV cache.

Sequence ``i < num_seqs`` owns query rows ``query_start_loc[i]:query_start_loc[i+1]``
and ``context_lens[i]`` cached tokens in blocks ``block_tables[i]``; its row ``j`` sits
at position ``p = kv_len - q_len + j`` and sees keys ``t <= p`` (and ``t > p -
sliding_window``). Rows of ``block_tables``/``context_lens``/``query_start_loc`` past
``num_seqs`` are padding and never read for output; query rows at or past
``query_start_loc[num_seqs]`` come out zero. Same math as the catalog
``paged_attention`` (keys/values split at dim 0 of ``kv_cache``).

:param query: ``[T, H, D]`` query rows (``T`` may be padded; padding rows give zeros).
:param kv_cache: ``[2, num_blocks, block_size, Hkv, D]``, keys at 0, values at 1.
:param context_lens: ``[S]`` int32 cached tokens per sequence.
:param block_tables: ``[S, max_blocks]`` int32 cache blocks per sequence.
:param query_start_loc: ``[S + 1]`` int32 row offsets per sequence.
:param num_seqs: ``[1]`` int32 count of live sequences (``<= S``).
:param scale: score scale, usually ``D ** -0.5``.
:param sliding_window: keys older than ``p - sliding_window`` are invisible.
:param soft_cap: scores become ``soft_cap * tanh(s / soft_cap)``.
:returns: ``[T, H, D]`` in ``query.dtype``.
:raises OpInputError: on a wrong rank, dtype or size (checked from shapes only).
""", "native")


def paged_attention_op() -> Op:
    """The :class:`~opmux.Op` behind ``torch.ops.xla_gpu.paged_attention`` (defined, with its
    providers, in the global registry on first use if the plugin has not done it yet)."""
    register(global_registry())
    return global_registry().get_op(QUALNAME)


# ---------------------------------------------------------------------------- providers
# Each provider has the native signature (built by ``_entry``); its ``supports_args``
# (``_accepts``) is its whole check of shapes and dtypes.
static_xla = _entry("static_xla", _static, """\
XLA provider: the static-shape code; traced lazily, one graph per shape bucket.""")


def _catalog_cuda(args: PagedArgs) -> Tensor:
    query, kv_cache, context_lens, block_tables, query_start_loc, num_seqs = args[:6]
    impl = _catalog_impl("triton")
    if impl is not None:
        batch = block_tables.shape[0]
        device = query.device
        count = num_seqs.reshape(1).to(torch.int64)
        qsl = query_start_loc.to(torch.int64)
        end = qsl.gather(0, count)
        seq_idx = torch.arange(batch + 1, device=device)
        starts = torch.where(seq_idx <= count, qsl, end).to(torch.int32)
        lens = torch.where(seq_idx[:batch] < count, context_lens.to(torch.int64), 0)
        tables = block_tables.clamp(0, kv_cache.shape[1] - 1).to(torch.int32)
        routed = (query, kv_cache[0], kv_cache[1], tables, lens.to(torch.int32), starts,
                  *args[6:])
        pred = impl.supports_args
        if pred is None or pred(*routed):
            out: Tensor = impl.fn(*routed)
            rows = torch.arange(query.shape[0], device=device)
            live = (rows < end) & (rows >= qsl[0])
            return torch.where(live.reshape(-1, 1, 1), out, 0.0).to(query.dtype)
    return static_paged_attention(*args)


catalog_cuda = _entry("catalog_cuda", _catalog_cuda, """\
CUDA provider: the catalog's ``triton`` provider after a sync-free layout change.

Padding sequences become empty (``q_len = kv_len = 0``), block ids are clamped into
the cache, and rows outside the live range are zeroed afterwards, so no value is read
back to the host (CUDA-graph safe). Falls back to the static code when the triton
provider is absent, unsupported, or rejects the arguments.""")


def _catalog_cpu(args: PagedArgs) -> Tensor:
    query, kv_cache, context_lens, block_tables, query_start_loc, num_seqs = args[:6]
    batch = block_tables.shape[0]
    count = int(num_seqs.reshape(-1)[0])
    if not 0 <= count <= batch:
        raise OpInputError(
            f"xla_gpu.paged_attention (provider 'catalog_cpu'): argument 'num_seqs' expected "
            f"a value in [0, {batch}] (the rows of block_tables), got {count}"
        )
    first, end = int(query_start_loc[0]), int(query_start_loc[count])
    if not 0 <= first <= end <= query.shape[0]:
        raise OpInputError(
            f"xla_gpu.paged_attention (provider 'catalog_cpu'): argument 'query_start_loc' "
            f"expected 0 <= query_start_loc[0] <= query_start_loc[num_seqs] <= "
            f"{query.shape[0]} (query rows), got {first} and {end}"
        )
    result = query.new_zeros(query.shape)
    if count == 0 or end == first:
        return result
    # the catalog op's offsets start at 0: rebase the live rows
    routed = (query[first:end], kv_cache[0], kv_cache[1],
              block_tables[:count].clamp(0, kv_cache.shape[1] - 1).to(torch.int32),
              context_lens[:count].to(torch.int32),
              (query_start_loc[: count + 1] - first).to(torch.int32), *args[6:])
    impl = _catalog_impl("cpp")
    fn = impl.fn if impl is not None and (
        impl.supports_args is None or impl.supports_args(*routed)) else _catalog().native
    out: Tensor = fn(*routed)
    result[first:end] = out
    return result


catalog_cpu = _entry("catalog_cpu", _catalog_cpu, """\
CPU provider: the catalog ``paged_attention`` (``cpp`` when built, else native).

The live part of the batch is sliced out (reading ``num_seqs`` and the row count is
free on CPU), block ids are clamped into the cache, and padding rows come back zero.""")

fake_paged_attention = _entry("fake_paged_attention",
                              lambda args: args[0].new_empty(args[0].shape), """\
Fake (meta) kernel: validates shapes and returns an empty ``[T, H, D]``.""", "fake")


def _catalog() -> Op:
    return global_registry().get_op(CATALOG_OP)


def _catalog_impl(provider: str) -> Optional[OpImpl]:
    impl = _catalog().impls.get(provider)
    if impl is None or not impl.supported:
        return None
    return impl


# ------------------------------------------------------------------------ registration
def _define() -> Op:
    """The op in the global registry, defined (native and fake) on the first call."""
    glob = global_registry()
    try:
        return glob.get_op(QUALNAME)
    except UnknownOpError:
        op = glob.register_op(xla_gpu_paged_attention, name="paged_attention",
                              namespace=NAMESPACE)
        op.register_meta(fake_paged_attention)
        return op


def register(registry: RegistryLike, dispatch_key: str | None = None) -> list[str]:
    """Define the op and register this module's providers (the registration contract).

    The op is defined here, when the plugin registers, never at import. It lives in the
    global registry (its torch namespace ``xla_gpu`` is process-wide): any other registry
    does not own it and gets nothing. Idempotent.

    :param registry: the registry the plugin registers into.
    :param dispatch_key: register only the provider of this key (``XLA``, ``CUDA`` or
        ``CPU``); ``None`` registers all three (each provider serves its own key).
    :returns: the ``op:provider`` pairs registered by this call.
    """
    if registry is not global_registry():
        return []
    op = _define()
    has_xla = importlib.util.find_spec("torch_xla") is not None
    has_cuda = torch.cuda.is_available()
    table = (
        ("static_xla", "XLA", has_xla, "torch_xla is not installed", static_xla),
        ("catalog_cuda", "CUDA", has_cuda, "no CUDA device", catalog_cuda),
        ("catalog_cpu", "CPU", True, None, catalog_cpu),
    )
    done = []
    # registration order is the priority: each provider serves its own key
    for name, key, supported, reason, fn in table:
        if name not in op.impls and dispatch_key in (None, key):
            op.register_impl(name, dispatch_key=key, supported=supported, reason=reason,
                             supports_args=_accepts(name))(fn)
            done.append(f"{QUALNAME}:{name}")
    return done
