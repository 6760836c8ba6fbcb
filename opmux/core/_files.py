"""The one way opmux's caches write a file: whole or not at all, and never an error."""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

__all__ = ["write_quietly"]


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
