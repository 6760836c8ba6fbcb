"""The built-in platforms (cpu, cuda, rocm, xla) and one cheap detector each.

Detectors return a :class:`Detection`: the platform's class path when it claims the
machine, and always the reason. Optional stacks are probed with
:func:`importlib.util.find_spec` before anything heavy is imported.
"""

from __future__ import annotations

import importlib.util
from typing import Any

import torch

from opmux.core import config
from opmux.platforms.base import Detection, Platform

__all__ = ["CpuPlatform", "CudaPlatform", "RocmPlatform", "XlaPlatform"]


def detect_cuda() -> Detection:
    if torch.version.cuda is None:
        return Detection("cuda", None, "torch is not a CUDA build (torch.version.cuda is None)")
    if not torch.cuda.is_available():
        return Detection("cuda", None,
                         f"CUDA build {torch.version.cuda} but torch.cuda.is_available() is False")
    return Detection("cuda", "opmux.platforms.builtin.CudaPlatform",
                     f"CUDA {torch.version.cuda}, {torch.cuda.device_count()} device(s)")


def detect_rocm() -> Detection:
    hip = getattr(torch.version, "hip", None)
    if hip is None:
        return Detection("rocm", None, "torch is not a ROCm build (torch.version.hip is None)")
    if not torch.cuda.is_available():
        return Detection("rocm", None, f"ROCm build {hip} but no GPU is visible")
    return Detection("rocm", "opmux.platforms.builtin.RocmPlatform", f"ROCm {hip}")


def detect_xla() -> Detection:
    if importlib.util.find_spec("torch_xla") is None:
        return Detection("xla", None, "torch_xla is not installed")
    device = config.pjrt_device()
    if not device:
        return Detection("xla", None, "torch_xla is installed but PJRT_DEVICE is not set")
    return Detection("xla", "opmux.platforms.builtin.XlaPlatform",
                     f"torch_xla installed, PJRT_DEVICE={device}")


class CpuPlatform(Platform, name="cpu", device_type="cpu", dispatch_key="CPU",
                  forward_method="forward_cpu"):
    """The host CPU; the fallback platform."""

    @classmethod
    def is_available(cls) -> bool:
        return True

    def describe(self) -> dict[str, Any]:
        info = super().describe()
        info["threads"] = torch.get_num_threads()
        return info


class CudaPlatform(Platform, name="cuda", device_type="cuda", dispatch_key="CUDA",
                   forward_method="forward_cuda",
                   detector=detect_cuda):
    """NVIDIA GPUs through a CUDA build of torch."""

    def default_priority(self, op_name: str) -> list[str]:
        return ["triton", "native"]

    def describe(self) -> dict[str, Any]:
        info = super().describe()
        info["cuda"] = torch.version.cuda
        if torch.cuda.is_available():
            info["device"] = torch.cuda.get_device_name(0)
        return info


class RocmPlatform(CudaPlatform, name="rocm", forward_method="forward_hip",
                   detector=detect_rocm):
    """AMD GPUs through a ROCm (HIP) build of torch; same device type and key as CUDA."""

    def describe(self) -> dict[str, Any]:
        info = super().describe()
        info["hip"] = getattr(torch.version, "hip", None)
        return info


class XlaPlatform(Platform, name="xla", device_type="xla", dispatch_key="XLA",
                  forward_method="forward_xla",
                  detector=detect_xla):
    """torch_xla devices (TPU, GPU or CPU through PJRT)."""

    def describe(self) -> dict[str, Any]:
        info = super().describe()
        info["pjrt_device"] = config.pjrt_device()
        return info
