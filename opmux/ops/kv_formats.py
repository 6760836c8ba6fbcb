"""Paged KV-cache formats: how ``reshape_and_cache`` and ``paged_attention`` find their caches.

The catalog's contract is the **canonical** cache: key and value ``[num_blocks, block_size,
Hkv, D]`` (any non-overlapping strides). A provider may read and write another memory layout
(a head-major cache, a tile-packed one): it registers a :class:`KVCacheFormat` and declares the
formats it reads with :func:`declare_kv_cache_formats`. Both ops take the format's name as
their last argument (``kv_cache_format="canonical"``); every provider declines the formats it
does not read in ``supports_args``, and native reads any format through
:meth:`KVCacheFormat.to_canonical` and writes it with :meth:`KVCacheFormat.write`.

An engine asks :func:`kv_cache_format` which format to allocate: the one the winning
``paged_attention`` provider of that device prefers (under the current priorities, a user's
``OPMUX_PRIORITY`` or scope included), then allocates with :meth:`KVCacheFormat.allocate` and
passes ``fmt.name`` to both ops.

Built in: ``canonical`` and ``hnd`` (head-major ``[num_blocks, Hkv, block_size, D]`` storage,
vLLM's CPU/HND order; its canonical form is a permuted view). The table is process state (the
``kv_formats`` field of :class:`~opmux.core.state.Runtime`): :func:`opmux.testing.reset_for_tests`
drops what plugins registered; they register it again when start-up runs again.
"""

from __future__ import annotations

import abc
import re
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Final

import torch
from torch import Tensor

from opmux.core.errors import ConfigError, OpmuxError, RegistrationError
from opmux.core.op import DEVICE_TYPE_TO_KEY
from opmux.core.state import claim, runtime

__all__ = [
    "CANONICAL",
    "HND",
    "CanonicalFormat",
    "HeadMajorFormat",
    "KVCacheFormat",
    "KVCacheSpec",
    "declare_kv_cache_formats",
    "get_kv_cache_format",
    "kv_cache_format",
    "kv_cache_format_report",
    "kv_cache_formats_of",
    "list_kv_cache_formats",
    "register_kv_cache_format",
    "require_kv_cache_format",
    "resolve_kv_cache_format",
    "scatter_canonical",
    "slot_positions",
    "zeroed_pair",
]

CANONICAL_NAME: Final = "canonical"


@dataclass(frozen=True)
class KVCacheSpec:
    """What an engine is about to allocate (the question :func:`kv_cache_format` answers)."""

    device: torch.device
    dtype: torch.dtype
    head_size: int
    num_kv_heads: int
    block_size: int


