"""The shared build cache: stamps, atomic install, rebuilds of damaged entries, locking, and
its file writes (whole or not at all, never an error).

Fault injection: a truncated, empty or garbage library in the cache, an
unwritable cache folder and two processes building at once. Tests that load a damaged real
library run in a subprocess, so that a regression (a SIGBUS when a truncated library is
mapped) fails the test instead of killing pytest. They reuse the CPU kernels built once for
the session: the good entry is copied into a temporary cache and damaged there, and the
rebuild relinks from the intact objects (seconds, not a full compile).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path
from typing import Any

import pytest

import opmux
from opmux.plugins import build_cache
from opmux.plugins.build_cache import STAMP, BuildCache, hash_key, verify, write_quietly

LIB = "libfake.so"


def _fake_build(payload: bytes = b"\x7fELF" + b"x" * 4000) -> Any:
    calls: list[Path] = []

    def build(directory: Path) -> Path:
        calls.append(directory)
        (directory / "part.o").write_bytes(b"object")
        (directory / LIB).write_bytes(payload)
        return directory / LIB

    build.calls = calls  # type: ignore[attr-defined]
    return build


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> BuildCache:
    monkeypatch.setenv("OPMUX_CACHE_DIR", str(tmp_path / "cache"))
    return BuildCache("fake", LIB, "fake library")


def test_build_is_stamped_and_installed_once(cache: BuildCache, tmp_path: Path) -> None:
    build = _fake_build()
    path = cache.ensure("k1", build)
    assert path == tmp_path / "cache" / "fake" / "k1" / LIB
    stamp = json.loads((path.parent / STAMP).read_text())
    assert stamp["library"] == LIB and stamp["size"] == path.stat().st_size
    assert set(stamp["files"]) == {"part.o"}
    assert verify(path.parent, LIB) is None
    assert cache.ensure("k1", build) == path and len(build.calls) == 1 and cache.builds == 1
    # the build ran in a temporary folder that is gone; nothing else is left next to the entry
    assert sorted(p.name for p in path.parents[1].iterdir()) == ["k1", "k1.lock"]


@pytest.mark.parametrize("damage", ["truncated", "empty", "garbage", "no-stamp", "missing"])
def test_damaged_entry_is_rebuilt(cache: BuildCache, damage: str) -> None:
    path = cache.ensure("k", _fake_build())
    good = path.read_bytes()
    if damage == "truncated":
        path.write_bytes(good[:1000])
    elif damage == "empty":
        path.write_bytes(b"")
    elif damage == "garbage":
        path.write_bytes(bytes(reversed(good)))  # same size, other content
    elif damage == "no-stamp":
        (path.parent / STAMP).unlink()
    else:
        path.unlink()
    assert verify(path.parent, LIB) is not None
    build = _fake_build()
    assert cache.ensure("k", build) == path
    assert len(build.calls) == 1 and path.read_bytes() == good
    assert verify(path.parent, LIB) is None


def _sha_reads(monkeypatch: pytest.MonkeyPatch) -> list[Path]:
    reads: list[Path] = []
    real = build_cache.file_sha256

    def counted(path: Path) -> str:
        reads.append(path)
        return real(path)

    monkeypatch.setattr(build_cache, "file_sha256", counted)
    return reads


@pytest.mark.parametrize("damage", ["garbage", "truncated", "touched", "replaced"])
def test_the_checksum_is_read_once_until_the_library_changes(
        cache: BuildCache, monkeypatch: pytest.MonkeyPatch, damage: str) -> None:
    path = cache.ensure("k", _fake_build())
    good = path.read_bytes()
    reads = _sha_reads(monkeypatch)
    monkeypatch.setattr(build_cache, "SETTLED_NS", 2_000_000_000)
    assert verify(path.parent, LIB) is None and reads == [path]
    assert not (path.parents[1] / ".checked-k.json").exists()  # written a moment ago
    monkeypatch.setattr(build_cache, "SETTLED_NS", 0)
    assert verify(path.parent, LIB) is None and len(reads) == 2  # recorded now
    assert (path.parents[1] / ".checked-k.json").is_file()
    for _ in range(3):
        assert verify(path.parent, LIB) is None
    assert len(reads) == 2
    if damage == "garbage":
        path.write_bytes(bytes(reversed(good)))  # same size, other content
    elif damage == "truncated":
        with open(path, "r+b") as handle:
            handle.truncate(len(good) // 2)
    elif damage == "touched":  # the same bytes written again, the old mtime put back
        st = path.stat()
        path.write_bytes(good)
        os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    else:  # another file of the same size and content in its place
        path.with_name("new").write_bytes(good)
        path.with_name("new").replace(path)
    result = verify(path.parent, LIB)
    if damage in ("garbage", "truncated"):
        assert result is not None and ("sha256" in result or "bytes" in result)
        assert cache.ensure("k", _fake_build()) == path and path.read_bytes() == good
    else:
        assert result is None and len(reads) == 3  # read again, and sound
    assert verify(path.parent, LIB) is None


def test_a_damaged_check_record_only_costs_a_read(cache: BuildCache,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    path = cache.ensure("k", _fake_build())
    monkeypatch.setattr(build_cache, "SETTLED_NS", 0)
    assert verify(path.parent, LIB) is None
    record = path.parents[1] / ".checked-k.json"
    reads = _sha_reads(monkeypatch)
    for content in (b"\x00garbage", b"[]", b'{"a": 1}'):
        record.write_bytes(content)
        assert verify(path.parent, LIB) is None
    assert len(reads) == 3
    record.write_bytes(b"[]")
    path.write_bytes(b"\x7fELF" + b"y" * 4000)  # damaged, and the record says nothing
    assert "sha256" in str(verify(path.parent, LIB))


def test_intact_objects_are_salvaged_damaged_ones_not(cache: BuildCache) -> None:
    path = cache.ensure("k", _fake_build())
    path.write_bytes(b"")
    seen: list[set[str]] = []

    def build(directory: Path) -> Path:
        seen.append({p.name for p in directory.iterdir()})
        return _fake_build()(directory)  # type: ignore[no-any-return]

    cache.ensure("k", build)
    assert seen == [{"part.o"}]  # the checksum still matched: ninja may reuse it
    path.write_bytes(b"")
    (path.parent / "part.o").write_bytes(b"damaged")
    seen.clear()
    cache.ensure("k", build)
    assert seen == [set()]


def test_failed_build_leaves_nothing(cache: BuildCache, tmp_path: Path) -> None:
    def broken(directory: Path) -> Path:
        (directory / LIB).write_bytes(b"half a libr")
        raise opmux.BuildError("compiler said no")

    ok, message = cache.status(lambda: str(cache.ensure("k", broken)))
    assert (ok, message) == (False, "compiler said no")
    assert sorted(p.name for p in (tmp_path / "cache" / "fake").iterdir()) == ["k.lock"]
    # the status is cached for the process; the library never appeared
    assert cache.status(lambda: "unreachable") == (False, "compiler said no")


def test_a_build_that_writes_no_library_is_an_error(cache: BuildCache) -> None:
    with pytest.raises(opmux.BuildError, match="no library was written"):
        cache.ensure("k", lambda directory: directory / LIB)


def test_unwritable_cache_dir_is_a_reason(tmp_path: Path, monkeypatch: pytest.MonkeyPatch
                                          ) -> None:
    blocker = tmp_path / "not-a-folder"
    blocker.write_text("a file where the cache folder should be")
    monkeypatch.setenv("OPMUX_CACHE_DIR", str(blocker / "cache"))
    made = BuildCache("fake", LIB, "fake library")
    ok, message = made.status(lambda: str(made.ensure("k", _fake_build())))
    assert not ok
    assert "fake library: the build cache" in message and "is not writable" in message
    assert "set OPMUX_CACHE_DIR to a writable folder" in message


def test_hash_key_covers_names_contents_and_parts(tmp_path: Path) -> None:
    (tmp_path / "a.cpp").write_text("int a;")
    (tmp_path / "b.h").write_text("int b;")
    files = [tmp_path / "a.cpp", tmp_path / "b.h"]
    key = hash_key(tmp_path, files, ("torch 2", "c++"))
    assert len(key) == 16 and key == hash_key(tmp_path, reversed(files), ("torch 2", "c++"))
    assert key != hash_key(tmp_path, files, ("torch 3", "c++"))
    (tmp_path / "b.h").write_text("int b2;")
    assert key != hash_key(tmp_path, files, ("torch 2", "c++"))


def _tree(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[Path, list[Path]]:
    """Two sources, and keys remembered at once (not only for files settled for 2 s)."""
    monkeypatch.setattr(build_cache, "SETTLED_NS", 0)
    src = tmp_path / "src"
    src.mkdir()
    for name, text in (("a.cpp", "int a;"), ("b.h", "int b;")):
        (src / name).write_text(text)
    return src, sorted(src.iterdir())


def _counting_hash_key(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    calls: list[int] = []
    real = build_cache.hash_key

    def counting(*args: Any) -> str:
        calls.append(1)
        return real(*args)

    monkeypatch.setattr(build_cache, "hash_key", counting)
    return calls


def test_key_is_hash_key_and_read_back_while_nothing_changed(
        cache: BuildCache, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    src, files = _tree(tmp_path, monkeypatch)
    calls = _counting_hash_key(monkeypatch)
    key = cache.key(src, files, ("torch 2",))
    assert key == hash_key(src, files, ("torch 2",)) and len(calls) == 1
    assert cache.key(src, reversed(files), ["torch 2"]) == key
    assert cache.key(src, [str(f) for f in files], ("torch 2",)) == key and len(calls) == 1
    other = cache.key(src, files, ("torch 3",))  # another input: hashed, and remembered
    assert other == hash_key(src, files, ("torch 3",)) != key
    assert cache.key(src, files, ("torch 3",)) == other


@pytest.mark.parametrize("change", ["same-size-same-mtime", "added", "removed", "record"])
def test_key_follows_every_change_of_the_sources(cache: BuildCache, tmp_path: Path,
                                                 monkeypatch: pytest.MonkeyPatch,
                                                 change: str) -> None:
    src, files = _tree(tmp_path, monkeypatch)
    key = cache.key(src, files, ())
    (record,) = (tmp_path / "cache" / "fake").glob(".sources-*.json")
    if change == "same-size-same-mtime":  # only the ctime tells: the content is new
        st = files[0].stat()
        while files[0].stat().st_ctime_ns == st.st_ctime_ns:  # the next clock tick
            time.sleep(0.005)
            files[0].write_text("int z;")
            os.utime(files[0], ns=(st.st_atime_ns, st.st_mtime_ns))
        assert files[0].stat().st_mtime_ns == st.st_mtime_ns
    elif change == "added":
        files.append(src / "c.h")
        files[-1].write_text("int c;")
    elif change == "removed":
        files.pop()
    else:  # a damaged record is hashed again and rewritten
        record.write_text('{"key": "0000", "base"')
    calls = _counting_hash_key(monkeypatch)
    got = cache.key(src, files, ())
    assert got == hash_key(src, files, ()) and len(calls) == 1
    assert (got == key) == (change == "record")
    assert json.loads(record.read_text())["key"] == got


def test_a_key_is_remembered_only_once_the_files_settled(cache: BuildCache, tmp_path: Path,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    src, files = _tree(tmp_path, monkeypatch)
    monkeypatch.setattr(build_cache, "SETTLED_NS", 2_000_000_000)  # the real window
    calls = _counting_hash_key(monkeypatch)
    assert cache.key(src, files, ()) == cache.key(src, files, ()) and len(calls) == 2
    assert not list((tmp_path / "cache" / "fake").glob(".sources-*.json"))
    monkeypatch.setattr(time, "time_ns", lambda: files[0].stat().st_ctime_ns + 3_000_000_000)
    cache.key(src, files, ())
    assert cache.key(src, files, ()) == hash_key(src, files, ()) and len(calls) == 3


def test_key_without_a_writable_cache_hashes_every_time(tmp_path: Path,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    blocker = tmp_path / "not-a-folder"
    blocker.write_text("")
    monkeypatch.setenv("OPMUX_CACHE_DIR", str(blocker / "cache"))
    made = BuildCache("fake", LIB, "fake library")
    src, files = _tree(tmp_path, monkeypatch)
    calls = _counting_hash_key(monkeypatch)
    assert made.key(src, files, ()) == made.key(src, files, ()) == hash_key(src, files, ())
    assert len(calls) == 2

_RACE = textwrap.dedent("""
    import sys, time
    from pathlib import Path
    from opmux.plugins.build_cache import BuildCache
    cache = BuildCache("fake", "libfake.so", "fake library")
    def build(directory):
        time.sleep(1.0)  # long enough for the other process to arrive meanwhile
        (directory / "libfake.so").write_bytes(b"library")
        return directory / "libfake.so"
    Path(sys.argv[1]).touch()
    while len(list(Path(sys.argv[1]).parent.glob("ready-*"))) < 2:
        time.sleep(0.01)
    print(cache.ensure("k", build), cache.builds)
