"""``opmux tune`` and the tuned priority layer: file, fingerprint, loading, layering, buckets."""

from __future__ import annotations

import contextlib
import io
import json
from pathlib import Path
from typing import Any

import pytest
import torch
from fake_plugins import FakePlugins

import opmux
from opmux.cli import main
from opmux.cli.info import info_data
from opmux.core import tuned
from opmux.testing import reset_for_tests

OP = "opmux::silu_and_mul"


def _register(registry: opmux.OpRegistry, platform: opmux.Platform) -> None:
    op = registry.get_op("silu_and_mul")
    native = op.native

    # marks its output (+10) so a test sees which provider ran
    def plus(x: torch.Tensor) -> torch.Tensor:
        return native(x) + 10

    op.register_impl("plus", dispatch_key="CPU")(plus)


@pytest.fixture
def tuned_env(fake: FakePlugins, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> FakePlugins:
    """A fake plugin giving silu_and_mul a provider ``plus``; tuned tables under tmp_path."""
    monkeypatch.setenv("OPMUX_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("OPMUX_TUNED", "1")
    fake.add("tunable", register=_register)
    return fake


def _cli(*argv: str) -> tuple[int, str]:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        status = main(list(argv))
    return status, out.getvalue()


def _write(data: dict[str, Any], name: str | None = None) -> Path:
    """A tuned file for the current fingerprint (or named ``name``)."""
    opmux.load_plugins()
    fp = tuned.fingerprint(opmux.global_registry(), opmux.current_platform())
    path = tuned.tuned_path("cpu", tuned.fingerprint_id(fp)) if name is None \
        else tuned.tuned_dir() / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"format": tuned.FORMAT, "platform": "cpu", "fingerprint": fp,
                                **data}), encoding="utf-8")
    reset_for_tests()  # the next use starts up again and reads the file
    return path


def test_tune_times_writes_and_the_next_start_up_loads_it(tuned_env: FakePlugins) -> None:
    status, out = _cli("tune", "--ops", "silu_and_mul", "--repeat", "1", "--json",
                       "--shape", "silu_and_mul=2x8")
    assert status == 0
    data = json.loads(out)
    path = Path(data["path"])
    assert data["written"] and path.is_file()
    assert path.name == f"cpu-{data['fingerprint_id']}.json"
    assert json.loads(path.read_text())["ops"] == data["ops"]
    entry = data["ops"][OP]
    assert set(entry["order"]) == {"plus", "native"}
    assert "5" in entry["buckets"]  # the user's 2x8 input: numel 16 has bit length 5
    for bucket in entry["buckets"].values():
        assert set(bucket["order"]) == {"plus", "native"} and bucket["cases"] >= 1
        assert set(bucket["ms"]) == {"plus", "native"}
        assert bucket["speedup_vs_native"]["native"] == pytest.approx(1.0)
        assert all(v > 0 for v in bucket["ms"].values())
    reset_for_tests()
    opmux.load_plugins()
    op = opmux.get_op("silu_and_mul")
    assert op.priority_source() == "tuned"
    assert op.priority() == entry["order"]
    status_now = tuned.tuned_status()
    assert (status_now.state, status_now.path, status_now.ops) == ("loaded", str(path), 1)


def test_dry_run_writes_nothing_and_clear_removes(tuned_env: FakePlugins) -> None:
    status, out = _cli("tune", "--ops", "silu_and_mul", "--repeat", "1", "--dry-run")
    assert status == 0 and "would write" in out and "opmux::silu_and_mul" in out
    assert not tuned.tuned_dir().exists()
    _write({"ops": {}})
    _write({"ops": {}}, name="cpu-0000000000000000.json")
    assert _cli("tune", "--clear")[0] == 0
    assert list(tuned.tuned_dir().iterdir()) == []


def test_clear_dry_run_deletes_nothing_and_clear_json_is_json(tuned_env: FakePlugins) -> None:
    first = _write({"ops": {}})
    second = _write({"ops": {}}, name="cpu-0000000000000000.json")
    status, out = _cli("tune", "--clear", "--dry-run")
    assert status == 0 and out.startswith("would remove 2 tuned table(s)")
    assert first.exists() and second.exists()
    status, out = _cli("tune", "--clear", "--dry-run", "--json")
    data = json.loads(out)
    assert status == 0 and data["removed"] is False and data["platform"] == "cpu"
    assert sorted(data["tables"]) == sorted([str(first), str(second)])
    assert first.exists() and second.exists()
    status, out = _cli("tune", "--clear", "--json")
    assert status == 0 and json.loads(out)["removed"] is True
    assert not first.exists() and not second.exists()


