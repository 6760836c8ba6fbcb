"""Linear weights laid out once for the CPU's GEMM libraries (float32, and bfloat16 where
the CPU computes in bfloat16).

oneDNN multiplies a few rows by a weight fastest when the weight already lies in the blocked
layout its kernel reads; ``torch.ops.mkldnn._reorder_linear_weight`` makes that copy (the
packing Inductor's CPU freezing does) and ``torch.ops.mkldnn._linear_pointwise`` multiplies by
it. :class:`PackedWeight` keeps such copies beside a layer's weight, which stays as it is for
loading and every other path, and the engine's decoder calls it instead of the layer (no
module call, no dispatch):

- one or two rows (a decode step at batch 1 or 2, bound by how fast the weight streams from
  memory): the ``cpp`` kernel ``linear_out`` of ``csrc/cpu/linear.cpp``, which scales with the
  threads where MKL's and oneDNN's matrix-vector routes do not
  (``benchmarks/linear_cpu.py --packed``): float32 on the weight itself, bfloat16 (and a
  float32 weight with strided rows) on a contiguous copy;
- more rows (a batched decode step, a prefill), and one or two rows where the CPU plugin's
  kernels are not loaded: oneDNN's packed copy, except a single float32 row, which goes
  through oneDNN on the plain weight when it has at least 2**20 elements (below that oneDNN's
  fixed cost per call loses) and ``F.linear`` otherwise;
- bfloat16 is packed only on CPUs with native bfloat16 compute
  (``torch.ops.mkldnn._is_mkldnn_bf16_supported``); every product accumulates in float32.

What the row kernel reads of a model's weights (the bfloat16 copies; the float32 weights
themselves, moved) shares one region of memory that Linux backs with 2 MiB pages where it can
(:func:`place_row_weights`): streamed through 4 KiB pages, the weights cost a TLB miss every
4 KiB, and the kernel reads them markedly slower (``benchmarks/linear_cpu.py --huge-pages``).

``benchmarks/decode_profile.py`` times the engine with and without these paths and
``benchmarks/llamacpp_cpu.py`` the engine against llama.cpp. A weight changed in place after
packing is laid out again at its next call.

The two oneDNN ops are private torch ops, looked up once; where a torch build lacks them
nothing is packed. The row kernels are looked up when a weight is packed, after start-up
(the CPU plugin loads them).
"""

from __future__ import annotations

import mmap
from collections.abc import Callable, Iterable

import torch
import torch.nn.functional as F
from torch import Tensor

from opmux.core.registry import global_registry

__all__ = ["PackedWeight", "can_pack", "huge_page_region", "place_row_weights"]

_ROWS_HINT = 16  # the rows oneDNN lays the weight out for: a batched decode step
_MIN_ONEDNN_ROW = 1 << 20  # weight elements from which a single row goes to oneDNN
_ROW_KERNEL_ROWS = 2  # the most rows the row kernel serves (benchmarks/linear_cpu.py --packed)
_HUGE_PAGE = 2 << 20  # bytes in an x86-64 (and most arm64) huge page
_LINE = 64  # bytes in a cache line


def _find(name: str) -> Callable[..., Tensor] | None:
    if not torch.backends.mkldnn.is_available():
        return None
    return getattr(torch.ops.mkldnn, name, None)


_REORDER = _find("_reorder_linear_weight")
_LINEAR = _find("_linear_pointwise")
_BF16_CHECK = _find("_is_mkldnn_bf16_supported")
_DTYPES = (torch.float32, torch.bfloat16) if _BF16_CHECK is not None and _BF16_CHECK() \
    else (torch.float32,)


def can_pack(weight: Tensor, bias: Tensor | None) -> bool:
    """Whether :class:`PackedWeight` takes this CPU weight (and bias): float32, or bfloat16
    on a CPU with native bfloat16 compute."""
    return (_REORDER is not None and _LINEAR is not None and weight.dim() == 2
            and weight.dtype in _DTYPES and weight.is_cpu
            and not weight.is_inference()  # its in-place changes must be seen (_version)
            and (bias is None or (bias.dtype == weight.dtype and bias.is_cpu)))


def _row_kernel() -> Callable[..., None] | None:
    """The CPU plugin's kernel for one or two rows (see the module), when its kernels are
    loaded (start-up, run here if no op call ran it yet, loads them)."""
    global_registry().ensure_loaded()
    kernel: Callable[..., None] | None = getattr(torch.ops.opmux_cpu, "linear_out", None)
    return kernel


