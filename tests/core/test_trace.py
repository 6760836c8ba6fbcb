"""OPMUX_TRACE: per-process {op: {provider: calls}} files, and nothing at all when unset."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from opmux.core import trace

_ROOT = Path(__file__).resolve().parents[2]

# a child that runs rms_norm twice and silu_and_mul once, both on native
_CHILD = """
import torch, opmux
opmux.load_plugins()
x, w = torch.randn(4, 64), torch.ones(64)
with opmux.ops.silu_and_mul.set_priority(["native"]):
    opmux.ops.silu_and_mul(torch.randn(3, 8))
with opmux.ops.rms_norm.set_priority(["native"]):
    opmux.ops.rms_norm(x, w)
    opmux.ops.rms_norm(x, w)
print("pid", __import__("os").getpid())
"""


def _run(env_trace: str | None, tmp_path: Path, code: str = _CHILD) -> int:
    env = dict(os.environ)
    env.pop("OPMUX_TRACE", None)
    if env_trace is not None:
        env["OPMUX_TRACE"] = env_trace
    env["PYTHONPATH"] = os.pathsep.join([str(_ROOT), env.get("PYTHONPATH", "")])
    env["OPMUX_PLUGINS"] = "example_vendor"  # no C++ build needed in the child
    out = subprocess.run([sys.executable, "-c", code], env=env, cwd=tmp_path, check=True,
                         capture_output=True, text=True, timeout=300).stdout
    return int(out.split("pid")[-1].strip())


def test_trace_file_per_process_with_pid(tmp_path: Path) -> None:
    pid = _run(str(tmp_path / "t-{pid}.json"), tmp_path)
    data = json.loads((tmp_path / f"t-{pid}.json").read_text())
    assert data == {"rms_norm": {"native": 2}, "silu_and_mul": {"native": 1}}


def test_trace_without_pid_merges_processes(tmp_path: Path) -> None:
    target = tmp_path / "sub" / "trace.json"
    _run(str(target), tmp_path)
    _run(str(target), tmp_path)
    assert json.loads(target.read_text()) == {"rms_norm": {"native": 4},
                                              "silu_and_mul": {"native": 2}}


def test_trace_unset_writes_nothing(tmp_path: Path) -> None:
    _run(None, tmp_path)
    assert list(tmp_path.iterdir()) == []


def test_zero_cost_when_unset(monkeypatch: pytest.MonkeyPatch, fresh_plugins: None) -> None:
    # the selection chains hold the providers' own functions: no wrapper on the hot path
    monkeypatch.delenv("OPMUX_TRACE", raising=False)
    import opmux

    fn = lambda x: x  # noqa: E731
    assert trace.wrap("opmux::rms_norm", "native", fn) is fn
    opmux.load_plugins()
    op = opmux.ops.rms_norm
    for holder in op.priorities.chains.values():
        assert all(f is impl.fn for f, impl in zip(holder.fns, holder.chain, strict=True))
    assert trace.trace_file() is None and trace.flush() is None


def test_wrap_counts_and_keys(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("OPMUX_TRACE", str(tmp_path / "x-{pid}.json"))
    trace.zero_counts()
    counted = trace.wrap("mylib::my_op", "fast", lambda a: a + 1)
    assert counted(1) == 2 and counted(2) == 3
    assert trace.counts()["mylib::my_op"] == {"fast": 2}
    assert trace.trace_file(pid=7) == str(tmp_path / "x-7.json")
    written = trace.flush()
    assert written is not None
    assert json.loads(Path(written).read_text())["mylib::my_op"] == {"fast": 2}
    trace.zero_counts()
    assert "mylib::my_op" not in trace.counts()


@pytest.mark.parametrize("then", ["exit", "kill"])
def test_worker_flush_survives_kill_and_is_not_counted_twice(tmp_path: Path, then: str) -> None:
    # vLLM kills a worker that has not exited 5 s after its SIGTERM: the counts written on
    # request (collective_rpc("opmux_trace_flush")) must hold whether or not exit hooks run
    target = tmp_path / "trace.json"
    ending = ("import signal; os.kill(os.getpid(), signal.SIGKILL)" if then == "kill"
              else "pass")
    code = _CHILD + f"""
import os
from opmux.integrations.vllm import WorkerExtension
ext = WorkerExtension()
assert ext.opmux_trace_counts() == {{"rms_norm": {{"native": 2}}, "silu_and_mul": {{"native": 1}}}}
assert ext.opmux_trace_flush() == {str(target)!r}
assert ext.opmux_trace_flush() == {str(target)!r}  # nothing new: nothing added
{ending}
"""
    if then == "kill":
        with pytest.raises(subprocess.CalledProcessError) as info:
            _run(str(target), tmp_path, code)
        assert info.value.returncode == -9
    else:
        _run(str(target), tmp_path, code)
    assert json.loads(target.read_text()) == {"rms_norm": {"native": 2},
                                              "silu_and_mul": {"native": 1}}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["trace.json", "trace.json.lock"]


@pytest.mark.parametrize("damage", [b"{\"rms_norm\": {\"cpp\": 3", b"[1, 2]", b"\xff\xfe\x00",
                                    b"{\"rms_norm\": {\"cpp\": \"3\"}}",
                                    b"{\"rms_norm\": {\"cpp\": -3}}",
                                    b"{\"rms_norm\": {\"cpp\": true}}",
                                    b"{\"rms_norm\": {\"cpp\": 1.5}}",
                                    b"[" * 200_000 + b"]" * 200_000,
                                    b" " * (5 << 20)])
def test_shared_file_that_holds_no_trace_is_replaced_with_a_warning(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path, damage: bytes) -> None:
    target = tmp_path / "trace.json"
    target.write_bytes(damage)
    monkeypatch.setenv("OPMUX_TRACE", str(target))
    trace.zero_counts()
    counted = trace.wrap("mylib::my_op", "fast", lambda a: a)
    counted(1)
    with pytest.warns(RuntimeWarning, match=r"OPMUX_TRACE file .*trace\.json: .* holds no trace"):
        assert trace.flush() == str(target)
    assert json.loads(target.read_text()) == {"mylib::my_op": {"fast": 1}}
    trace.flush()  # a good file now: merged into without a word (filterwarnings = error)
    counted(2)
    trace.flush()
    assert json.loads(target.read_text()) == {"mylib::my_op": {"fast": 2}}
    trace.zero_counts()


def test_a_failed_trace_write_goes_to_stderr_and_json_stdout_stays_json(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("")  # a file where the trace's folder should be
    env = {**os.environ, "OPMUX_TRACE": str(tmp_path / "file" / "t.json"),
           "OPMUX_PLUGINS": "example_vendor",
           "PYTHONPATH": os.pathsep.join([str(_ROOT), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, "-m", "opmux.cli", "explain", "rms_norm",
                           "--shape", "4,8", "--shape", "8", "--json"], env=env,
                          cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    json.loads(proc.stdout)
    assert proc.stderr.count("could not write the OPMUX_TRACE file") == 1


def test_trace_path_expands_the_home_folder(tmp_path: Path,
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "home").mkdir()
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    pid = _run("~/t-{pid}.json", tmp_path)
    assert (tmp_path / "home" / f"t-{pid}.json").is_file()
    assert not (tmp_path / "~").exists()