class KVCacheFormat(abc.ABC):
    """A memory layout of the paged key and value caches.

    Subclass it and define :meth:`to_canonical` (abstract) and either :meth:`storage_shape`
    (key and value are two zeroed tensors of that shape) or, for caches whose two tensors
    differ or share a buffer, :meth:`allocate`; define :meth:`write` too when
    :meth:`to_canonical` copies (``views = False``). :func:`register_kv_cache_format` refuses
    a format that misses one of these.

    :cvar name: the registered name (``^[a-z_][a-z0-9_]*$``), passed to the ops.
    :cvar views: whether :meth:`to_canonical` returns views of the format's own tensors
        (then writing through them writes the cache, and :meth:`write` needs no override).
    """

    name: str = ""
    views: bool = True
    description: str = ""

    def storage_shape(self, num_blocks: int, block_size: int, num_kv_heads: int,
                      head_size: int) -> tuple[int, ...]:
        """The shape of each of the two tensors the default :meth:`allocate` makes."""
        raise RegistrationError(f"KV-cache format {self.name!r} defines neither "
                                "storage_shape() nor allocate(); define one of them")

    def allocate(self, num_blocks: int, block_size: int, num_kv_heads: int, head_size: int,
                 dtype: torch.dtype, device: torch.device | str | None = None
                 ) -> tuple[Tensor, Tensor]:
        """Zeroed ``(key_cache, value_cache)`` in this format: by default two tensors of
        :meth:`storage_shape`."""
        shape = self.storage_shape(num_blocks, block_size, num_kv_heads, head_size)
        if not (isinstance(shape, tuple)
                and all(isinstance(n, int) and not isinstance(n, bool) and n >= 0
                        for n in shape)):
            raise RegistrationError(f"KV-cache format {self.name!r}: storage_shape() must "
                                    f"return a tuple of non-negative ints, got {shape!r}")
        return zeroed_pair(shape, dtype, device)

    @abc.abstractmethod
    def to_canonical(self, key_cache: Tensor, value_cache: Tensor) -> tuple[Tensor, Tensor]:
        """The caches as the catalog's ``[num_blocks, block_size, Hkv, D]`` tensors (views
        when :attr:`views`, else copies)."""

    def write(self, key: Tensor, value: Tensor, key_cache: Tensor, value_cache: Tensor,
              slot_mapping: Tensor) -> None:
        """Write token ``t``'s ``key[t]``/``value[t]`` (``[T, Hkv, D]``) into slot
        ``slot_mapping[t]`` (``-1`` skips); arguments already validated. The default writes
        through the :meth:`to_canonical` views."""
        kc, vc = self.to_canonical(key_cache, value_cache)
        scatter_canonical(key, value, kc, vc, slot_mapping)

    def __repr__(self) -> str:
        return f"KVCacheFormat({self.name!r})"


def slot_positions(slot_mapping: Tensor, block_size: int) -> tuple[Tensor, Tensor, Tensor]:
    """``(valid, blocks, offsets)`` of a write: the mask of tokens with a slot (not ``-1``)
    and, for those, the block and the offset in it of each slot."""
    valid = slot_mapping >= 0
    slots = slot_mapping[valid]
    blocks = torch.div(slots, block_size, rounding_mode="floor")
    return valid, blocks, slots - blocks * block_size


def zeroed_pair(shape: tuple[int, ...], dtype: torch.dtype,
                device: torch.device | str | None = None) -> tuple[Tensor, Tensor]:
    """A zero-filled key cache and value cache of ``shape`` (what an ``allocate`` returns)."""
    return (torch.zeros(shape, dtype=dtype, device=device),
            torch.zeros(shape, dtype=dtype, device=device))


def scatter_canonical(key: Tensor, value: Tensor, key_cache: Tensor, value_cache: Tensor,
                      slot_mapping: Tensor) -> None:
    """Native's write into canonical caches (any strided view of them, in place)."""
    valid, blocks, offsets = slot_positions(slot_mapping, key_cache.shape[1])
    key_cache.index_put_((blocks, offsets), key[valid])
    value_cache.index_put_((blocks, offsets), value[valid])


class CanonicalFormat(KVCacheFormat):
    """``[num_blocks, block_size, Hkv, D]``, contiguous: the catalog's contract."""

    name = CANONICAL_NAME
    description = "[blocks, block_size, Hkv, D] (the catalog's layout)"

    def storage_shape(self, num_blocks: int, block_size: int, num_kv_heads: int,
                      head_size: int) -> tuple[int, ...]:
        return (num_blocks, block_size, num_kv_heads, head_size)

    def to_canonical(self, key_cache: Tensor, value_cache: Tensor) -> tuple[Tensor, Tensor]:
        return key_cache, value_cache


class HeadMajorFormat(KVCacheFormat):
    """``[num_blocks, Hkv, block_size, D]`` storage (a kv head's rows of a block are one dense
    run, vLLM's HND order); its canonical form is the ``permute(0, 2, 1, 3)`` view."""

    name = "hnd"
    description = "[blocks, Hkv, block_size, D] storage; canonical = permute(0, 2, 1, 3) view"

    def storage_shape(self, num_blocks: int, block_size: int, num_kv_heads: int,
                      head_size: int) -> tuple[int, ...]:
        return (num_blocks, num_kv_heads, block_size, head_size)

    def to_canonical(self, key_cache: Tensor, value_cache: Tensor) -> tuple[Tensor, Tensor]:
        if key_cache.dim() != 4 or value_cache.dim() != 4:
            raise ValueError(f"'hnd' caches are [blocks, Hkv, block_size, D], got "
                             f"{list(key_cache.shape)} and {list(value_cache.shape)}")
        return key_cache.permute(0, 2, 1, 3), value_cache.permute(0, 2, 1, 3)


