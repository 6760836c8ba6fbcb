"""The build cache shared by every native provider (``cpp``, ``cuda_c``, ``mindspore``).

Layout: ``<root>/<kind>/<key>/`` holds one built library plus its intermediate files, where
``<root>`` is ``$OPMUX_CACHE_DIR`` (default ``~/.cache/opmux``), ``<kind>`` names the library
(``cpu``, ``cuda_c``, ``ascend``) and ``<key>`` is :func:`hash_key` of everything the library
depends on (sources, compiler, flags, torch / MindSpore version, CPU features).

Integrity: a build runs in a fresh temporary folder next to the entry; only
after it completed is a stamp written (:data:`STAMP`: the library's name, size and sha256, and
the sha256 of every intermediate file), and the folder is renamed into place. A process that
finds an entry checks the stamp *before* it maps the library (a truncated shared object is a
``SIGBUS`` when a page past its end is touched, not an exception), so an entry without a stamp,
with a library of another size or checksum, empty or garbage, is rebuilt: the damaged folder is
replaced in one rename. Intermediate files whose checksum still matches the stamp are copied
into the new build first, so ninja only relinks when just the library was damaged. The
library's checksum is read once: after a match, ``<root>/<kind>/.checked-<key>.json`` records
the file's size, mtime, ctime, inode and device (once its ctime is two seconds old, as for keys
below), and a later start-up that finds all of them unchanged skips the read. Any write to the
library moves its ctime, so a damaged library is read and refused again.

Keys: hashing every source file would slow every start-up, so :meth:`BuildCache.key`
remembers the last key of a source tree in ``<root>/<kind>/.sources-<tree>.json`` with the size,
mtime, ctime and inode of each file, and hashes again only when one of them (or the file list, or
another input) changed. ctime moves on every write, even one that puts the old mtime back.

Concurrency: one build per entry at a time, across threads (a :class:`threading.RLock` per
cache) and processes (an ``fcntl`` lock on ``<root>/<kind>/<key>.lock``); a process that waited
finds the entry built and loads it. A verified entry is loaded without taking the lock or
writing anything, so a read-only, prebuilt cache works.

Failures never raise out of :meth:`BuildCache.status`: it returns ``(False, message)``, the
provider is registered unsupported with that message, and ``opmux info`` shows it; an
unwritable cache folder is such a message (what failed, and to set ``OPMUX_CACHE_DIR``).
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import shutil
import stat
import tempfile
import threading
import time
import weakref
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Final

from opmux.core import config
from opmux.core._cache_json import read_cache_json, warn_ignored
from opmux.core.errors import BuildError

__all__ = ["STAMP", "BuildCache", "cache_root", "cann_home", "csrc_root", "file_sha256", "hash_key",
           "reset_statuses", "verify", "write_quietly"]

_SOURCES_STAMP: Final = ".sources-{}.json"
"""Name (per source tree) of the file that remembers a tree's last key (:meth:`BuildCache.key`)."""

SETTLED_NS = 2_000_000_000
"""A key is remembered only when every file's ctime is this old (ns): file times advance in
clock ticks, so a file written twice within one tick could otherwise look unchanged."""

STAMP: Final = ".opmux-stamp.json"
"""Name of the stamp file written into an entry after a complete build."""

_MAX_STAMP_BYTES: Final = 1 << 20
"""A stamp (or checksum record) larger than this is damaged."""

_HASH_CHUNK: Final = 1 << 20
#: every build cache of the process, for reset_statuses (a cache no longer used drops out)
_caches: weakref.WeakSet[BuildCache] = weakref.WeakSet()


def cache_root() -> Path:
    """The root of every native build cache (``$OPMUX_CACHE_DIR``, default ``~/.cache/opmux``)."""
    return config.cache_dir()


def csrc_root() -> Path:
    """The folder holding the native sources: ``cpu/``, ``cuda/`` and ``ascend/`` (``ascendc/``,
    ``ms_module/``).

    A wheel ships them as ``opmux/_csrc``; a source checkout (editable install) has them in
    ``csrc/`` at the top of the tree.
    """
    package = Path(__file__).resolve().parents[1]
    shipped = package / "_csrc"
    return shipped if shipped.is_dir() else package.parent / "csrc"


