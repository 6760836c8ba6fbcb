"""The caches' file writes: whole or not at all, and never an error."""

from __future__ import annotations

import threading
from pathlib import Path

from opmux.core._files import write_quietly


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
