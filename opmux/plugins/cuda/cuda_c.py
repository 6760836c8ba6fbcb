"""Provider ``cuda_c``: the CUDA C++ kernels of ``csrc/cuda``, built just in time.

The sources are compiled with :func:`torch.utils.cpp_extension.load` (nvcc + ninja) into
``$OPMUX_CACHE_DIR/cuda_c/<key>`` (default ``~/.cache/opmux``; verified, atomically installed
and rebuilt when damaged by :mod:`opmux.plugins.build_cache`), where ``<key>`` hashes the
sources, the torch version and its CUDA version, and loaded as a plain library whose
``TORCH_LIBRARY(opmux_cuda, m)`` makes ``torch.ops.opmux_cuda.*`` available. The build runs
when the provider is registered on a machine with a CUDA build of torch, nvcc and a visible
GPU; anywhere else the provider is registered as unsupported with the reason (for example
``torch is a CPU build (torch.version.cuda is None)``), which ``opmux info`` shows.

The impls below carry the catalog's exact signatures and check once: each ``supports_args``
is the whole acceptance test on metadata (CUDA tensors and native's static conditions;
``reshape_and_cache`` and ``advance_step_flashattn`` run native's static check itself,
:func:`opmux.ops.checks.with_static_check`), so a call it declines runs native, whose check
gives the error; the impls call their kernels, whose C++ checks are the last guard. Index
values are not read (on CUDA that would cost a device sync).
"""

import shutil
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from opmux.core.errors import BuildError
from opmux.ops.checks import (
    check_advance_step_flashattn,
    check_reshape_and_cache,
    with_static_check,
)
from opmux.plugins.registration import OpTable, op_table, register_table

if TYPE_CHECKING:
    from opmux.core.registry import OpRegistry
    from opmux.plugins.build_cache import BuildCache

__all__ = [
    "CACHE",
    "CUDA_CFLAGS",
    "PROVIDER",
    "advance_step_flashattn",
    "build",
    "build_dir",
    "cuda_c_status",
    "register",
    "reshape_and_cache",
    "rms_norm",
    "silu_and_mul",
    "sources",
]

PROVIDER = "cuda_c"
"""Provider name of the CUDA C++ kernels."""

CUDA_CFLAGS: tuple[str, ...] = ("-O3", "--expt-relaxed-constexpr", "-std=c++20")
"""nvcc flags; part of the cache key."""

_LIB_NAME = "opmux_cuda_kernels"


def _make_cache() -> "BuildCache":
    from opmux.plugins.build_cache import BuildCache

    return BuildCache("cuda_c", f"{_LIB_NAME}.so", "opmux cuda_c kernels")


CACHE = _make_cache()
"""The cache entry, lock and per-process status of the CUDA C++ kernel library."""
_FLOATS = (torch.float32, torch.float16, torch.bfloat16)


def source_dir() -> Path:
    """Folder holding the CUDA sources (``cuda/`` of
    :func:`~opmux.plugins.build_cache.csrc_root`)."""
    from opmux.plugins.build_cache import csrc_root

    return csrc_root() / "cuda"


def sources() -> list[Path]:
    """The translation units to compile (``*.cu`` and the binding ``*.cpp``), sorted."""
    return sorted([*source_dir().glob("*.cu"), *source_dir().glob("*.cpp")])


def _key() -> str:
    from opmux.plugins.build_cache import hash_key

    root = source_dir()
    inputs = [p for p in root.glob("*") if p.suffix in (".cu", ".cpp", ".h", ".cuh")]
    return hash_key(root, inputs, (torch.__version__, str(torch.version.cuda),
                                   " ".join(CUDA_CFLAGS)))


def build_dir() -> Path:
    """``$OPMUX_CACHE_DIR/cuda_c/<key>``: where the current sources build."""
    return CACHE.entry(_key())


def cuda_c_status() -> tuple[bool, str]:
    """Whether the CUDA C++ kernels can be built and run here, and why (not); builds nothing.

    :return: ``(possible, reason)``.
    """
    if torch.version.cuda is None:
        if torch.version.hip is not None:
            return False, "torch is a ROCm build; the cuda_c kernels are built for CUDA only"
        return False, "torch is a CPU build (torch.version.cuda is None)"
    from torch.utils import cpp_extension

    if cpp_extension.CUDA_HOME is None and shutil.which("nvcc") is None:
        return False, "nvcc not found (set CUDA_HOME or put nvcc on PATH)"
    if not torch.cuda.is_available():
        return False, "torch.cuda.is_available() is False: no CUDA device is visible"
    if not sources():
        return False, f"no CUDA sources under {source_dir()} (install from a source checkout)"
    return True, f"CUDA {torch.version.cuda}, sources in {source_dir()}"


def _compile(directory: Path, verbose: bool) -> Path:
    """Compile the kernels into the empty folder ``directory``; return the library path."""
    from torch.utils import cpp_extension

    try:
        path = cpp_extension.load(
            name=_LIB_NAME, sources=[str(s) for s in sources()],
            extra_cflags=["-O3", "-std=c++20"], extra_cuda_cflags=list(CUDA_CFLAGS),
            build_directory=str(directory), verbose=verbose, is_python_module=False,
        )
    except Exception as exc:
        raise BuildError(f"opmux cuda_c kernels failed to build in {directory}: "
                         f"{type(exc).__name__}: {exc}") from exc
    return Path(path)


def _load(verbose: bool) -> str:
    possible, reason = cuda_c_status()
    if not possible:
        raise BuildError(f"opmux cuda_c kernels cannot be built here: {reason}")
    library = CACHE.ensure(_key(), lambda directory: _compile(directory, verbose))
    torch.ops.load_library(str(library))  # type: ignore[no-untyped-call]
    return str(library)