CANONICAL: Final = CanonicalFormat()
"""The default format: every provider and native read it."""

HND: Final = HeadMajorFormat()
"""Head-major storage; native reads it (a permuted view), providers that declare it too."""

FormatChooser = Callable[[KVCacheSpec], Sequence[str]]
"""``spec -> format names`` a provider reads for that allocation, preferred first; empty when
the provider would not take such caches at all (the next provider in priority decides)."""


class FormatTable:
    """The registered formats and each provider's declaration (a field of the runtime
    object, built on first use)."""

    def __init__(self) -> None:
        self.formats: dict[str, KVCacheFormat] = {CANONICAL.name: CANONICAL, HND.name: HND}
        self.readers: dict[str, FormatChooser] = {}
        self.lock = threading.Lock()


def _table() -> FormatTable:
    rt = runtime()
    table = rt.kv_formats
    if table is None:
        with rt.lock:
            table = rt.kv_formats = rt.kv_formats or FormatTable()
    return table


def register_kv_cache_format(fmt: KVCacheFormat) -> KVCacheFormat:
    """Register ``fmt`` under ``fmt.name`` (registering the same object again is a no-op).

    :raises RegistrationError: a bad name, another format registered under it, a format
        that defines neither :meth:`KVCacheFormat.storage_shape` nor
        :meth:`KVCacheFormat.allocate`, or a copying format (``views = False``) without its
        own :meth:`KVCacheFormat.write`.
    """
    if not isinstance(fmt, KVCacheFormat):
        raise RegistrationError(f"register_kv_cache_format: expected a KVCacheFormat, got "
                                f"{type(fmt).__name__}")
    if not re.fullmatch(r"[a-z_][a-z0-9_]*", fmt.name or ""):
        raise RegistrationError(f"register_kv_cache_format: format name {fmt.name!r} must "
                                "match ^[a-z_][a-z0-9_]*$")
    kind = type(fmt)
    if (kind.storage_shape is KVCacheFormat.storage_shape
            and kind.allocate is KVCacheFormat.allocate):
        raise RegistrationError(f"register_kv_cache_format: {fmt.name!r} defines neither "
                                "storage_shape() nor allocate(); define storage_shape() (two "
                                "zeroed tensors of one shape) or allocate()")
    if not fmt.views and kind.write is KVCacheFormat.write:
        raise RegistrationError(f"register_kv_cache_format: {fmt.name!r} copies in "
                                "to_canonical() (views = False), so writing through it would "
                                "write a copy; define write()")
    table = _table()
    with table.lock:
        holder = claim(table.formats, fmt.name, fmt)
    if holder is not None:
        raise RegistrationError(f"register_kv_cache_format: {fmt.name!r} is already registered "
                                f"({holder!r}); pick another name")
    return fmt


def list_kv_cache_formats() -> list[str]:
    """Names of the registered formats (plugins' included), ``canonical`` first."""
    _loaded()
    return list(_table().formats)


def _loaded() -> None:
    try:
        runtime().registry.ensure_loaded()
    except RuntimeError:  # no registry installed (bare ops import): built-ins only
        pass


def get_kv_cache_format(name: str) -> KVCacheFormat:
    """The format registered as ``name``.

    :raises ConfigError: no such format; the message lists the registered ones.
    """
    fmt = _lookup(name)
    if fmt is None:
        raise ConfigError(f"no KV-cache format {name!r}; registered: "
                          f"{', '.join(_table().formats)} (register others with "
                          "opmux.register_kv_cache_format)")
    return fmt


