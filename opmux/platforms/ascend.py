"""The Ascend platform: NPUs through torch_npu (key ``PrivateUse1``) or MindSpore."""

from __future__ import annotations

import importlib.util
from typing import Any

from opmux.core.config import cann_home
from opmux.platforms.base import Detection, Platform

__all__ = ["AscendPlatform", "detect_ascend"]


def detect_ascend() -> Detection:
    """Claim the machine for torch_npu with a visible NPU, or MindSpore with CANN.

    torch_npu is imported only when installed; MindSpore is not imported at all (its
    import takes seconds): an installed MindSpore counts when the CANN toolkit is
    present, since MindSpore can only reach an Ascend device through it.
    """
    reasons = []
    if importlib.util.find_spec("torch_npu") is not None:
        try:
            import torch
            import torch_npu  # noqa: F401

            if torch.npu.is_available():  # type: ignore[attr-defined]
                return Detection("ascend", "opmux.platforms.ascend.AscendPlatform",
                                 "torch_npu installed and an NPU is available")
            reasons.append("torch_npu installed but no NPU is available")
        except Exception as exc:  # recorded, not swallowed: the reason says what broke
            reasons.append(f"torch_npu failed to import: {type(exc).__name__}: {exc}")
    else:
        reasons.append("torch_npu is not installed")
    if importlib.util.find_spec("mindspore") is not None:
        if cann_home() is not None:
            return Detection("ascend", "opmux.platforms.ascend.AscendPlatform",
                             f"MindSpore installed with the CANN toolkit at {cann_home()}")
        reasons.append("MindSpore installed but no CANN toolkit (ASCEND_HOME_PATH unset)")
    else:
        reasons.append("MindSpore is not installed")
    return Detection("ascend", None, "; ".join(reasons))


class AscendPlatform(Platform, name="ascend", device_type="npu", dispatch_key="PrivateUse1",
                     forward_method="forward_npu",
                     detector=detect_ascend):
    """Huawei Ascend NPUs. torch tensors live on ``npu`` (the PrivateUse1 backend)."""

    def default_priority(self, op_name: str) -> list[str]:
        return ["mindspore", "native"] if op_name == "advance_step_flashattn" else []

    def describe(self) -> dict[str, Any]:
        info = super().describe()
        info["cann"] = str(home) if (home := cann_home()) is not None else None
        info["torch_npu"] = importlib.util.find_spec("torch_npu") is not None
        info["mindspore"] = importlib.util.find_spec("mindspore") is not None
        return info
