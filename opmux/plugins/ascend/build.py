"""Building and loading the MindSpore extension ``_C_ops`` (``csrc/ascend/ms_module`` +
``csrc/ascend/ascendc``).

The extension is compiled by :class:`mindspore.ops.CustomOpBuilder` (g++ and ninja) for the
``Ascend`` backend when the CANN toolkit is found (``ASCEND_HOME_PATH`` or
``ASCEND_TOOLKIT_HOME``), after CMake has built the AscendC kernels into a static library;
otherwise for the ``CPU`` backend, where the same PyboostRunner runs a C++ loop.

Caching: the library lives in ``$OPMUX_CACHE_DIR/ascend/<backend>-<key>`` (default
``~/.cache/opmux``), where ``<key>`` hashes every file under ``csrc/ascend/ms_module`` and
``csrc/ascend/ascendc``, the backend, the MindSpore and Python versions and the CANN location;
the entry is built, stamped, verified before import and rebuilt when damaged by
:mod:`opmux.plugins.build_cache`. CustomOpBuilder's own cache is per process only (an in-memory
table of name, sources and flags, then a ninja run that re-checks every object; a repeated
request after a failed build is skipped and answered with a path that does not exist), so a
process that finds a verified entry imports the library directly, without CustomOpBuilder or
ninja, and a build is only requested when the entry is missing or damaged.

:func:`build_status` never raises: it returns ``(False, message)`` with the compiler output so
that the plugin registers its provider as unsupported, with that message as the reason.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import shutil
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Final

from opmux.core import config
from opmux.core.errors import BuildError
from opmux.plugins.build_cache import BuildCache, cann_home, csrc_root, hash_key

__all__ = [
    "EXTENSION_NAME",
    "backend",
    "build",
    "build_dir",
    "build_status",
    "cann_home",
    "load",
    "source_root",
    "sources",
]

EXTENSION_NAME: Final = "_C_ops"
"""Python module name of the extension (``MS_EXTENSION_NAME``)."""

ASCENDC_LIBRARY: Final = "opmux_ascendc_kernels"
"""Static library the AscendC kernels are archived into (``csrc/ascend/ascendc/CMakeLists.txt``)."""

CACHE = BuildCache("ascend", f"{EXTENSION_NAME}.so", "opmux ascend extension")
"""The cache entry, lock and per-process status of the MindSpore extension."""

_lock = threading.Lock()
_module: ModuleType | None = None


def source_root() -> Path:
    """The Ascend sources, ``csrc/ascend`` (shipped in wheels, or the source tree's): the
    MindSpore module in ``ms_module/``, the AscendC kernels in ``ascendc/``."""
    return csrc_root() / "ascend"


def sources() -> list[Path]:
    """The translation units of the MindSpore module, sorted."""
    return sorted((source_root() / "ms_module").glob("*.cpp"))


def backend() -> str:
    """``"Ascend"`` when the CANN toolkit is present, else ``"CPU"``."""
    return "Ascend" if cann_home() is not None else "CPU"


def _key(target: str) -> str:
    from importlib.metadata import version

    root = source_root()
    inputs = [path for sub in ("ms_module", "ascendc") for path in (root / sub).rglob("*")
              if path.is_file() and "__pycache__" not in path.parts]
    return hash_key(root, inputs, (target, version("mindspore"), sys.implementation.cache_tag or "",
                                   str(cann_home() or ""), config.cxx("g++")))


def build_dir(target: str | None = None) -> Path:
    """The cache folder for the current sources and ``target`` backend (default: detected)."""
    target = target or backend()
    return CACHE.entry(f"{target.lower()}-{_key(target)}")


@contextlib.contextmanager
def _ninja_on_path() -> Iterator[None]:
    """Make the ``ninja`` of the ``ninja`` wheel visible to CustomOpBuilder's subprocesses.

    CustomOpBuilder runs ``ninja`` from ``PATH``; a venv's ``bin`` is not on ``PATH`` when its
    python is started by full path. Restores ``PATH`` on exit.
    """
    if shutil.which("ninja") is not None:
        yield
        return
    candidates = [Path(sys.executable).parent]
    with contextlib.suppress(ImportError):
        import ninja  # type: ignore[import-not-found,import-untyped,unused-ignore]

        candidates.insert(0, Path(ninja.BIN_DIR))
    found = next((c for c in candidates if (c / "ninja").is_file()), None)
    if found is None:
        raise BuildError("opmux ascend extension: ninja not found on PATH; pip install ninja")
    old = os.environ.get("PATH", "")
    os.environ["PATH"] = f"{found}{os.pathsep}{old}"
    try:
        yield
    finally:
        os.environ["PATH"] = old


def _run(cmd: list[str], what: str) -> None:
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise BuildError(f"opmux ascend extension: {what} failed ({' '.join(cmd)}):\n"
                         f"{proc.stdout}\n{proc.stderr}")


def _build_ascendc(directory: Path, cann: Path) -> Path:
    """Configure and build ``csrc/ascend/ascendc`` with CMake; return the folder of the archive."""
    if shutil.which("cmake") is None:
        raise BuildError("opmux ascend extension: cmake is required to build the AscendC "
                         "kernels (CANN toolkit found at " + str(cann) + ")")
    out = directory / "ascendc"
    soc = config.ascend_soc_version()
    _run(["cmake", "-S", str(source_root() / "ascendc"), "-B", str(out),
          f"-DASCEND_CANN_PACKAGE_PATH={cann}", f"-DSOC_VERSION={soc}",
          f"-DASCENDC_TARGET_NAME={ASCENDC_LIBRARY}"], "configuring the AscendC kernels")
    _run(["cmake", "--build", str(out), "-j"], "building the AscendC kernels")
    archives = sorted(out.rglob(f"lib{ASCENDC_LIBRARY}.a"))
    if not archives:
        raise BuildError(f"opmux ascend extension: CMake finished but lib{ASCENDC_LIBRARY}.a "
                         f"is not under {out}")
    return archives[0].parent


def _compile(directory: Path, target: str) -> Path:
    """Run CustomOpBuilder into ``directory``; return the library path."""
    import mindspore as ms

    cflags = ["-Wno-attributes"]
    ldflags: list[str] = []
    cann = cann_home()
    if target == "Ascend":
        if cann is None:
            raise BuildError("opmux ascend extension: backend 'Ascend' needs the CANN toolkit; "
                             "set ASCEND_HOME_PATH (source the toolkit's set_env.sh)")
        lib_dir = _build_ascendc(directory, cann)
        cflags.append("-DOPMUX_WITH_ASCENDC")
        ldflags += [f"-L{lib_dir}", f"-l{ASCENDC_LIBRARY}", f"-L{cann / 'lib64'}", "-lruntime"]
    # A lock file left by an interrupted CustomOpBuilder run would make it wait forever; we
    # hold our own lock for this folder, so any such file is stale.
    (directory / "build.lock").unlink(missing_ok=True)
    builder = ms.ops.CustomOpBuilder(
        EXTENSION_NAME, [str(s) for s in sources()], backend=target,
        include_paths=[str(source_root())], cflags=" ".join(cflags),
        ldflags=" ".join(ldflags) or None, build_dir=str(directory),
    )
    _forget_in_process_version()
    with _ninja_on_path():
        built = Path(builder.build())
    if not built.is_file():
        raise BuildError(f"opmux ascend extension: CustomOpBuilder reported {built} but no "
                         f"library was written")
    return built


def _forget_in_process_version() -> None:
    """Drop CustomOpBuilder's in-process record of earlier builds of ``_C_ops``.

    CustomOpBuilder remembers (name, sources, flags) per process and skips the build when they
    repeat, even when the earlier build failed or went to another folder: it then returns the
    path of a library that does not exist. Our cache decides when to build instead.
    """
    with contextlib.suppress(ImportError, AttributeError):
        from mindspore.ops.operations._custom_ops_utils import version_manager

        version_manager.entries.pop(EXTENSION_NAME, None)


def build(target: str | None = None) -> Path:
    """Build the extension unless the keyed cache folder already holds it.

    :param target: ``"Ascend"`` or ``"CPU"``; default :func:`backend`.
    :returns: the path of ``_C_ops.so``.
    :raises BuildError: MindSpore missing, no compiler or ninja, CMake or compile errors (the
        message carries the tool output).
    """
    if importlib.util.find_spec("mindspore") is None:
        raise BuildError("opmux ascend extension: MindSpore is not installed "
                         "(pip install 'opmux[ascend]')")
    target = target or backend()
    if target not in ("Ascend", "CPU"):
        raise BuildError(f"opmux ascend extension: backend must be one of ['Ascend', 'CPU'], "
                         f"got {target!r}")
    srcs = sources()
    if not srcs:
        raise BuildError(f"opmux ascend extension: no sources under {source_root() / 'ms_module'}")
    key = build_dir(target).name

    def compile_into(directory: Path) -> Path:
        try:
            return _compile(directory, target)
        except BuildError:
            raise
        except Exception as exc:
            raise BuildError(f"opmux ascend extension failed to build in {directory} "
                             f"(backend {target!r}): {type(exc).__name__}: {exc}") from exc

    return CACHE.ensure(key, compile_into)


def load() -> ModuleType:
    """Build if needed and import the extension once per process.

    :raises BuildError: see :func:`build`; also when the library fails to import.
    """
    global _module
    if _module is not None:
        return _module
    with _lock:
        if _module is None:
            library = build()
            import mindspore  # noqa: F401  (the library links against its runtime)

            spec = importlib.util.spec_from_file_location(EXTENSION_NAME, library)
            if spec is None or spec.loader is None:
                raise BuildError(f"opmux ascend extension: cannot import {library}")
            module = importlib.util.module_from_spec(spec)
            try:
                spec.loader.exec_module(module)
            except ImportError as exc:
                raise BuildError(f"opmux ascend extension: importing {library} failed: "
                                 f"{exc}") from exc
            _module = module
    return _module


def build_status() -> tuple[bool, str]:
    """Build and import the extension once per process; report the outcome, never raise.

    :returns: ``(True, "loaded <library path>")`` or ``(False, <error with tool output>)``.
    """
    return CACHE.status(lambda: f"loaded {load().__file__}")
