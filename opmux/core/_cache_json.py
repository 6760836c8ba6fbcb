"""Reading JSON that opmux finds in a cache directory: untrusted data, never control.

A file under ``$OPMUX_CACHE_DIR`` (tuned tables, build stamps, source records) or a shared
``OPMUX_TRACE`` file may be damaged, truncated, foreign or hostile: a document nested
200,000 deep, a number where an object belongs, gigabytes. :func:`read_cache_json` reads at
most ``max_bytes``, decodes strict UTF-8 and parses with every failure (``RecursionError``
included) turned into a reason; the caller validates the schema and, on any problem,
ignores the file (rebuilding it where it is a cache) after :func:`warn_ignored`, one
warning naming the file. Nothing read here ever fails an op call or turns a provider off
for good.
"""

from __future__ import annotations

import json
import os
import warnings
from pathlib import Path
from typing import Any, Final

from opmux.core.state import runtime

__all__ = ["MAX_CACHE_BYTES", "read_cache_json", "warn_ignored"]

MAX_CACHE_BYTES: Final = 4 << 20
"""The largest cache file read (4 MiB); a larger one is ignored as damaged."""



def read_cache_json(path: str | os.PathLike[str], max_bytes: int = MAX_CACHE_BYTES
                    ) -> tuple[Any, str | None]:
    """``(data, None)``, or ``(None, why)`` when the file cannot be used.

    A missing file is ``(None, "missing")``; every other reason is a short phrase for a
    warning (``"larger than 4194304 bytes"``, ``"not JSON: ..."``, ``"nested too deep"``).
    """
    try:
        with open(path, "rb") as fh:
            raw = fh.read(max_bytes + 1)
    except FileNotFoundError:
        return None, "missing"
    except OSError as exc:  # a folder, a looping link, no permission
        return None, f"unreadable ({exc.strerror or type(exc).__name__})"
    if len(raw) > max_bytes:
        return None, f"larger than {max_bytes} bytes"
    try:
        return json.loads(raw.decode("utf-8")), None
    except RecursionError:
        return None, "nested too deep"
    except ValueError as exc:  # JSONDecodeError, UnicodeDecodeError
        return None, f"not JSON ({str(exc)[:80]})"


def warn_ignored(path: str | os.PathLike[str], why: str, what: str, stacklevel: int = 2
                 ) -> None:
    """One ``RuntimeWarning`` per file and reason per process: ``path`` is ignored.

    :param what: what the file is and what happens instead (``"tuned table; the plugins'
        priorities are used"``).
    """
    key = (str(Path(path)), why)
    rt = runtime()
    with rt.lock:
        if key in rt.ignored_files:
            return
        rt.ignored_files.add(key)
    warnings.warn(f"opmux: ignoring the {what.split(';')[0]} {key[0]}: {why}"
                  f"{';' + what.split(';', 1)[1] if ';' in what else ''}",
                  RuntimeWarning, stacklevel=stacklevel + 1)
