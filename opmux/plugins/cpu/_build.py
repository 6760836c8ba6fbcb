"""Just-in-time build of the opmux CPU kernels (``csrc/cpu``) into a content-keyed cache.

The kernels are compiled with :func:`torch.utils.cpp_extension.load` (ninja) the first time they
are needed and loaded as a plain shared library (``is_python_module=False``): its static
``TORCH_LIBRARY(opmux_cpu, m)`` registration makes ``torch.ops.opmux_cpu.*`` available.

The build folder is ``$OPMUX_CACHE_DIR/cpu/<key>`` (default ``~/.cache/opmux``), where ``<key>``
hashes the kernel sources, the torch version, the compiler, the compiler flags and the host CPU
flags (``-march=native`` code must not be shared between CPUs with different ISAs). A second
process with the same key finds the objects up to date and only loads the library.

A failed build (no compiler, no ninja, compile error) never raises out of :func:`build_status`:
it returns ``(False, message)`` with the compiler output so that the ``cpp`` provider can be
registered as unsupported and the reason shown in the plugin report. :func:`build` raises
:class:`opmux.BuildError` instead, for the ``opmux build`` command.
"""

from __future__ import annotations

import hashlib
import os
import platform
import threading
import warnings
from pathlib import Path

from opmux.core.errors import BuildError

__all__ = ["CFLAGS", "LDFLAGS", "build", "build_dir", "build_status", "source_dir", "sources"]

CFLAGS: tuple[str, ...] = ("-O3", "-march=native", "-fopenmp", "-Wno-unused-function")
"""Compiler flags; part of the cache key."""

LDFLAGS: tuple[str, ...] = ("-fopenmp",)
"""Linker flags; part of the cache key."""

_LIB_PREFIX = "opmux_cpu_kernels"
_lock = threading.Lock()
_status: tuple[bool, str] | None = None


def source_dir() -> Path:
    """Folder holding the C++ sources (``cpu/`` of :func:`~opmux.plugins._sources.csrc_root`)."""
    from opmux.plugins._sources import csrc_root

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


def _cache_root() -> Path:
    root = os.environ.get("OPMUX_CACHE_DIR") or str(Path.home() / ".cache" / "opmux")
    return Path(root).expanduser()


def _key() -> str:
    import torch

    h = hashlib.sha256()
    for path in sorted(source_dir().glob("*")):
        if path.suffix in (".cpp", ".h"):
            h.update(path.name.encode())
            h.update(path.read_bytes())
    for part in (
        torch.__version__,
        os.environ.get("CXX", "c++"),
        " ".join(CFLAGS),
        " ".join(LDFLAGS),
        _cpu_flags(),
    ):
        h.update(b"\0" + part.encode())
    return h.hexdigest()[:16]


def build_dir() -> Path:
    """The cache folder the current sources, flags and CPU build into."""
    return _cache_root() / "cpu" / _key()


def _compile_and_load(verbose: bool) -> str:
    """Compile (or find up to date) and load the library; returns its path."""
    srcs = sources()
    if not srcs:
        raise BuildError(f"opmux cpu kernels: no C++ sources found under {source_dir()}")
    directory = build_dir()
    library = directory / f"{_LIB_PREFIX}.so"
    if library.is_file():
        # The folder name hashes everything the library depends on: load it without ninja.
        import torch

        try:
            torch.ops.load_library(str(library))  # type: ignore[no-untyped-call]
            return str(library)
        except OSError:  # a truncated library from an interrupted build: rebuild below
            pass
    # imported only to compile: it pulls in setuptools (~0.4 s of start-up)
    from torch.utils import cpp_extension

    directory.mkdir(parents=True, exist_ok=True)
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
                f"(CXX={os.environ.get('CXX', 'c++')!r}): {type(exc).__name__}: {exc}{notes}"
            ) from exc
    return str(path)


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
    global _status
    if _status is not None:
        return _status
    with _lock:
        if _status is None:
            try:
                _status = (True, f"loaded {_compile_and_load(verbose)}")
            except Exception as exc:  # recorded, shown by the plugin report: never silent
                _status = (False, str(exc))
    return _status
