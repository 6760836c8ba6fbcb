"""The JIT build of the CPU kernels: cache reuse, failure reporting, provider registration."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

pytestmark = pytest.mark.slow

_PROBE = """
import json, sys
from opmux.plugins.cpu import build
ok, message = build.build_status()
print(json.dumps({"ok": ok, "message": message, "dir": str(build.build_dir())}))
"""


def _probe(env: dict[str, str]) -> dict[str, Any]:
    proc = subprocess.run([sys.executable, "-c", _PROBE], env={**os.environ, **env},
                          capture_output=True, text=True, timeout=300, check=True)
    return json.loads(proc.stdout.strip().splitlines()[-1])  # type: ignore[no-any-return]


def _snapshot(directory: Path) -> dict[str, tuple[int, int]]:
    return {p.name: (p.stat().st_mtime_ns, p.stat().st_ino)
            for p in directory.iterdir() if p.is_file()}


@pytest.fixture(scope="session")
def built() -> Path:
    from opmux.plugins.cpu import build

    ok, message = build.build_status()
    assert ok, message
    return build.build_dir()


def test_second_build_is_a_load(built: Path) -> None:
    before = _snapshot(built)
    objects = sorted(n for n in before if n.endswith(".o"))
    assert len(objects) == len(list(Path(built).glob("*.o"))) > 0
    assert "opmux_cpu_kernels.so" in before
    result = _probe({"OPMUX_CACHE_DIR": str(built.parents[1])})
    assert result["ok"], result["message"]
    assert result["dir"] == str(built)
    assert result["message"] == f"loaded {built / 'opmux_cpu_kernels.so'}"
    # nothing was compiled or relinked: same files, same inodes, same modification times
    assert _snapshot(built) == before


def test_build_key_depends_on_flags(built: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from opmux.plugins.cpu import build

    monkeypatch.setattr(build, "CFLAGS", (*build.CFLAGS, "-DOPMUX_TEST_FLAG"))
    assert build.build_dir() != built
    monkeypatch.undo()
    monkeypatch.setenv("CXX", "/opt/other/g++")
    assert build.build_dir() != built


def test_missing_compiler_is_reported_not_raised(tmp_path: Path) -> None:
    result = _probe({"OPMUX_CACHE_DIR": str(tmp_path), "CXX": "/nonexistent/bin/c++-missing"})
    assert result["ok"] is False
    assert "opmux cpu kernels failed to build" in result["message"]
    assert "/nonexistent/bin/c++-missing: not found" in result["message"]  # the shell said it
    assert not list(tmp_path.rglob("*.so")), "a failed build must not leave a library behind"


def test_compile_error_keeps_compiler_output(tmp_path: Path) -> None:
    # a copy of the sources with a syntax error, built in a fresh cache
    src = tmp_path / "csrc"
    src.mkdir()
    (src / "broken.cpp").write_text("int main( { return opmux_undefined_symbol; }\n")
    code = (
        "import json\n"
        "from pathlib import Path\n"
        "from opmux.plugins.cpu import build\n"
        f"build.source_dir = lambda: Path({str(src)!r})\n"
        "print(json.dumps(build.build_status()))\n"
    )
    proc = subprocess.run([sys.executable, "-c", code],
                          env={**os.environ, "OPMUX_CACHE_DIR": str(tmp_path / "cache")},
                          capture_output=True, text=True, timeout=300, check=True)
    ok, message = json.loads(proc.stdout.strip().splitlines()[-1])
    assert ok is False
    assert "broken.cpp" in message and "error" in message.lower()


def test_build_raises_build_error_on_failure(monkeypatch: pytest.MonkeyPatch) -> None:
    from opmux.core.errors import BuildError
    from opmux.plugins.cpu import build

    monkeypatch.setattr(build.CACHE, "cached_status", (False, "compiler said no"))
    with pytest.raises(BuildError, match="compiler said no"):
        build.build()


def test_plugin_hooks() -> None:
    import opmux.plugins.cpu as plugin

    assert plugin.opmux_plugin_info() == {"name": "cpu", "platforms": ["*"]}
    assert plugin.opmux_default_priority("rms_norm", None) == ["cpp", "native"]
    assert plugin.opmux_default_priority("not_an_op", None) is None
    assert plugin.opmux_default_priority("fused_moe", None) == ["cpp", "grouped", "native"]
    from opmux.plugins.cpu import cpp_ops

    assert set(cpp_ops.OPS) == set(plugin.SERVED_OPS)


def test_registered_provider_dispatches(built: Path) -> None:
    import opmux

    op = opmux.get_op("rms_norm")
    if "cpp" not in op.impls:  # plugins not loaded in this process yet
        opmux.load_plugins()
    impl = op.impls["cpp"]
    assert impl.supported and impl.dispatch_key == "CPU"
    x, w = torch.randn(3, 16), torch.randn(16)
    with op.set_priority(["cpp", "native"]):
        assert op.dispatch(x, w).provider == "cpp"
        torch.testing.assert_close(op(x, w), op.impls["native"].fn(x, w))
        # float64 is not handled by the kernels: supports_args sends it to native
        assert op.dispatch(x.double(), w.double()).provider == "native"


def test_unsupported_registration_keeps_reason(monkeypatch: pytest.MonkeyPatch) -> None:
    from opmux.plugins.cpu import build, cpp_ops

    calls: list[tuple[str, dict[str, Any]]] = []

    class FakeOp:
        def __init__(self, name: str) -> None:
            self.name = name
            self.namespace = "opmux"

        def register_impl(self, provider: str, **kw: Any) -> Any:
            calls.append((self.name, {"provider": provider, **kw}))
            return lambda fn: fn

    class FakeRegistry:
        def list_ops(self) -> list[FakeOp]:
            return [FakeOp(name) for name in cpp_ops.OPS]

    monkeypatch.setattr(build.CACHE, "cached_status", (False, "c++: not found"))
    done = cpp_ops.register(FakeRegistry())  # type: ignore[arg-type]
    assert done == [f"{name}:cpp" for name in cpp_ops.OPS]
    assert {name for name, _ in calls} == set(cpp_ops.OPS)
    for _, kw in calls:
        assert kw["provider"] == "cpp" and kw["dispatch_key"] == "CPU"
        assert kw["supported"] is False
        assert "c++: not found" in kw["reason"]