def _lookup(name: str) -> KVCacheFormat | None:
    """The format ``name``, start-up run first when it is not (yet) known."""
    table = _table()
    fmt = table.formats.get(name) if isinstance(name, str) else None
    if fmt is None:
        _loaded()
        fmt = table.formats.get(name) if isinstance(name, str) else None
    return fmt


def resolve_kv_cache_format(op: str, name: str, *, provider: str = "native") -> KVCacheFormat:
    """The format ``name`` as op ``op`` receives it, or its standard error.

    :raises OpInputError: an unknown name (or not a string), naming the op, the provider and
        the registered formats.
    """
    fmt = _lookup(name)
    if fmt is None:
        from opmux.ops.checks.input_errors import input_error

        raise input_error(op, provider, "kv_cache_format",
                              f"a registered KV-cache format ({', '.join(_table().formats)}; "
                              "register others with opmux.register_kv_cache_format)", repr(name))
    return fmt


def canonical_caches(op: str, name: str, key_cache: Tensor, value_cache: Tensor, *,
                     provider: str = "native") -> tuple[Tensor, Tensor]:
    """The caches, laid out in format ``name``, as ``canonical`` ones (the format's
    ``to_canonical``), or the standard error.

    :raises OpInputError: an unknown format, or caches the format cannot read (shapes that do
        not fit its layout), naming the op, the provider and ``key_cache``.
    """
    fmt = resolve_kv_cache_format(op, name, provider=provider)
    try:
        return fmt.to_canonical(key_cache, value_cache)
    except OpmuxError:
        raise
    except (ValueError, RuntimeError, IndexError, TypeError) as exc:
        from opmux.ops.checks.input_errors import input_error

        shapes = [list(t.shape) if isinstance(t, Tensor) else type(t).__name__
                  for t in (key_cache, value_cache)]
        why = (str(exc).splitlines() or [type(exc).__name__])[0]
        raise input_error(op, provider, "key_cache",
                              f"caches in KV-cache format {name!r} ({fmt.description})",
                              f"key and value {shapes[0]} and {shapes[1]}: {why}") from None


def require_kv_cache_format(op: str, name: str, provider: str,
                            accepted: Sequence[str] = (CANONICAL_NAME,)) -> None:
    """Raise the standard error unless ``name`` is one of the formats ``provider`` takes
    (for a provider's impl called directly with a format its ``supports_args`` declines).

    :raises OpInputError: naming the op, the provider and the formats it takes.
    """
    if name in accepted:
        return
    resolve_kv_cache_format(op, name, provider=provider)  # unknown names: the usual error
    from opmux.ops.checks.input_errors import input_error

    raise input_error(op, provider, "kv_cache_format",
                          f"a KV-cache format this provider reads ({', '.join(accepted)})",
                          repr(name))


def declare_kv_cache_formats(provider: str, formats: Sequence[str] | FormatChooser) -> None:
    """Declare the formats ``provider``'s ``paged_attention`` reads and its
    ``reshape_and_cache`` writes, preferred first (a provider that declares nothing reads
    ``canonical`` only). Its ``supports_args`` must still decline every other format.

    :param formats: names, or ``spec -> names`` when the answer depends on the allocation
        (dtype, head size, ...); an empty answer means the provider would not take such caches.
    :raises RegistrationError: a bare string (``"hnd"`` would read as ``'h', 'n', 'd'``), no
        name, or a name that is not a string.
    """
    chooser: FormatChooser
    if callable(formats):
        chooser = formats
    else:
        if isinstance(formats, str | bytes):
            raise RegistrationError(f"declare_kv_cache_formats({provider!r}, {formats!r}): "
                                    f"give a sequence of format names, e.g. ({formats!r},), "
                                    f"or a function of the cache spec, not a bare string")
        try:
            fixed = tuple(formats)
        except TypeError:
            raise RegistrationError(f"declare_kv_cache_formats({provider!r}): expected a "
                                    f"sequence of format names or a function of the cache "
                                    f"spec, got {type(formats).__name__}") from None
        if not fixed:
            raise RegistrationError(f"declare_kv_cache_formats({provider!r}): name at least "
                                    "one format")
        bad = [name for name in fixed if not isinstance(name, str) or not name]
        if bad:
            raise RegistrationError(f"declare_kv_cache_formats({provider!r}): format names "
                                    f"are non-empty strings, got {bad!r}")
        unknown = [n for n in fixed if _lookup_registered(n) is None]
        if unknown:
            raise RegistrationError(
                f"declare_kv_cache_formats({provider!r}): format(s) {unknown} are not "
                f"registered (registered: {', '.join(_table().formats)}); register a format "
                "with opmux.register_kv_cache_format before declaring it", provider=provider)

        def chooser(spec: KVCacheSpec) -> Sequence[str]:
            return fixed

    table = _table()
    with table.lock:
        table.readers[provider] = chooser


