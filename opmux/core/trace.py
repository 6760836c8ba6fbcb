"""``OPMUX_TRACE=FILE``: count which provider served each op, and write it at process exit.

When the variable is set, every process (spawned and forked workers too) writes
``{op: {provider: calls}}`` as JSON at exit. ``{pid}`` in ``FILE`` is replaced by the process
id, so each process gets its own file; without it, processes merge their counts into the one
file under a lock. Ops of the ``opmux`` namespace are keyed by their name
(``"rms_norm"``), others by ``namespace::name``. A process killed outright (``SIGKILL``) runs
no exit hook and writes nothing: call :func:`flush` before it is killed (vLLM's workers:
:class:`opmux.integrations.vllm.WorkerExtension`).

Zero cost when unset: nothing here runs on the dispatch hot path. The op's selection chains
are built with the providers' functions as they are; only when the variable is set does
:func:`wrap` (called where the chains are built, :meth:`opmux.core.priority.Priorities.rebuild`,
and where the native kernel is made) put a counting closure around each function, once. The
variable is read when those are built, i.e. at start-up: set it before the process starts.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import multiprocessing.util
import os
import sys
import threading
from collections.abc import Callable, Iterator
from typing import Any

from opmux.core import config
from opmux.core._cache_json import read_cache_json, warn_ignored

__all__ = ["counts", "flush", "trace_file", "wrap", "zero_counts"]

# Module globals, not fields of the runtime object: the counting closures built into the
# ops' chains hold these cells, and the chains outlive the runtime object.
_LOCK = threading.Lock()
#: (op key, provider) -> one-element list: the call count (a cell the closures share)
_CELLS: dict[tuple[str, str], list[int]] = {}
#: (op key, provider) -> count already merged into a shared (no ``{pid}``) file
_MERGED: dict[tuple[str, str], int] = {}
_HOOKS: list[int] = []  # pid of the process whose exit hooks are installed (once a process)
_EXITED: list[int] = []  # pid of the process whose exit flush has run (once a process)


def _op_key(qualname: str) -> str:
    ns, _, name = qualname.partition("::")
    return name if ns == "opmux" else qualname


def wrap(qualname: str, provider: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` itself when ``OPMUX_TRACE`` is unset; else ``fn`` wrapped to count its calls.

    Called when a selection chain or kernel is built, never per call.
    """
    if config.trace_path() is None:
        return fn
    key = (_op_key(qualname), provider)
    with _LOCK:
        cell = _CELLS.setdefault(key, [0])
        _install_hooks()

    def traced(*args: Any, **kwargs: Any) -> Any:
        cell[0] += 1
        return fn(*args, **kwargs)

    traced.__wrapped__ = fn  # type: ignore[attr-defined]
    traced.__name__ = getattr(fn, "__name__", "traced")
    return traced


def counts() -> dict[str, dict[str, int]]:
    """This process's counts so far: ``{op: {provider: calls}}`` (providers that ran)."""
    result: dict[str, dict[str, int]] = {}
    with _LOCK:
        for (op, provider), cell in sorted(_CELLS.items()):
            if cell[0]:
                result.setdefault(op, {})[provider] = cell[0]
    return result


def trace_file(pid: int | None = None) -> str | None:
    """The file this process writes (``{pid}`` expanded), or ``None`` when tracing is off."""
    pattern = config.trace_path()
    if pattern is None:
        return None
    return pattern.replace("{pid}", str(os.getpid() if pid is None else pid))


