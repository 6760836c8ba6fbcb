"""Plugin entry points are remembered between processes, and what changes them is seen."""

from __future__ import annotations

import importlib.metadata
import json
import os
import shutil
import sys
import time
from pathlib import Path

import pytest

from opmux.core import _entry_points, plugins
from opmux.core._dist import dist_label

GROUP = "opmux_test_entry_points"


@pytest.fixture
def site(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    folder = tmp_path / "site"
    folder.mkdir()
    monkeypatch.syspath_prepend(str(folder))
    return folder


@pytest.fixture(autouse=True)
def _settled_at_once(monkeypatch: pytest.MonkeyPatch) -> None:
    # the tests install and write within milliseconds; the real window has its own test
    monkeypatch.setattr(_entry_points, "_SETTLED_NS", 0)


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, site: Path) -> Path:
    monkeypatch.setenv("OPMUX_CACHE_DIR", str(tmp_path / "cache"))
    return _entry_points._file(GROUP)


def _install(site: Path, dist: str, entries: dict[str, str]) -> Path:
    info = site / f"{dist}-1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: 1.0\n")
    lines = "".join(f"{name} = {value}\n" for name, value in entries.items())
    (info / "entry_points.txt").write_text(f"[{GROUP}]\n{lines}")
    return info


def _seen(eps: list[importlib.metadata.EntryPoint]) -> list[tuple[str, str, str]]:
    return [(ep.name, ep.value, dist_label(ep.dist)) for ep in eps]


def _scan_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(**_: object) -> None:
        raise AssertionError("the installed metadata was read again")

    monkeypatch.setattr(importlib.metadata, "entry_points", refuse)


def test_the_second_start_reads_the_file(cache: Path, site: Path,
                                         monkeypatch: pytest.MonkeyPatch) -> None:
    _install(site, "beta_pkg", {"zeta": "beta_pkg.plugin", "alpha": "beta_pkg.other"})
    first = _entry_points.entry_points(GROUP)
    assert _seen(first) == [("alpha", "beta_pkg.other", "beta_pkg 1.0"),
                            ("zeta", "beta_pkg.plugin", "beta_pkg 1.0")]
    assert cache.is_file()
    _scan_refused(monkeypatch)
    again = _entry_points.entry_points(GROUP)
    assert _seen(again) == _seen(first)
    assert [ep.group for ep in again] == [GROUP, GROUP]


