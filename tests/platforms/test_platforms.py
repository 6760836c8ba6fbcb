"""Platform detection: one detector each, reasons kept, override, fallback."""

from __future__ import annotations

import pytest
import torch

import opmux
from opmux import platforms
from opmux.platforms import ascend, builtin


@pytest.fixture(autouse=True)
def _fresh(fresh_plugins: None) -> None:
    pass


def test_cpu_is_the_fallback_with_reasons() -> None:
    platform, found = platforms.resolve_platform()
    assert platform.name == "cpu" and platform.dispatch_key == "CPU"
    by_name = {d.name: d for d in found}
    assert set(by_name) >= {"cuda", "rocm", "xla", "ascend", "cpu"}
    assert all(d.reason for d in found)


def test_cuda_detector(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.version, "cuda", None)
    assert "not a CUDA build" in builtin.detect_cuda().reason
    monkeypatch.setattr(torch.version, "cuda", "12.8")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    det = builtin.detect_cuda()
    assert not det.claimed and "is_available() is False" in det.reason
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    det = builtin.detect_cuda()
    assert det.claimed and "2 device(s)" in det.reason
    platform, _ = platforms.resolve_platform()
    assert platform.name == "cuda" and platform.dispatch_key == "CUDA"


def test_rocm_detector(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.version, "hip", "6.2", raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    det = builtin.detect_rocm()
    assert det.claimed and "ROCm 6.2" in det.reason
    monkeypatch.setattr(torch.version, "cuda", None)
    platform, _ = platforms.resolve_platform()
    assert platform.name == "rocm" and platform.dispatch_key == "CUDA"


def test_xla_detector(monkeypatch: pytest.MonkeyPatch) -> None:
    real = builtin.importlib.util.find_spec
    monkeypatch.setattr(builtin.importlib.util, "find_spec",
                        lambda n: object() if n == "torch_xla" else real(n))
    monkeypatch.delenv("PJRT_DEVICE", raising=False)
    assert "PJRT_DEVICE is not set" in builtin.detect_xla().reason
    monkeypatch.setenv("PJRT_DEVICE", "CPU")
    det = builtin.detect_xla()
    assert det.claimed and "PJRT_DEVICE=CPU" in det.reason


def test_ascend_detector_reasons(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(ascend.importlib.util, "find_spec",
                        lambda n: object() if n == "mindspore" else None)
    monkeypatch.delenv("ASCEND_HOME_PATH", raising=False)
    monkeypatch.delenv("ASCEND_TOOLKIT_HOME", raising=False)
    det = ascend.detect_ascend()
    assert not det.claimed
    assert "torch_npu is not installed" in det.reason and "no CANN toolkit" in det.reason


def test_detector_exception_is_recorded(monkeypatch: pytest.MonkeyPatch) -> None:
    def boom() -> platforms.Detection:
        raise RuntimeError("driver exploded")

    monkeypatch.setitem(platforms.BUILTIN_DETECTORS, "cuda", boom)
    platform, found = platforms.resolve_platform()
    assert platform.name == "cpu"
    assert any("driver exploded" in d.reason for d in found)


def test_forced_platform_and_its_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OPMUX_PLATFORM", "xla")
    assert platforms.resolve_platform()[0].name == "xla"
    monkeypatch.setenv("OPMUX_PLATFORM", "tpu9000")
    with pytest.raises(opmux.PlatformError,
                       match=r"names no known platform; valid: \['ascend', 'cpu', 'cuda'"):
        platforms.resolve_platform()


def test_current_platform_is_cached() -> None:
    first = opmux.current_platform()
    assert opmux.current_platform() is first
    assert platforms.detections()