""")


def test_two_processes_fake_build_once(tmp_path: Path) -> None:
    env = {**os.environ, "OPMUX_CACHE_DIR": str(tmp_path / "cache")}
    procs = [subprocess.Popen([sys.executable, "-c", _RACE, str(tmp_path / f"ready-{i}")],
                              env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True) for i in range(2)]
    outs = [p.communicate(timeout=120) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], [err for _, err in outs]
    paths, builds = zip(*(out.split() for out, _ in outs), strict=True)
    assert len(set(paths)) == 1 and sorted(builds) == ["0", "1"]


# ----------------------------------------------------------------- the real CPU kernels
_PROBE = textwrap.dedent("""
    import json, sys
    import opmux
    from opmux.plugins.cpu import build
    from opmux.testing import check_provider
    opmux.load_plugins()
    ok, message = build.build_status()
    checks = {}
    if ok:
        for name in ("rms_norm", "silu_and_mul", "rotary_embedding", "paged_attention"):
            report = check_provider(name, "cpp")
            checks[name] = [report.ok, report.format() if not report.ok else ""]
    impl = opmux.get_op("rms_norm").impls["cpp"]
    print(json.dumps({"ok": ok, "message": message, "builds": build.CACHE.builds,
                      "supported": impl.supported, "reason": impl.reason, "checks": checks}))