def huge_page_region(nbytes: int) -> Tensor:
    """``nbytes`` of uint8 memory from a 2 MiB boundary, in a private anonymous mapping
    marked ``MADV_HUGEPAGE``: Linux backs it with 2 MiB pages where transparent huge pages
    are enabled (``always`` or ``madvise``) and free, and with 4 KiB pages otherwise. Where
    the platform has no such mappings it is ``torch.empty``'s memory."""
    advise = getattr(mmap, "MADV_HUGEPAGE", None)
    if nbytes == 0 or advise is None:
        return torch.empty(nbytes, dtype=torch.uint8)
    region = mmap.mmap(-1, nbytes + _HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    try:
        region.madvise(advise)
    except OSError:  # a kernel built without transparent huge pages
        pass
    whole = torch.frombuffer(region, dtype=torch.uint8)  # keeps the mapping alive
    start = -whole.data_ptr() % _HUGE_PAGE
    return whole[start:start + nbytes]


def place_row_weights(packs: Iterable[PackedWeight]) -> None:
    """Put what the row kernel reads of ``packs`` (those not placed yet) in one shared
    :func:`huge_page_region`, one after another, each from a cache-line boundary: a weight's
    copy where the kernel reads one (made there at its next call), else the weight itself,
    whose data moves there (the same tensor, the same values; a tensor taken from its
    ``.data`` before no longer shares its memory)."""
    waiting = [p for p in packs if p._row_kernel is not None and p._place is None]
    sizes = [p.weight.numel() * p.weight.element_size() for p in waiting]
    starts = [0]
    for size in sizes:  # each slot rounded up to whole cache lines
        starts.append(starts[-1] + -(-size // _LINE) * _LINE)
    region = huge_page_region(starts[-1])
    for p, at, size in zip(waiting, starts[:-1], sizes, strict=True):
        p._place = region[at:at + size].view(p.weight.dtype).view(p.weight.shape)
        if not p._copy:
            with torch.no_grad():
                p.weight.data = p._place.copy_(p.weight)
        p._version, p._rows = -1, p.weight  # the old memory let go


class PackedWeight:
    """``x Wᵀ + b`` through copies of ``weight`` laid out for the GEMM libraries (see the
    module).

    :param weight: ``[out, in]`` on the CPU (:func:`can_pack`).
    :param bias: ``[out]`` or ``None``.
    """

    def __init__(self, weight: Tensor, bias: Tensor | None, *, row_kernel: bool = True
                 ) -> None:
        """:param row_kernel: serve one or two rows with the CPU plugin's kernel where it is
            loaded (``False``: oneDNN, the baseline of ``benchmarks/linear_cpu.py --packed``)."""
        self.weight, self.bias = weight, bias
        self._version = -1
        self._packed = self._rows = weight  # the oneDNN copy; what the row kernel reads
        self._row_plain = weight.dtype == torch.float32
        self._row_onednn = weight.numel() >= _MIN_ONEDNN_ROW
        self._row_kernel = _row_kernel() if row_kernel else None
        # the row kernel reads float32 in place unless its rows are strided, bfloat16 on a copy
        in_place = weight.dtype == torch.float32 and weight.stride(-1) == 1
        self._copy = self._row_kernel is not None and not in_place
        #: what the row kernel reads, on huge pages (:func:`place_row_weights`): where the
        #: copy is made, or the weight's own data; ``None``: memory of its own
        self._place: Tensor | None = None

    def copies_bytes(self) -> int:
        """The bytes this adds beside the weight: the packed copy, and the row kernel's copy
        where it reads one."""
        copies = 2 if self._copy else 1
        return copies * self.weight.numel() * self.weight.element_size()

    def takes(self, x: Tensor) -> bool:
        """Whether :meth:`__call__` serves ``x``: rows of CPU input in the weight's dtype,
        outside autograd and compilation."""
        return (x.dim() == 2 and x.shape[0] > 0 and x.dtype == self.weight.dtype and x.is_cpu
                and not torch.is_grad_enabled() and not torch.compiler.is_compiling())

    def rows(self) -> Tensor:
        """What the row kernel reads, laid out again first if the weight changed in place
        since (with the oneDNN copy)."""
        w = self.weight
        if w._version != self._version:
            assert _REORDER is not None
            self._packed = _REORDER(w.detach(), _ROWS_HINT)
            rows = w.detach()
            if self._copy:
                rows = rows.contiguous() if self._place is None else self._place.copy_(rows)
            self._rows = rows
            self._version = w._version
        return self._rows

    def __call__(self, x: Tensor) -> Tensor:
        assert _LINEAR is not None
        rows = self.rows()
        kernel = self._row_kernel
        if kernel is not None and x.shape[0] <= _ROW_KERNEL_ROWS and x.stride(-1) == 1:
            out = x.new_empty((x.shape[0], rows.shape[0]))
            kernel(out, x, rows, self.bias, self._place is not None)
            return out
        w = self.weight
        if x.shape[0] == 1 and self._row_plain:
            if self._row_onednn:
                return _LINEAR(x, w, self.bias, "none", [], "")
            return F.linear(x, w, self.bias)
        return _LINEAR(x, self._packed, self.bias, "none", [], "")