@contextlib.contextmanager
def _file_lock(path: str) -> Iterator[None]:
    try:
        import fcntl
    except ImportError:  # no advisory locks on this OS: merge without one
        yield
        return
    with open(path + ".lock", "a") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def flush() -> str | None:
    """Write the counts now (also done at exit); return the file written, or ``None``.

    With ``{pid}`` in the pattern the file holds this process's totals; without it this
    process's calls since its last flush are added to what the file holds; a shared file
    that holds no trace is replaced (with a ``RuntimeWarning``).

    :raises OSError: the file cannot be read or written.
    """
    pattern = config.trace_path()
    if pattern is None:
        return None
    path = trace_file()
    assert path is not None
    directory = os.path.dirname(path)
    if directory:
        os.makedirs(directory, exist_ok=True)
    if "{pid}" in pattern:
        _write_whole(path, counts())
        return path
    with _file_lock(path), _LOCK:
        held = _read_merged(path)
        data = {} if held is None else held
        changed = held is None  # a missing or damaged file is (re)written
        for (op, provider), cell in _CELLS.items():
            delta = cell[0] - _MERGED.get((op, provider), 0)
            if delta:
                per_op = data.setdefault(op, {})
                per_op[provider] = per_op.get(provider, 0) + delta
                _MERGED[(op, provider)] = cell[0]
                changed = True
        if changed:
            _write_whole(path, data)
    return path


def _write_whole(path: str, data: dict[str, dict[str, int]]) -> None:
    # a new file replaces the old whole: a process killed while writing damages none
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as fh:
        json.dump(data, fh, indent=1, sort_keys=True)
    os.replace(tmp, path)


def _read_merged(path: str) -> dict[str, dict[str, int]] | None:
    """What a shared trace file holds; ``None`` when there is none, with one warning when the
    file exists but holds no trace (damaged, too large, nested too deep, counts that are not
    integers >= 0: untrusted data, see :mod:`opmux.core._cache_json`).

    :raises OSError: the file exists but cannot be read (a folder, no permission).
    """
    data, why = read_cache_json(path)
    if why == "missing":
        return None
    if why is not None and why.startswith("unreadable"):
        with open(path, "rb"):  # the OSError itself, for the caller
            pass
        raise OSError(f"{path}: {why}")
    if why is None and isinstance(data, dict) and all(
            isinstance(per_op, dict) and all(
                type(n) is int and n >= 0 for n in per_op.values())
            for per_op in data.values()):
        return data
    shown = why or str(data)[:80]
    warn_ignored(path, shown, f"{config.ENV_TRACE} file; it holds no trace "
                              f"({{op: {{provider: calls}}}}) and is replaced by this "
                              f"process's counts", stacklevel=3)
    return None


def _flush_at_exit() -> None:
    # at exit there is no one left to report an I/O error to but stderr (which still works);
    # both exit hooks may run in one process: the second has nothing to add
    if _EXITED and _EXITED[0] == os.getpid():
        return
    _EXITED[:] = [os.getpid()]
    try:
        flush()
    except OSError as exc:
        # stderr: stdout may be a --json report that must stay JSON
        print(f"opmux: could not write the OPMUX_TRACE file: {exc}", file=sys.stderr,
              flush=True)


def _install_hooks() -> None:
    """Exit hooks of this process (called with ``_LOCK`` held, once per process)."""
    pid = os.getpid()
    if _HOOKS and _HOOKS[0] == pid:
        return
    _HOOKS[:] = [pid]
    atexit.register(_flush_at_exit)
    # multiprocessing's forked children leave through os._exit (atexit does not run) after
    # running the finalizers with an exit priority
    multiprocessing.util.Finalize(None, _flush_at_exit, exitpriority=0)


def _after_fork_in_child() -> None:
    # a forked child starts its own counts (the parent writes its own) and its own hooks;
    # the lock may have been held by another thread at the fork
    global _LOCK
    _LOCK = threading.Lock()
    for cell in _CELLS.values():
        cell[0] = 0
    _MERGED.clear()
    if _HOOKS:
        _HOOKS.clear()
        _install_hooks()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


def zero_counts() -> None:
    """Start every count at zero again (the cells stay: the chains hold them)."""
    with _LOCK:
        for cell in _CELLS.values():
            cell[0] = 0
        _MERGED.clear()