""")


@pytest.fixture(scope="module")
def good_entry() -> Path:
    from opmux.plugins.cpu import build

    ok, message = build.build_status()
    assert ok, message
    return build.build_dir()


def _copy_entry(good: Path, root: Path) -> Path:
    entry = root / "cpu" / good.name
    shutil.copytree(good, entry, symlinks=True)
    return entry


def _probe(cache_root: Path) -> dict[str, Any]:
    proc = subprocess.run([sys.executable, "-c", _PROBE],
                          env={**os.environ, "OPMUX_CACHE_DIR": str(cache_root)},
                          capture_output=True, text=True, timeout=600, check=False)
    # a negative return code is a signal: -7 is the SIGBUS of a mapped truncated library
    assert proc.returncode == 0, f"rc {proc.returncode}: {proc.stderr[-3000:]}"
    return json.loads(proc.stdout.strip().splitlines()[-1])  # type: ignore[no-any-return]


@pytest.mark.parametrize("damage", ["truncated-4k", "truncated-450k", "empty", "garbage"])
def test_damaged_cpu_library_is_rebuilt_and_ops_are_correct(good_entry: Path, tmp_path: Path,
                                                            damage: str) -> None:
    entry = _copy_entry(good_entry, tmp_path)
    library = entry / "opmux_cpu_kernels.so"
    good = library.read_bytes()
    if damage.startswith("truncated"):
        library.write_bytes(good[: {"truncated-4k": 4096, "truncated-450k": 450_000}[damage]])
    elif damage == "empty":
        library.write_bytes(b"")
    else:
        library.write_bytes(os.urandom(len(good)))
    result = _probe(tmp_path)
    assert result["ok"], result["message"]
    assert result["message"] == f"loaded {library}" and result["builds"] == 1
    assert result["supported"] and result["reason"] is None
    assert result["checks"] and all(ok for ok, _ in result["checks"].values()), result["checks"]
    assert verify(entry, library.name) is None
    # the next process verifies and loads: no second build
    assert _probe(tmp_path)["builds"] == 0


def test_unwritable_cache_dir_leaves_cpp_unsupported_with_reason(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("")
    result = _probe(blocker / "cache")
    assert not result["ok"] and not result["supported"]
    assert "is not writable" in result["reason"] and "OPMUX_CACHE_DIR" in result["reason"]


_BUILD_NOW = textwrap.dedent("""
    import sys, time
    from pathlib import Path
    from opmux.plugins.cpu import build
    Path(sys.argv[1]).touch()
    while len(list(Path(sys.argv[1]).parent.glob("ready-*"))) < 2:
        time.sleep(0.01)
    ok, message = build.build_status()
    print(ok, build.CACHE.builds, message)