@pytest.mark.parametrize(("device", "message"), [
    ("meta", "meta tensors hold no values"),
    ("nonsense", "--device 'nonsense' is not a torch device"),
    pytest.param("cuda", "no cuda device here", marks=pytest.mark.skipif(
        torch.cuda.is_available(), reason="a CUDA device is here")),
])
def test_tune_refuses_a_device_the_platform_does_not_run(
        tuned_env: FakePlugins, device: str, message: str,
        capsys: pytest.CaptureFixture[str]) -> None:
    status, out = _cli("tune", "--ops", "silu_and_mul", "--repeat", "1", "--device", device)
    err = capsys.readouterr().err
    assert status == 2 and out == "" and message in err and err.count("\n") == 1
    assert not tuned.tuned_dir().exists()  # nothing written, not even the folder


def test_tune_device_must_be_the_platforms(tuned_env: FakePlugins,
                                           monkeypatch: pytest.MonkeyPatch,
                                           capsys: pytest.CaptureFixture[str]) -> None:
    # a device that exists here but is not the platform's: its table would be the wrong one
    from opmux.cli import tune

    monkeypatch.setattr(tune, "run_device", lambda text, command, meta=False: text)
    status, _ = _cli("tune", "--ops", "silu_and_mul", "--repeat", "1", "--device", "cuda")
    err = capsys.readouterr().err
    assert status == 2 and "the tuned table is for platform 'cpu', which runs on 'cpu'" in err
    assert not tuned.tuned_dir().exists()