def build(verbose: bool = False) -> str:
    """Compile (or find verified in the cache) and load the kernels; once per process.

    :param verbose: print the compiler commands.
    :return: the path of the loaded library.
    :raises BuildError: the toolchain is missing, the compiler failed or the cache is not
        writable.
    """
    ok, message = CACHE.status(lambda: _load(verbose))
    if not ok:
        raise BuildError(message)
    return message


def silu_and_mul(x: Tensor) -> Tensor:
    """``silu(x[..., :d]) * x[..., d:]`` (CUDA C++; strided inputs are read through a
    contiguous copy)."""
    out: Tensor = torch.ops.opmux_cuda.silu_and_mul(x)
    return out


def rms_norm(x: Tensor, weight: Tensor, eps: float = 1e-6) -> Tensor:
    """RMS norm in fp32, returned in ``x.dtype`` (CUDA C++; strided inputs are read through
    a contiguous copy)."""
    out: Tensor = torch.ops.opmux_cuda.rms_norm(x, weight, eps)
    return out


def reshape_and_cache(key: Tensor, value: Tensor, key_cache: Tensor, value_cache: Tensor,
                      slot_mapping: Tensor, kv_cache_format: str = "canonical") -> None:
    """Scatter key/value rows into the paged caches; slot -1 skips (CUDA C++)."""
    torch.ops.opmux_cuda.reshape_and_cache(key, value, key_cache, value_cache, slot_mapping)


def advance_step_flashattn(num_seqs: int, num_queries: int, block_size: int,
                           input_tokens: Tensor, sampled_token_ids: Tensor,
                           input_positions: Tensor, seq_lens: Tensor, slot_mapping: Tensor,
                           block_tables: Tensor) -> None:
    torch.ops.opmux_cuda.advance_step_flashattn(
        num_seqs, num_queries, block_size, input_tokens, sampled_token_ids, input_positions,
        seq_lens, slot_mapping, block_tables)


def silu_and_mul_supports(x: Tensor) -> bool:
    return (isinstance(x, Tensor) and x.dtype in _FLOATS and x.is_cuda and x.dim() >= 1
            and x.shape[-1] % 2 == 0)


def rms_norm_supports(x: Tensor, weight: Tensor, eps: float = 1e-6) -> bool:
    # native's static conditions: x[..., d] and weight [d] floating on one device, a real
    # eps >= 0 (NaN fails the comparison)
    return (isinstance(x, Tensor) and isinstance(weight, Tensor) and x.dtype in _FLOATS
            and weight.dtype in _FLOATS and x.is_cuda and weight.device == x.device
            and x.dim() >= 1 and weight.dim() == 1 and weight.shape[0] == x.shape[-1]
            and type(eps) in (float, int) and eps >= 0)


def _reshape_and_cache_layout(key: Tensor, value: Tensor, key_cache: Tensor, value_cache: Tensor,
                               slot_mapping: Tensor, kv_cache_format: str = "canonical") -> bool:
    # the kernel writes rows of Hkv*D contiguous elements inside each cache block, at one
    # block stride shared by both caches (so K and V may be two views of one buffer, as
    # kv[:, 0] and kv[:, 1]); other layouts run on the next provider
    if kv_cache_format != "canonical" or key_cache.dim() != 4:
        return False
    return (key_cache.is_cuda and slot_mapping.dtype == torch.int64 and key.dtype in _FLOATS
            and key_cache.dtype in _FLOATS and key.dim() == 3 and key_cache.dim() == 4
            and value.dtype == key.dtype and value_cache.dtype == key_cache.dtype
            and key_cache.stride(3) == 1 and key_cache.stride(2) == key_cache.shape[3]
            and key_cache.stride(1) == key_cache.shape[2] * key_cache.shape[3]
            and value_cache.stride() == key_cache.stride())


def _advance_step_layout(num_seqs: int, num_queries: int, block_size: int,
                         input_tokens: Tensor, sampled_token_ids: Tensor,
                         input_positions: Tensor, seq_lens: Tensor,
                         slot_mapping: Tensor, block_tables: Tensor) -> bool:
    # the kernel reads sampled ids through their row stride and block tables by rows with
    # contiguous columns, and writes contiguous state vectors; other layouts run on the
    # next provider
    state = (input_tokens, input_positions, seq_lens, slot_mapping)
    return (input_tokens.is_cuda and all(t.is_contiguous() for t in state)
            and block_tables.stride(1) == 1)


# native's static check first (the tensors' types, shapes, dtypes and devices), then the
# layouts the kernels take
reshape_and_cache_supports = with_static_check(reshape_and_cache, check_reshape_and_cache,
                                               PROVIDER, _reshape_and_cache_layout)
advance_step_flashattn_supports = with_static_check(
    advance_step_flashattn, check_advance_step_flashattn, PROVIDER, _advance_step_layout)


_IMPLS: OpTable = op_table(
    (silu_and_mul, silu_and_mul_supports),
    (rms_norm, rms_norm_supports),
    (reshape_and_cache, reshape_and_cache_supports),
    (advance_step_flashattn, advance_step_flashattn_supports),
)


def register(registry: "OpRegistry", dispatch_key: str = "CUDA") -> list[str]:
    """Register provider ``cuda_c`` (building the kernels when this machine can).

    :param registry: the registry to register into.
    :param dispatch_key: torch dispatch key served (``CUDA``).
    :return: the ``op:provider`` pairs registered.
    """
    supported, reason = cuda_c_status()
    if supported:
        try:
            build()
        except BuildError as exc:
            supported, reason = False, str(exc)
    return register_table(registry, PROVIDER, dispatch_key, _IMPLS, supported=supported,
                          reason=reason)