def cann_home() -> Path | None:
    """The CANN toolkit folder (:func:`opmux.core.config.cann_home`)."""
    return config.cann_home()


def write_quietly(path: Path, data: bytes) -> bool:
    """Put ``data`` at ``path`` atomically, creating its folder; ``False`` if it could not.

    The bytes go to a temporary file of a unique name beside ``path`` (permissions from the
    umask, as for any file the process creates), which is then renamed over ``path``: a
    reader sees the old content or the new, never part of it, and two writers never share a
    temporary file. For caches, where a folder that cannot be written only costs the next
    process the work the file would have saved: every ``OSError`` gives ``False``, and the
    temporary file is removed.
    """
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{os.urandom(4).hex()}.tmp")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
    except OSError:
        return False
    try:
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)
        os.replace(tmp, path)
    except OSError:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        return False
    return True


def hash_key(base: Path, files: Iterable[Path], parts: Iterable[str]) -> str:
    """A 16-hex-digit key over ``files`` (path relative to ``base`` and content) and ``parts``.

    :param base: the folder the file names are taken relative to (moving the tree keeps keys).
    :param files: the inputs of the build; their order does not matter.
    :param parts: other inputs (versions, compiler, flags), in a fixed order.
    """
    h = hashlib.sha256()
    for path in sorted(files):
        h.update(str(path.relative_to(base)).encode() + b"\0" + path.read_bytes() + b"\0")
    for part in parts:
        h.update(b"\1" + part.encode())
    return h.hexdigest()[:16]