def kv_cache_formats_of(provider: str, spec: KVCacheSpec) -> tuple[str, ...]:
    """The formats ``provider`` reads for ``spec``, preferred first (``("canonical",)`` for a
    provider that declared none, native included).

    :raises ConfigError: the provider's declaration answers a format that is not registered.
    """
    table = _table()
    chooser = table.readers.get(provider)
    if chooser is None:
        return ("canonical",)
    names = tuple(chooser(spec))
    unknown = [n for n in names if _lookup_registered(n) is None]
    if unknown:
        raise ConfigError(f"provider {provider!r} declares KV-cache format(s) {unknown} for "
                          f"{spec}, which are not registered (registered: "
                          f"{', '.join(table.formats)}); its plugin must register them with "
                          "opmux.register_kv_cache_format")
    return names


def _lookup_registered(name: object) -> KVCacheFormat | None:
    """The format ``name`` among those registered now (no start-up is run)."""
    return _table().formats.get(name) if isinstance(name, str) else None


def kv_cache_format(device: torch.device | str, dtype: torch.dtype, head_size: int,
                    num_kv_heads: int = 1, block_size: int = 16) -> KVCacheFormat:
    """The format to allocate for ``paged_attention`` on ``device``: the preferred format of
    the first provider, in the op's current priority, that serves the device's dispatch key,
    is supported here and reads caches of this kind (``canonical`` when that is native).

    A user-set priority (``OPMUX_PRIORITY``, ``set_default_priority``, an open
    ``set_priority`` scope) is honoured: the answer is a format the provider it picks reads.
    """
    return get_kv_cache_format(_choose(device, dtype, head_size, num_kv_heads, block_size)[0])


def _choose(device: torch.device | str, dtype: torch.dtype, head_size: int, num_kv_heads: int,
            block_size: int) -> tuple[str, str]:
    """``(format name, provider that prefers it)``."""
    dev = torch.device(device)
    spec = KVCacheSpec(dev, dtype, head_size, num_kv_heads, block_size)
    key = DEVICE_TYPE_TO_KEY.get(dev.type, "PrivateUse1")
    op = runtime().registry.get_op("paged_attention")
    impls = op.impls
    for provider in op.priority():
        impl = impls.get(provider)
        if provider == "native" or impl is None:
            break
        if impl.dispatch_key != key or not impl.supported:
            continue
        names = kv_cache_formats_of(provider, spec)
        if names:
            return names[0], provider
    return CANONICAL_NAME, "native"


def kv_cache_format_report(device: torch.device | str, dtype: torch.dtype, head_size: int,
                           num_kv_heads: int = 1, block_size: int = 16) -> str:
    """One line: the format :func:`kv_cache_format` returns and which provider prefers it."""
    name, provider = _choose(device, dtype, head_size, num_kv_heads, block_size)
    return (f"kv_cache_format({torch.device(device)}, {dtype}, head_size={head_size}, "
            f"num_kv_heads={num_kv_heads}, block_size={block_size}): {name!r} "
            f"(preferred by {provider!r}; registered: {', '.join(list_kv_cache_formats())})")