""")


def _race(cache_root: Path, flags: Path) -> list[list[str]]:
    env = {**os.environ, "OPMUX_CACHE_DIR": str(cache_root)}
    procs = [subprocess.Popen([sys.executable, "-c", _BUILD_NOW, str(flags / f"ready-{i}")],
                              env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True) for i in range(2)]
    outs = [p.communicate(timeout=900) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], [err[-2000:] for _, err in outs]
    return [out.split() for out, _ in outs]


def test_two_processes_rebuild_a_damaged_entry_once(good_entry: Path, tmp_path: Path) -> None:
    entry = _copy_entry(good_entry, tmp_path / "cache")
    (entry / "opmux_cpu_kernels.so").write_bytes(b"")
    results = _race(tmp_path / "cache", tmp_path)
    assert [r[0] for r in results] == ["True", "True"]
    assert sorted(r[1] for r in results) == ["0", "1"]
    assert results[0][2:] == results[1][2:] == ["loaded", str(entry / "opmux_cpu_kernels.so")]


@pytest.mark.slow
def test_two_processes_build_from_an_empty_cache_once(good_entry: Path, tmp_path: Path) -> None:
    results = _race(tmp_path / "cache", tmp_path)
    assert [r[0] for r in results] == ["True", "True"]
    assert sorted(r[1] for r in results) == ["0", "1"]
    library = tmp_path / "cache" / "cpu" / good_entry.name / "opmux_cpu_kernels.so"
    assert verify(library.parent, library.name) is None


@pytest.mark.parametrize("stamp", [
    b"[" * 200_000 + b"]" * 200_000,  # nested too deep
    b"[1, 2]",
    b"{\"library\": \"libfake.so\", \"size\": \"4004\", \"sha256\": \"x\"}",
    b"{\"library\": \"libfake.so\", \"size\": 4004, \"sha256\": \"x\", "
    b"\"files\": {\"../../escape\": \"x\"}}",
    b" " * (2 << 20),  # too large
    b"\xff\xfe",
])
def test_a_hostile_stamp_is_ignored_with_one_warning_and_the_entry_rebuilt(
        cache: BuildCache, stamp: bytes) -> None:
    path = cache.ensure("k", _fake_build())
    good = path.read_bytes()
    (path.parent / STAMP).write_bytes(stamp)
    with pytest.warns(RuntimeWarning, match=r"ignoring the build stamp .*\.opmux-stamp\.json: "
                                            r".*; the entry is rebuilt") as record:
        assert verify(path.parent, LIB) is not None  # never an exception
        build = _fake_build()
        assert cache.ensure("k", build) == path
    assert len(record) == 1
    assert len(build.calls) == 1 and path.read_bytes() == good
    assert verify(path.parent, LIB) is None  # rebuilt: usable again, not off for good


def test_written_whole_with_its_folder(tmp_path: Path) -> None:
    path = tmp_path / "a" / "b" / "rec.json"
    assert write_quietly(path, b"one")
    assert write_quietly(path, b"two, longer")
    assert path.read_bytes() == b"two, longer"
    assert sorted(p.name for p in path.parent.iterdir()) == ["rec.json"]


def test_an_unwritable_place_is_false_and_leaves_nothing(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    assert not write_quietly(blocker / "rec.json", b"x")
    folder = tmp_path / "dir"
    (folder / "rec.json").mkdir(parents=True)  # a folder where the file should go
    assert not write_quietly(folder / "rec.json", b"x")
    assert sorted(p.name for p in folder.iterdir()) == ["rec.json"]  # no temporary file left


def test_threads_writing_at_once_leave_one_whole_content(tmp_path: Path) -> None:
    path = tmp_path / "rec.bin"
    contents = [bytes([i]) * 100_000 for i in range(8)]
    threads = [threading.Thread(target=write_quietly, args=(path, c)) for c in contents]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert path.read_bytes() in contents
    assert [p.name for p in tmp_path.iterdir()] == ["rec.bin"]