def file_sha256(path: Path) -> str:
    """The sha256 of the file at ``path`` (hex), read in chunks."""
    h = hashlib.sha256()
    with open(path, "rb") as handle:
        while chunk := handle.read(_HASH_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def _file_signature(path: str) -> tuple[str, int, int, int, int]:
    """``path`` and what changes whenever its content may have: size, mtime, ctime, inode."""
    st = os.stat(path)
    return path, st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino


def _read_stamp(entry: Path) -> dict[str, object] | None:
    """The entry's stamp when it is one (untrusted data: size-capped, schema-checked); a
    damaged stamp gets one warning naming it, and the entry is rebuilt."""
    path = entry / STAMP
    data, why = read_cache_json(path, _MAX_STAMP_BYTES)
    if why == "missing":
        return None
    if why is None and _is_stamp(data):
        return dict(data)
    warn_ignored(path, why or "not a build stamp", "build stamp; the entry is rebuilt",
                 stacklevel=3)
    return None


def _is_stamp(data: object) -> bool:
    if not isinstance(data, dict):
        return False
    files = data.get("files", {})
    return (isinstance(data.get("library"), str) and type(data.get("size")) is int
            and isinstance(data.get("sha256"), str) and isinstance(files, dict)
            and all(isinstance(name, str) and "/" not in name and name not in ("", ".", "..")
                    and isinstance(digest, str) for name, digest in files.items()))


def verify(entry: Path, library: str) -> str | None:
    """Why ``entry`` cannot be loaded (missing, unstamped, damaged library), or ``None`` if sound.

    Reads the library's bytes, never maps them: this runs before ``dlopen``. The checksum is
    read once per library file: a match is recorded (:func:`_checked_path`) with the file's
    size, mtime, ctime, inode and device, and while all of them are unchanged the record
    stands for it.
    """
    path = entry / library
    try:
        st = os.stat(path)
    except OSError:
        st = None
    if st is None or not stat.S_ISREG(st.st_mode):
        return f"{path} does not exist"
    stamp = _read_stamp(entry)
    if stamp is None or stamp.get("library") != library:
        return f"{entry} has no valid build stamp (interrupted or foreign build)"
    if st.st_size != stamp.get("size"):
        return f"{path} has {st.st_size} bytes, its build stamp says {stamp.get('size')}"
    seen = [st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino, st.st_dev, stamp.get("sha256")]
    checked = _checked_path(entry)
    if read_cache_json(checked, _MAX_STAMP_BYTES)[0] == seen:  # damaged: checksum read again
        return None
    if file_sha256(path) != stamp.get("sha256"):
        return f"{path} does not match the sha256 of its build stamp"
    if st.st_ctime_ns <= time.time_ns() - SETTLED_NS:  # see SETTLED_NS
        # a read-only cache: the checksum is read at each start-up
        write_quietly(checked, json.dumps(seen).encode())
    return None


def _checked_path(entry: Path) -> Path:
    """``<root>/<kind>/.checked-<key>.json``: the record of the entry's last checksum match."""
    return entry.with_name(f".checked-{entry.name}.json")


def _write_stamp(folder: Path, library: Path) -> None:
    files = {p.name: file_sha256(p) for p in sorted(folder.iterdir())
             if p.is_file() and p != library and not p.name.startswith(".opmux-")}
    stamp = {"library": library.name, "size": library.stat().st_size,
             "sha256": file_sha256(library), "files": files}
    tmp = folder / (STAMP + ".tmp")
    tmp.write_text(json.dumps(stamp, indent=1), encoding="utf-8")
    with open(tmp, "rb") as handle:  # the stamp is the commit point: make it durable first
        os.fsync(handle.fileno())
    tmp.rename(folder / STAMP)


def _salvage(old: Path, new: Path, library: str) -> None:
    """Copy the intermediate files of a damaged entry whose checksum still matches its stamp."""
    stamp = _read_stamp(old)
    files = stamp.get("files") if stamp is not None else None
    if not isinstance(files, dict):
        return
    for name, digest in files.items():
        src = old / str(name)
        if name == library or not src.is_file():
            continue
        with contextlib.suppress(OSError):
            if file_sha256(src) == digest:
                shutil.copy2(src, new / src.name)  # keeps mtimes: ninja sees it up to date


class BuildCache:
    """One native library's cache entry, build lock and per-process status.

    :param kind: the sub-folder of the cache root (``"cpu"``, ``"cuda_c"``, ``"ascend"``).
    :param library: the file name of the built library inside an entry.
    :param what: how messages name the library (``"opmux cpu kernels"``).
    """

    def __init__(self, kind: str, library: str, what: str) -> None:
        self.kind = kind
        self.library = library
        self.what = what
        self._lock = threading.RLock()
        #: ``(ok, message)`` once :meth:`status` ran in this process.
        self.cached_status: tuple[bool, str] | None = None
        #: how many builds this process ran (and installed) for this cache.
        self.builds = 0
        _caches.add(self)

    def key(self, base: Path, files: Iterable[str | os.PathLike[str]],
            parts: Iterable[str]) -> str:
        """:func:`hash_key` of these inputs, without reading the files when none changed.

        The last key computed for the tree ``base`` is kept with each file's size, mtime,
        ctime and inode and the ``parts``; if all of them are the same now, that key is
        returned, else the files are hashed and the record replaced, once no file has
        changed for two seconds (an unwritable cache only means hashing every time).
        """
        names = [os.fspath(path) for path in files]
        parts = list(parts)
        signatures = sorted(map(_file_signature, names))
        record: dict[str, object] = {"base": str(base), "parts": parts,
                                     "files": [list(sig) for sig in signatures]}  # as JSON
        name = _SOURCES_STAMP.format(hashlib.sha256(str(base).encode()).hexdigest()[:16])
        path = cache_root() / self.kind / name
        known, _ = read_cache_json(path)  # damaged or foreign: the files are hashed again
        if isinstance(known, dict) and isinstance(known.get("key"), str) \
                and {k: v for k, v in known.items() if k != "key"} == record:
            return str(known["key"])
        key = hash_key(base, map(Path, names), parts)
        if max((ctime for _, _, _, ctime, _ in signatures), default=0) \
                > time.time_ns() - SETTLED_NS:
            return key  # changed a moment ago: a change in the same clock tick would not show
        write_quietly(path, json.dumps({**record, "key": key}).encode())
        return key

    def entry(self, key: str) -> Path:
        """``<root>/<kind>/<key>``: the folder of the library built for ``key``."""
        return cache_root() / self.kind / key

    @contextlib.contextmanager
    def _exclusive(self, key: str) -> Iterator[None]:
        """Hold the thread lock and the inter-process lock of ``key``'s entry."""
        parent = cache_root() / self.kind
        with self._lock:
            try:
                parent.mkdir(parents=True, exist_ok=True)
                handle = open(parent / f"{key}.lock", "a")  # closed by the with below
            except OSError as exc:
                raise BuildError(
                    f"{self.what}: the build cache {parent} is not writable "
                    f"({type(exc).__name__}: {exc}); set OPMUX_CACHE_DIR to a writable folder "
                    f"(or prebuild there with `opmux build`)") from exc
            with handle:
                fcntl.flock(handle, fcntl.LOCK_EX)
                try:
                    yield
                finally:
                    fcntl.flock(handle, fcntl.LOCK_UN)

    def ensure(self, key: str, build: Callable[[Path], Path]) -> Path:
        """The path of a verified library for ``key``, building it first when needed.

        :param key: the entry's key (:func:`hash_key`).
        :param build: compiles into the empty folder it is given and returns the library path
            (inside that folder); raises on failure.
        :raises BuildError: the build failed, or the cache folder is not writable.
        """
        entry = self.entry(key)
        if verify(entry, self.library) is None:
            return entry / self.library
        with self._exclusive(key):
            damage = verify(entry, self.library)
            if damage is None:  # built by another process (or thread) meanwhile
                return entry / self.library
            try:
                tmp = Path(tempfile.mkdtemp(prefix=f".{key}.build-", dir=entry.parent))
            except OSError as exc:
                raise BuildError(f"{self.what}: cannot create a build folder in {entry.parent} "
                                 f"({exc}); set OPMUX_CACHE_DIR to a writable folder") from exc
            try:
                if entry.is_dir():
                    _salvage(entry, tmp, self.library)
                built = Path(build(tmp))
                if built.parent != tmp or not built.is_file() or built.stat().st_size == 0:
                    raise BuildError(f"{self.what}: the build reported {built}, but no library "
                                     f"was written in {tmp}")
                if built.name != self.library:
                    built = built.rename(tmp / self.library)
                _write_stamp(tmp, built)
                tmp.chmod(0o755)  # mkdtemp makes it private; the cache may be shared
                self._install(tmp, entry)
                self.builds += 1
            finally:
                shutil.rmtree(tmp, ignore_errors=True)
        return entry / self.library

    @staticmethod
    def _install(tmp: Path, entry: Path) -> None:
        """Rename the finished build ``tmp`` into place, replacing a damaged ``entry``."""
        if entry.exists() or entry.is_symlink():
            trash = Path(tempfile.mkdtemp(prefix=f".{entry.name}.damaged-", dir=entry.parent))
            entry.rename(trash / "entry")
            shutil.rmtree(trash, ignore_errors=True)
        tmp.rename(entry)

    def status(self, load: Callable[[], str]) -> tuple[bool, str]:
        """Run ``load`` once per process; ``(True, its message)`` or ``(False, the error)``.

        :param load: builds (through :meth:`ensure`) and loads the library, returning a
            one-line description; any exception becomes the ``False`` message.
        """
        if self.cached_status is not None:
            return self.cached_status
        with self._lock:
            if self.cached_status is None:
                try:
                    message = load()
                except Exception as exc:  # recorded, shown by the plugin report: never silent
                    self.cached_status = (False, str(exc))
                else:
                    self.cached_status = (True, message)
        return self.cached_status


def reset_statuses() -> None:
    """Forget every cache's per-process status (tests; a loaded library stays loaded)."""
    for cache in _caches:
        cache.cached_status = None
