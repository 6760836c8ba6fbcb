"""Just-in-time build of the opmux CPU kernels (``csrc/cpu``) into the shared build cache.

The kernels are compiled with :func:`torch.utils.cpp_extension.load` (ninja) the first time they
are needed and loaded as a plain shared library (``is_python_module=False``): its static
``TORCH_LIBRARY(opmux_cpu, m)`` registration makes ``torch.ops.opmux_cpu.*`` available.

The library lives in ``$OPMUX_CACHE_DIR/cpu/<key>`` (default ``~/.cache/opmux``), where ``<key>``
hashes the kernel sources, the torch version, the compiler, the compiler flags and the host CPU
flags (``-march=native`` code must not be shared between CPUs with different ISAs); the sources
are read again only when one of them changed (:meth:`~opmux.plugins.build_cache.BuildCache.key`).
Building, the integrity stamp checked before loading, rebuilding a damaged entry and the build
lock are :mod:`opmux.plugins.build_cache`'s; a second process with the same key verifies the
stamp and only loads the library.

A failed build (no compiler, no ninja, compile error, unwritable cache) never raises out of
:func:`build_status`: it returns ``(False, message)`` with the compiler output so that the
``cpp`` provider can be registered as unsupported and the reason shown in the plugin report.
:func:`build` raises :class:`opmux.BuildError` instead, for the ``opmux build`` command.
"""

from __future__ import annotations

import os
import platform
import warnings
from pathlib import Path

from opmux.core import config
from opmux.core.errors import BuildError
from opmux.plugins.build_cache import BuildCache, csrc_root

__all__ = ["CACHE", "CFLAGS", "LDFLAGS", "build", "build_dir", "build_status", "source_dir",
           "sources"]

CFLAGS: tuple[str, ...] = ("-O3", "-march=native", "-fopenmp", "-Wno-unused-function")
"""Compiler flags; part of the cache key."""

LDFLAGS: tuple[str, ...] = ("-fopenmp",)
"""Linker flags; part of the cache key."""

_LIB_PREFIX = "opmux_cpu_kernels"

CACHE = BuildCache("cpu", f"{_LIB_PREFIX}.so", "opmux cpu kernels")
"""The cache entry, lock and per-process status of the CPU kernel library."""


def source_dir() -> Path:
    """Folder holding the C++ sources (``cpu/`` of :func:`~opmux.plugins.build_cache.csrc_root`)."""
    return csrc_root() / "cpu"


def sources() -> list[Path]:
    """The translation units to compile, sorted."""
    return sorted(source_dir().glob("*.cpp"))


def _cpu_flags() -> str:
    """The host's CPU feature flags (x86 ``flags`` / arm ``Features``), or the machine name."""
    try:
        text = Path("/proc/cpuinfo").read_text(encoding="utf-8", errors="replace")
    except OSError:
        return platform.machine()
    for line in text.splitlines():
        if line.startswith(("flags", "Features")):
            return platform.machine() + ":" + line.split(":", 1)[1].strip()
    return platform.machine()


def _key() -> str:
    import torch

    root = source_dir()
    inputs = [os.path.join(root, name) for name in os.listdir(root)  # as glob("*"): no dot files
              if name.endswith((".cpp", ".h")) and not name.startswith(".")]
    return CACHE.key(root, inputs, (torch.__version__, config.cxx(),
                                    " ".join(CFLAGS), " ".join(LDFLAGS), _cpu_flags()))


def build_dir() -> Path:
    """The cache folder the current sources, flags and CPU build into."""
    return CACHE.entry(_key())


def _compile(directory: Path, verbose: bool) -> Path:
    """Compile the kernels into the empty folder ``directory``; return the library path."""
    srcs = sources()
    if not srcs:
        raise BuildError(f"opmux cpu kernels: no C++ sources found under {source_dir()}")
    # imported only to compile: it pulls in setuptools (benchmarks/startup.py)
    from torch.utils import cpp_extension

    # ninja's own output (the compiler's messages) travels in the exception on failure.
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            path = cpp_extension.load(
                name=_LIB_PREFIX,
                sources=[str(s) for s in srcs],
                extra_cflags=list(CFLAGS),
                extra_ldflags=list(LDFLAGS),
                build_directory=str(directory),
                verbose=verbose,
                is_python_module=False,
            )
        except Exception as exc:
            notes = "".join(f"\nwarning: {w.message}" for w in caught)
            raise BuildError(
                f"opmux cpu kernels failed to build in {directory} "
                f"(CXX={config.cxx()!r}): {type(exc).__name__}: {exc}{notes}"
            ) from exc
    return Path(path)


def _load(verbose: bool) -> str:
    """Build if needed (verified cache entry), load the library; describe what was loaded."""
    import torch

    library = CACHE.ensure(_key(), lambda directory: _compile(directory, verbose))
    torch.ops.load_library(str(library))  # type: ignore[no-untyped-call]
    return f"loaded {library}"


def build(verbose: bool = False) -> str:
    """Build (or load from the cache) the CPU kernels; safe to call from several threads.

    :param verbose: print the compiler command lines and output.
    :returns: a one-line description of what was loaded.
    :raises BuildError: when compiling or loading fails; the message carries the compiler output.
    """
    ok, message = build_status(verbose=verbose)
    if not ok:
        raise BuildError(message)
    return message


def build_status(verbose: bool = False) -> tuple[bool, str]:
    """Build or load the kernels once per process and report the outcome; never raises.

    :param verbose: print the compiler command lines and output (first call only).
    :returns: ``(True, "loaded <library path>")`` or ``(False, <error with compiler output>)``.
    """
    return CACHE.status(lambda: _load(verbose))