def test_tuned_sits_between_plugins_and_opmux_priority(tuned_env: FakePlugins,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    opmux.load_plugins()
    assert opmux.get_op("silu_and_mul").priority_source() == "registration order"
    _write({"ops": {OP: {"order": ["native", "plus"]}}})
    opmux.load_plugins()
    op = opmux.get_op("silu_and_mul")
    x = torch.randn(4, 8)
    assert op.priority() == ["native", "plus"] and op.priority_source() == "tuned"
    assert torch.equal(op(x), op.native(x))  # native first: plus never runs
    op.set_default_priority(["plus"])
    assert op.priority_source() == "code" and torch.equal(op(x), op.native(x) + 10)
    monkeypatch.setenv("OPMUX_PRIORITY", "silu_and_mul=plus,native")
    reset_for_tests()
    opmux.load_plugins()
    assert op.priority_source() == "env" and op.priority() == ["plus", "native"]
    monkeypatch.setenv("OPMUX_TUNED", "0")
    monkeypatch.delenv("OPMUX_PRIORITY")
    reset_for_tests()
    opmux.load_plugins()
    assert op.priority_source() == "registration order"
    assert tuned.tuned_status().state == "disabled"


def test_plugin_default_yields_to_tuned(tuned_env: FakePlugins) -> None:
    tuned_env.add("prefers", extra={"opmux_default_priority": opmux.hookimpl(
        lambda op_name, platform: ["plus", "native"] if op_name == "silu_and_mul" else None)})
    opmux.load_plugins()
    op = opmux.get_op("silu_and_mul")
    assert op.priority_source() == "plugins"
    _write({"ops": {OP: {"order": ["native", "plus"]}}})
    opmux.load_plugins()
    assert op.priority_source() == "tuned" and op.priority() == ["native", "plus"]


@pytest.mark.parametrize("wrap", [True, False])
def test_size_buckets_pick_the_provider_per_call(tuned_env: FakePlugins, wrap: bool) -> None:
    # bit length 7 (numel 64..127) prefers plus; 11 (1024..2047) prefers native; the rest
    # take the nearest measured bucket
    _write({"ops": {OP: {"order": ["plus", "native"], "buckets": {
        "7": {"order": ["plus", "native"]}, "11": {"order": ["native", "plus"]}}}}})
    op = opmux.get_op("silu_and_mul")
    small, large, huge = torch.randn(8, 8), torch.randn(32, 32), torch.randn(64, 256)
    with opmux.enable_torch_wrap(wrap):
        assert torch.equal(op(small), op.native(small) + 10)
        assert torch.equal(op(large), op.native(large))
        assert torch.equal(op(huge), op.native(huge))
    assert op.dispatch(small).provider == "plus" and op.dispatch(large).provider == "native"
    assert "runs 'native'" in op.explain(large) and "runs 'plus'" in op.explain(small)
    with op.set_priority(["plus", "native"]):  # a scope replaces the tuned buckets
        assert torch.equal(op(large), op.native(large) + 10)
    assert torch.equal(op(large), op.native(large))


def test_nearest_buckets_fill_every_size() -> None:
    filled = tuned.nearest_buckets({3: ["a"], 10: ["b"]})
    assert len(filled) == 64
    assert filled[0] == filled[3] == filled[6] == ["a"]  # 6 is nearer to 3 than to 10
    assert filled[7] == filled[10] == filled[63] == ["b"]
    assert tuned.nearest_buckets({2: ["a"], 4: ["b"]})[3] == ["a"]  # a tie takes the lower


@pytest.mark.parametrize(("content", "why"), [
    ("{not json", "cannot read it"),
    (json.dumps({"format": 99, "ops": {}}), "format 99"),
    (None, "unknown provider"),
    (json.dumps([1, 2]), "not an object"),
    ("FINGERPRINT_STR", "'fingerprint' is not an object"),
    ("FINGERPRINT_LIST", "'fingerprint' is not an object"),
    ("BUCKET_SUPERSCRIPT", "bucket '²' is not"),
    ("[" * 200_000 + "]" * 200_000, "nested too deep"),
    (" " * (5 << 20), "larger than"),
    ("\udcff", "not JSON"),
])
def test_damaged_table_is_reported_and_ignored(tuned_env: FakePlugins, content: str | None,
                                               why: str) -> None:
    path = _write({"ops": {OP: {"order": ["fastest", "native"]}}})
    if content is not None and content.isupper():  # a valid file with one field damaged
        data = json.loads(path.read_text())
        data["ops"] = {OP: {"order": ["native"]}}
        if content == "FINGERPRINT_STR":
            data["fingerprint"] = "x"
        elif content == "FINGERPRINT_LIST":
            data["fingerprint"] = [1]
        else:
            data["ops"][OP]["buckets"] = {"²": {"order": ["native"]}}
        path.write_text(json.dumps(data), encoding="utf-8")
    elif content == "\udcff":
        path.write_bytes(b"\xff\xfe{")
    elif content is not None:
        path.write_text(content, encoding="utf-8")
    with pytest.warns(RuntimeWarning, match=r"ignoring the tuned table .*\.json: ") as record:
        opmux.load_plugins()  # never fatal
    assert len(record) == 1
    status = tuned.tuned_status()
    assert status.state == "damaged" and why in status.reason and status.path == str(path)
    assert opmux.get_op("silu_and_mul").priority_source() == "registration order"
    opmux.ops.silu_and_mul(torch.randn(2, 8))  # every op call still works


def test_stale_table_is_reported_and_ignored(tuned_env: FakePlugins) -> None:
    path = _write({"ops": {OP: {"order": ["native"]}}}, name="cpu-0123456789abcdef.json")
    data = json.loads(path.read_text())
    data["fingerprint"]["torch"] = "1.0"
    path.write_text(json.dumps(data), encoding="utf-8")
    opmux.load_plugins()
    status = tuned.tuned_status()
    assert status.state == "stale" and "changed: torch" in status.reason
    assert opmux.get_op("silu_and_mul").priority_source() == "registration order"


def test_fingerprint_changes_with_the_provider_set(tuned_env: FakePlugins) -> None:
    opmux.load_plugins()
    registry, platform = opmux.global_registry(), opmux.current_platform()
    before = tuned.fingerprint(registry, platform)
    assert {"cpu", "torch", "opmux", "threads", "providers", "platform"} <= set(before)
    opmux.get_op("silu_and_mul").unregister_impl("plus")
    after = tuned.fingerprint(registry, platform)
    assert before["providers"] != after["providers"]
    assert tuned.fingerprint_id(before) != tuned.fingerprint_id(after)


def test_malformed_switch_is_a_config_error(tuned_env: FakePlugins,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OPMUX_TUNED", "maybe")
    with pytest.raises(opmux.ConfigError, match="OPMUX_TUNED='maybe'"):
        opmux.load_plugins()


def test_info_shows_the_layer_and_its_source(tuned_env: FakePlugins) -> None:
    path = _write({"ops": {OP: {"order": ["plus", "native"]}}})
    data = info_data()
    assert data["tuned"]["state"] == "loaded" and data["tuned"]["path"] == str(path)
    row = next(o for o in data["ops"] if o["op"] == OP)
    assert row["priority_source"] == "tuned" and row["priority"] == ["plus", "native"]
    status, out = _cli("info")
    assert status == 0
    assert f"tuned priority layer (between plugins and OPMUX_PRIORITY): loaded, {path}" in out


def test_reset_forgets_the_tuned_layer(tuned_env: FakePlugins) -> None:
    _write({"ops": {OP: {"order": ["native", "plus"], "buckets": {
        "3": {"order": ["plus"]}, "9": {"order": ["native"]}}}}})
    opmux.load_plugins()
    op = opmux.get_op("silu_and_mul")
    assert op.priorities.layer("tuned") is not None
    reset_for_tests()
    assert tuned.tuned_status().state == "none"
    assert op.priorities.layer("tuned") is None and op.priority_source() != "tuned"