def test_the_plugins_group_is_importlibs_answer(tmp_path: Path,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OPMUX_CACHE_DIR", str(tmp_path))
    want = _seen(sorted(importlib.metadata.entry_points(group=plugins.PLUGIN_GROUP),
                        key=lambda e: e.name))
    assert {"cpu", "cuda", "xla", "ascend"} <= {name for name, _, _ in want}
    assert _seen(plugins._entry_points()) == want
    _scan_refused(monkeypatch)
    assert _seen(plugins._entry_points()) == want


def test_install_edit_and_uninstall_are_seen(cache: Path, site: Path) -> None:
    assert _entry_points.entry_points(GROUP) == []
    info = _install(site, "one_pkg", {"one": "one_pkg.plugin"})
    assert _seen(_entry_points.entry_points(GROUP)) == [("one", "one_pkg.plugin", "one_pkg 1.0")]
    # an edit in place of the installed entry_points.txt (the folder does not change)
    txt = info / "entry_points.txt"
    txt.write_text(f"[{GROUP}]\none = one_pkg.moved\n")
    st = txt.stat()
    os.utime(txt, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    assert [ep.value for ep in _entry_points.entry_points(GROUP)] == ["one_pkg.moved"]
    _install(site, "two_pkg", {"two": "two_pkg.plugin"})
    assert [ep.name for ep in _entry_points.entry_points(GROUP)] == ["one", "two"]
    shutil.rmtree(info)
    assert [ep.name for ep in _entry_points.entry_points(GROUP)] == ["two"]


@pytest.mark.parametrize("content", [
    b"\x00not json", b"[]", b'{"version": 2}', b'{"version": 99, "stamp": [], "entries": []}',
    "stamp", "entries",
])
def test_a_damaged_file_is_read_as_a_miss_and_rewritten(cache: Path, site: Path,
                                                        content: bytes | str) -> None:
    _install(site, "dmg_pkg", {"dmg": "dmg_pkg.plugin"})
    want = _seen(_entry_points.entry_points(GROUP))
    data = json.loads(cache.read_text())
    if content == "stamp":  # the right shape, another installation
        data["stamp"][0] = ["/elsewhere"]
        cache.write_text(json.dumps(data))
    elif content == "entries":  # an entry whose distribution folder is gone
        data["entries"][0][2] = str(site / "gone-1.0.dist-info")
        cache.write_text(json.dumps(data))
    else:
        assert isinstance(content, bytes)
        cache.write_bytes(content)
    assert _seen(_entry_points.entry_points(GROUP)) == want
    assert json.loads(cache.read_text())["version"] == _entry_points._VERSION  # rewritten


def test_an_unwritable_cache_folder_costs_only_the_scan(tmp_path: Path, site: Path,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    blocker = tmp_path / "a_file"
    blocker.write_text("not a folder")
    monkeypatch.setenv("OPMUX_CACHE_DIR", str(blocker))
    _install(site, "ro_pkg", {"ro": "ro_pkg.plugin"})
    for _ in range(2):
        assert _seen(_entry_points.entry_points(GROUP)) == [("ro", "ro_pkg.plugin", "ro_pkg 1.0")]
    assert not [p for p in tmp_path.rglob("*") if p.name.startswith(f".{GROUP}")]


def test_each_environment_keeps_its_own_file(cache: Path, monkeypatch: pytest.MonkeyPatch,
                                             tmp_path: Path) -> None:
    _entry_points.entry_points(GROUP)
    monkeypatch.syspath_prepend(str(tmp_path))
    other = _entry_points._file(GROUP)
    assert other != cache and other.parent == cache.parent
    _entry_points.entry_points(GROUP)
    assert cache.is_file() and other.is_file()


def test_no_home_folder_or_odd_sys_path_reads_the_metadata(site: Path,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    _install(site, "odd_pkg", {"odd": "odd_pkg.plugin"})
    want = [("odd", "odd_pkg.plugin", "odd_pkg 1.0")]

    def no_home() -> Path:
        raise RuntimeError("Could not determine home directory.")

    with monkeypatch.context() as mp:
        mp.setattr(_entry_points.config, "cache_dir", no_home)
        assert _seen(_entry_points.entry_points(GROUP)) == want
    monkeypatch.setenv("OPMUX_CACHE_DIR", str(site.parent / "cache"))
    monkeypatch.setattr(sys, "path", [Path(p) for p in sys.path])  # not strings
    assert _seen(_entry_points.entry_points(GROUP)) == want
    assert not (site.parent / "cache").exists()  # nothing was cached


def test_written_only_once_what_it_stands_for_settled(cache: Path, site: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_entry_points, "_SETTLED_NS", 2_000_000_000)  # the real window
    info = _install(site, "new_pkg", {"new": "new_pkg.plugin"})
    want = [("new", "new_pkg.plugin", "new_pkg 1.0")]
    assert _seen(_entry_points.entry_points(GROUP)) == want
    assert not cache.exists()  # installed a moment ago: a same-tick change would not show
    later = (info / "entry_points.txt").stat().st_ctime_ns + 3_000_000_000
    monkeypatch.setattr(time, "time_ns", lambda: later)
    assert _seen(_entry_points.entry_points(GROUP)) == want
    assert cache.is_file()
    _scan_refused(monkeypatch)
    assert _seen(_entry_points.entry_points(GROUP)) == want


def test_the_newest_files_are_kept(cache: Path, site: Path, tmp_path: Path,
                                   monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_entry_points, "_KEEP", 3)
    cache.parent.mkdir(parents=True)
    other = cache.parent / "other_group-0123456789abcdef.json"
    other.write_text("{}")
    for i in range(5):  # files of five other script folders, oldest first
        old = cache.parent / f"{GROUP}-{i:016x}.json"
        old.write_text("{}")
        os.utime(old, ns=(10**18 + i * 10**9, 10**18 + i * 10**9))
    _entry_points.entry_points(GROUP)
    kept = sorted(p.name for p in cache.parent.iterdir())
    assert kept == sorted([cache.name, f"{GROUP}-{4:016x}.json", f"{GROUP}-{3:016x}.json",
                           other.name])
