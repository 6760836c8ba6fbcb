"""The installed entry points of one group, remembered between processes.

:func:`importlib.metadata.entry_points` reads the metadata of every installed distribution
(about 5 ms at each start-up in an environment of a few hundred packages), while its answer
changes only when what is installed changes. The answer is kept in
``$OPMUX_CACHE_DIR/entry_points/<group>-<hash of the interpreter and sys.path>.json``
with a *stamp* of what it depends on:

* every ``sys.path`` entry with its modification and change times and inode (installing or
  removing a distribution adds or removes a ``*.dist-info`` folder there, which changes the
  folder's times; pip replaces the folder on a reinstall);
* ``sys.meta_path``'s finders (their classes);
* each ``entry_points.txt`` that declared an entry point of the group, with its times and
  inode (an edit in place).

File times advance in clock ticks, so an install in the same tick as the scan could leave
the times as they were: the answer is written only once every time in the stamp is two
seconds old (the first start after an install reads the metadata, later ones the file).

A stamp that differs, a file that does not parse or has another shape, or a distribution
found by anything but a path on ``sys.path`` means the metadata is read again (and the file
rewritten where the folder can be written). Not seen: a distribution that had no entry point
of the group and gains one by an edit of its installed ``entry_points.txt`` in place (a
reinstall is seen); ``OPMUX_CACHE_DIR`` pointing elsewhere, or deleting the file, reads the
metadata again. Each script folder on ``sys.path`` has a file of its own; the 32 newest
files of a group are kept.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.metadata
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

from opmux.core import config
from opmux.core._files import write_quietly

__all__: list[str] = []

_VERSION = 2
"""The file format; another number is read as a miss."""

_KEEP = 32
"""How many files (environments and script folders) of one group the cache folder keeps."""

_SETTLED_NS = 2_000_000_000
"""How old (ns) every time in a stamp must be before the answer is written."""


def _stat(path: str) -> list[int] | None:
    try:
        st = os.stat(path or ".")
    except (OSError, ValueError):
        return None
    return [st.st_mtime_ns, st.st_ctime_ns, st.st_ino]


def _settled(stats: list[list[int] | None]) -> bool:
    """Whether every time in ``stats`` is :data:`_SETTLED_NS` old."""
    newest = max((max(st[0], st[1]) for st in stats if st is not None), default=0)
    return newest <= time.time_ns() - _SETTLED_NS


def _stamp() -> list[Any]:
    return [sys.path[:], [_stat(p) for p in sys.path],
            [_name(f if isinstance(f, type) else type(f)) for f in sys.meta_path]]


def _name(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def _file(group: str) -> Path:
    """One file per group and ``sys.path`` (environments sharing a cache folder keep theirs)."""
    where = hashlib.sha256("\0".join([sys.executable, *sys.path]).encode()).hexdigest()[:16]
    return config.cache_dir() / "entry_points" / f"{group}-{where}.json"


def _from_file(path: Path, stamp: list[Any], group: str) -> \
        list[importlib.metadata.EntryPoint] | None:
    """The cached entry points, or ``None`` when the file is missing, damaged or stale."""
    try:
        data = json.loads(path.read_bytes())
        if data["version"] != _VERSION or data["stamp"] != stamp:
            return None
        entries = data["entries"]
        out = []
        for name, value, dist_path, txt_stat in entries:
            if _stat(os.path.join(dist_path, "entry_points.txt")) != txt_stat:
                return None
            ep = importlib.metadata.EntryPoint(name, value, group)
            _attach(ep, importlib.metadata.PathDistribution(Path(dist_path)))
            out.append(ep)
        return out
    except (OSError, ValueError, KeyError, TypeError):  # missing, damaged, another shape
        return None


def _attach(ep: importlib.metadata.EntryPoint, dist: importlib.metadata.Distribution) -> None:
    """Set ``ep.dist`` the way :mod:`importlib.metadata` does (where this Python allows)."""
    with contextlib.suppress(AttributeError, TypeError):
        vars(ep).update(dist=dist)


def _write(path: Path, stamp: list[Any], eps: list[importlib.metadata.EntryPoint]) -> None:
    """Write the cache file atomically; skip it where a distribution has no folder."""
    entries: list[list[Any]] = []
    stats: list[list[int] | None] = list(stamp[1])
    for ep in eps:
        dist_path = getattr(getattr(ep, "dist", None), "_path", None)
        if not isinstance(dist_path, Path) or not dist_path.is_dir():
            return  # a zip, a custom finder: not stamped here, so not cached
        stats.append(_stat(str(dist_path / "entry_points.txt")))
        entries.append([ep.name, ep.value, str(dist_path), stats[-1]])
    if not _settled(stats):
        return  # changed a moment ago: a change in the same clock tick would not show
    try:
        data = json.dumps({"version": _VERSION, "stamp": stamp, "entries": entries})
    except (TypeError, ValueError):  # a value JSON cannot hold
        return
    # a read-only folder only costs the next start the scan
    if write_quietly(path, data.encode()):
        _prune(path.parent, path.name.rsplit("-", 1)[0])


def _prune(folder: Path, group: str) -> None:
    """Keep the :data:`_KEEP` newest files of ``group`` (each script folder on ``sys.path``
    gets a file of its own, so they would pile up)."""
    with contextlib.suppress(OSError):
        files = [(entry.stat().st_mtime_ns, entry.path) for entry in os.scandir(folder)
                 if entry.name.startswith(f"{group}-") and entry.name.endswith(".json")]
        for _, old in sorted(files, reverse=True)[_KEEP:]:
            with contextlib.suppress(OSError):
                os.unlink(old)


def _scan(group: str) -> list[importlib.metadata.EntryPoint]:
    return sorted(importlib.metadata.entry_points(group=group), key=lambda e: e.name)


def entry_points(group: str) -> list[importlib.metadata.EntryPoint]:
    """The entry points of ``group``, sorted by name (from the cache file when it is valid)."""
    try:
        stamp = _stamp()
        path = _file(group)
    except (TypeError, ValueError, OSError, RuntimeError):
        # a sys.path entry that is not a string, or no home folder for the default cache
        # folder: nothing is cached, the metadata is read as without the cache
        return _scan(group)
    cached = _from_file(path, stamp, group)
    if cached is not None:
        return cached
    eps = _scan(group)
    _write(path, stamp, eps)
    return eps
