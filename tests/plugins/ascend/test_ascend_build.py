"""Build of the MindSpore extension: backend choice, content-keyed cache, skipped rebuilds."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from types import ModuleType

import pytest

import opmux
from opmux.plugins.ascend import build

pytestmark = [pytest.mark.mindspore, pytest.mark.slow]


def test_backend_follows_cann(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv("ASCEND_HOME_PATH", raising=False)
    monkeypatch.delenv("ASCEND_TOOLKIT_HOME", raising=False)
    assert (build.backend(), build.cann_home()) == ("CPU", None)
    monkeypatch.setenv("ASCEND_TOOLKIT_HOME", str(tmp_path / "missing"))
    assert build.backend() == "CPU"  # a path that does not exist does not count
    monkeypatch.setenv("ASCEND_HOME_PATH", str(tmp_path))
    assert (build.backend(), build.cann_home()) == ("Ascend", tmp_path)


def test_cache_key_tracks_sources_and_backend(monkeypatch: pytest.MonkeyPatch,
                                              tmp_path: Path) -> None:
    pytest.importorskip("mindspore")
    csrc = tmp_path / "csrc"
    shutil.copytree(build.source_root() / "ms_module", csrc / "ms_module")
    shutil.copytree(build.source_root() / "ascendc", csrc / "ascendc")
    monkeypatch.setattr(build, "source_root", lambda: csrc)
    monkeypatch.setenv("OPMUX_CACHE_DIR", str(tmp_path / "cache"))
    first = build.build_dir("CPU")
    assert first.parent == tmp_path / "cache" / "ascend"
    assert build.build_dir("CPU") == first  # stable
    assert build.build_dir("Ascend") != first
    kernel = csrc / "ascendc" / "adv_step_flash.c"
    kernel.write_text(kernel.read_text() + "\n// changed\n")
    assert build.build_dir("CPU") != first  # any source change means a new build


def test_rebuild_skipped_when_sources_unchanged(extension: ModuleType) -> None:
    # A fresh process finds the library by its key and imports it without CustomOpBuilder
    # (whose own cache is per process: it would run ninja again) and without a compiler.
    code = (
        "import time, mindspore\n"
        "def refuse(*a, **k): raise AssertionError('CustomOpBuilder must not run')\n"
        "mindspore.ops.CustomOpBuilder = refuse\n"
        "from opmux.plugins.ascend import build\n"
        "t = time.perf_counter(); m = build.load(); dt = time.perf_counter() - t\n"
        "print(m.__file__); print(dt)\n"
    )
    env = dict(os.environ)
    env.pop("ASCEND_HOME_PATH", None)
    env.pop("ASCEND_TOOLKIT_HOME", None)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env=env, check=False)
    assert out.returncode == 0, out.stderr[-3000:]
    path, seconds = out.stdout.split()[-2:]
    assert path == extension.__file__
    assert float(seconds) < 5.0


def test_load_skips_compile_when_stamped(extension: ModuleType,
                                         monkeypatch: pytest.MonkeyPatch) -> None:
    import mindspore

    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("CustomOpBuilder must not run")

    monkeypatch.setattr(mindspore.ops, "CustomOpBuilder", refuse)
    t = time.perf_counter()
    path = build.build("CPU")
    assert time.perf_counter() - t < 1.0
    assert path == Path(extension.__file__)


_BROKEN_BUILD = """
import json, sys
from pathlib import Path
import opmux
from opmux.plugins.ascend import build
build.source_root = lambda: Path(sys.argv[1])
ok, message = build.build_status()
try:
    build.build()
    error = None
except opmux.BuildError as exc:
    error = str(exc)
print(json.dumps([ok, message, error]))
"""


def test_build_failure_is_reported_not_raised(tmp_path: Path) -> None:
    # a fresh process: this one has the extension loaded already (load() runs once)
    pytest.importorskip("mindspore")
    bad = tmp_path / "csrc"
    (bad / "ms_module").mkdir(parents=True)
    (bad / "ms_module" / "broken.cpp").write_text("this is not C++;\n")
    env = {**os.environ, "OPMUX_CACHE_DIR": str(tmp_path / "cache")}
    out = subprocess.run([sys.executable, "-c", _BROKEN_BUILD, str(bad)], capture_output=True,
                         text=True, env=env, check=False)
    assert out.returncode == 0, out.stderr[-3000:]
    ok, message, error = json.loads(out.stdout.splitlines()[-1])
    assert not ok
    assert "broken.cpp" in message and "failed to build" in message
    assert error is not None and "failed to build" in error


def test_unknown_backend_is_rejected() -> None:
    pytest.importorskip("mindspore")
    with pytest.raises(opmux.BuildError, match=r"backend must be one of \['Ascend', 'CPU'\], "
                                               r"got 'GPU'"):
        build.build("GPU")
