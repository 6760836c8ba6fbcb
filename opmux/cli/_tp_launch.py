"""The local ``--tp N`` launcher of ``opmux generate``: N ranks that die with it.

Each rank is a child process in a process group of its own making (the launcher's
``killpg`` reaches every rank and whatever a rank starts), and on Linux asks the kernel for
``SIGKILL`` when the launcher dies (``prctl(PR_SET_PDEATHSIG)``, set between ``fork`` and
``exec``), so that no rank outlives its launcher: not on ``SIGINT`` or ``SIGTERM`` (the
launcher stops the ranks, then exits 128 + the signal), not on ``SIGKILL`` and not on a
crash (the kernel stops them). Rank logs are anonymous temporary files: nothing is left on
disk whatever ends the launcher.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from types import FrameType
from typing import Final, TextIO

__all__ = ["launch"]

_PR_SET_PDEATHSIG: Final = 1
"""``prctl`` option: the signal this process gets when its parent thread dies."""


def _die_with_parent(parent: int) -> Callable[[], None]:
    """The ``preexec_fn`` of a rank: ``SIGKILL`` when ``parent`` dies (Linux), and its own
    process group."""

    def child() -> None:
        os.setpgid(0, 0)
        if sys.platform.startswith("linux"):
            libc = ctypes.CDLL(None, use_errno=True)
            libc.prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)
            if os.getppid() != parent:  # the launcher died before the request took effect
                os._exit(1)

    return child


def _stop(procs: Sequence[subprocess.Popen[str]]) -> None:
    """Kill every rank (and its process group) still running, and reap them."""
    for p in procs:
        if p.poll() is None:
            with contextlib.suppress(OSError):
                os.killpg(p.pid, signal.SIGKILL)
            with contextlib.suppress(OSError):
                p.kill()
    for p in procs:
        p.wait()


class _Signalled(BaseException):
    """The launcher got ``SIGINT``/``SIGTERM``/``SIGHUP``: stop the ranks, then exit."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


@contextlib.contextmanager
def _signals_stop_ranks() -> Iterator[None]:
    """Turn ``SIGINT``/``SIGTERM``/``SIGHUP`` into :class:`_Signalled` while the ranks run
    (main thread only: elsewhere Python delivers no signals, and the parent-death signal
    still stops the ranks)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum: int, frame: FrameType | None) -> None:
        raise _Signalled(signum)

    caught = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
    previous = {s: signal.signal(s, handler) for s in caught}
    try:
        yield
    finally:
        for s, h in previous.items():
            signal.signal(s, h)


def launch(tp: int, argv: list[str], out: TextIO, err: TextIO) -> int:
    """Start ``tp`` ranks of ``opmux generate argv`` on this machine; rank 0 reports.

    When a rank fails, the others (which would wait for it in a collective) are stopped;
    so are all of them when the launcher is interrupted.

    :returns: the first non-zero exit status of a rank, 128 + the signal when interrupted,
        else 0.
    """
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs: list[subprocess.Popen[str]] = []
    with contextlib.ExitStack() as stack:
        logs = [stack.enter_context(tempfile.TemporaryFile("w+")) for _ in range(tp + 1)]
        try:
            with _signals_stop_ranks():
                for rank in range(tp):
                    env = {**os.environ, "WORLD_SIZE": str(tp), "RANK": str(rank),
                           "LOCAL_RANK": str(rank), "MASTER_ADDR": "127.0.0.1",
                           "MASTER_PORT": str(port),
                           "OMP_NUM_THREADS": str(max(1, (os.cpu_count() or 1) // tp))}
                    procs.append(subprocess.Popen(
                        [sys.executable, "-m", "opmux.cli", "generate", *argv], env=env,
                        stdout=logs[tp] if rank == 0 else subprocess.DEVNULL,
                        stderr=logs[rank], text=True,
                        preexec_fn=_die_with_parent(os.getpid())))
                while any(p.poll() is None for p in procs):
                    if any(p.returncode for p in procs):  # one failed: stop the others
                        break
                    time.sleep(0.05)
        except _Signalled as exc:
            _stop(procs)
            err.write(f"opmux generate: stopped by signal {signal.Signals(exc.signum).name}; "
                      f"the {tp} ranks were stopped\n")
            return 128 + exc.signum
        finally:
            _stop(procs)
        codes = [p.returncode for p in procs]
        logs[tp].seek(0)
        out.write(logs[tp].read())
        for rank, code in enumerate(codes):
            if code:
                logs[rank].seek(0)
                err.write(f"[rank {rank}] exit {code}\n{logs[rank].read()}")
    return next((c for c in codes if c), 0)
