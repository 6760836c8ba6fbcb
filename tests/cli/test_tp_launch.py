"""The ``--tp`` launcher: its ranks never outlive it, whatever ends it."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from opmux.models.synthetic import LlamaShape, write_random_llama

_ROOT = Path(__file__).resolve().parents[2]
_SHAPE = LlamaShape(layers=2, hidden=64, heads=4, kv_heads=2, intermediate=96, vocab=96,
                    max_position=100_000)


def _children(pid: int) -> list[int]:
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            if int(stat.rpartition(")")[2].split()[1]) == pid:
                found.append(int(entry))
    return found


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0]
    except OSError:
        return False
    return state != "Z"  # a zombie runs nothing: only its exit status is left


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM, signal.SIGKILL])
def test_no_rank_survives_its_launcher(tmp_path: Path, signum: int) -> None:
    ckpt = write_random_llama(tmp_path / "ckpt", _SHAPE, seed=1)
    (tmp_path / "tmp").mkdir()
    env = {**os.environ, "TMPDIR": str(tmp_path / "tmp"), "OPMUX_PLUGINS": "example_vendor",
           "PYTHONPATH": os.pathsep.join([str(_ROOT), os.environ.get("PYTHONPATH", "")])}
    for var in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(var, None)
    with open(tmp_path / "err.txt", "w") as err_file:
        launcher = subprocess.Popen(
            [sys.executable, "-m", "opmux.cli", "generate", "--model", str(ckpt),
             "--prompt-ids", "1,2,3", "--max-tokens", "90000", "--ignore-eos", "--tp", "2",
             "--json"], env=env, stdout=subprocess.DEVNULL, stderr=err_file)
    err = lambda: (tmp_path / "err.txt").read_text()  # noqa: E731
    ranks: list[int] = []
    try:
        deadline = time.monotonic() + 120
        while len(ranks) < 2 and time.monotonic() < deadline and launcher.poll() is None:
            time.sleep(0.1)
            ranks = [p for p in _children(launcher.pid) if _alive(p)]
        assert len(ranks) == 2, err()
        time.sleep(1.0)  # the ranks import torch and meet in the rendezvous meanwhile
        assert all(_alive(p) for p in ranks)
        launcher.send_signal(signum)
        code = launcher.wait(timeout=30)
        deadline = time.monotonic() + 10
        while any(_alive(p) for p in ranks) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not [p for p in ranks if _alive(p)], "a rank outlived its launcher"
    finally:
        for p in {*ranks, *_children(launcher.pid), launcher.pid}:
            if _alive(p):
                os.kill(p, signal.SIGKILL)
        launcher.wait()
    if signum == signal.SIGKILL:
        assert code == -signal.SIGKILL
    else:  # stopped the ranks itself and said so
        assert code == 128 + signum
        assert f"stopped by signal {signal.Signals(signum).name}" in err()
        assert "Traceback" not in err()
    assert list((tmp_path / "tmp").iterdir()) == []  # the rank logs left nothing on disk


def test_a_leftover_torchrun_environment_is_named_not_waited_on(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    from opmux.cli import main

    ckpt = write_random_llama(tmp_path / "ckpt", _SHAPE, seed=1)
    for var, value in (("WORLD_SIZE", "2"), ("RANK", "0"), ("MASTER_ADDR", "127.0.0.1"),
                       ("MASTER_PORT", "29500")):
        monkeypatch.setenv(var, value)
    argv = ["generate", "--model", str(ckpt), "--prompt-ids", "1,2", "--max-tokens", "1"]
    assert main([*argv, "--tp", "1"]) == 2
    err = capsys.readouterr().err
    assert "WORLD_SIZE=2 RANK=0 MASTER_ADDR=127.0.0.1 MASTER_PORT=29500" in err
    assert "but --tp is 1; unset WORLD_SIZE" in err and err.count("\n") == 1


@pytest.mark.parametrize(("env", "message"), [
    ({"WORLD_SIZE": "2", "RANK": "2"}, "RANK=2 is not below WORLD_SIZE=2"),
    ({"WORLD_SIZE": "2", "RANK": "-1"}, "RANK='-1' in the environment is not an integer"),
    ({"WORLD_SIZE": "two", "RANK": "0"}, "WORLD_SIZE='two' in the environment"),
    ({"WORLD_SIZE": "1", "RANK": "0", "MASTER_PORT": "70000"}, "MASTER_PORT='70000'"),
])
def test_init_tensor_parallel_checks_the_environment_before_the_rendezvous(
        monkeypatch: pytest.MonkeyPatch, env: dict[str, str], message: str) -> None:
    import opmux.distributed as od

    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "29500")
    for var, value in env.items():
        monkeypatch.setenv(var, value)
    with pytest.raises(od.DistributedError, match=message):
        od.init_tensor_parallel()
    assert not od.is_initialized()
