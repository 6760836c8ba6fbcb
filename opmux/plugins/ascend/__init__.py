"""Built-in ``ascend`` plugin: the MindSpore custom op (AscendC kernel on NPUs) as provider
``mindspore``.

The provider serves torch tensors through a zero-copy DLPack bridge into a MindSpore
``PyboostRunner`` extension (``csrc/ascend/ms_module``; the AscendC kernel in
``csrc/ascend/ascendc`` is compiled in when the CANN toolkit is present). The plugin applies to
the ``ascend`` platform and also to ``cpu``: MindSpore runs on CPU, where the extension is built
for its CPU backend with the same semantics, so the bridge, the build and the op are tested on
machines without an NPU. On CPU the provider is registered but not placed in the default
priority (``cpp`` and ``native`` are faster there: ``benchmarks/advance_step.py``); select it with
``op.set_priority(["mindspore", "native"])`` or ``OPMUX_PRIORITY``.

MindSpore is imported only when it is used: on the ``ascend`` platform the extension is built
(or loaded) at registration; on ``cpu`` the provider registers without importing MindSpore and
builds on its first call, so a CPU process that never selects it never pays for MindSpore.
"""

from __future__ import annotations

import importlib.util
from typing import TYPE_CHECKING, Any

from opmux.core.plugins import hookimpl

if TYPE_CHECKING:
    from opmux.core.registry import OpRegistry
    from opmux.plugins.registration import PlatformLike

__all__ = ["SERVED_OPS", "opmux_default_priority", "opmux_plugin_info", "opmux_register",
           "register"]

#: The op served by provider ``mindspore``.
SERVED_OPS = frozenset({"advance_step_flashattn"})


@hookimpl
def opmux_plugin_info() -> dict[str, Any]:
    """Name and platforms; imports nothing heavy."""
    return {"name": "ascend", "platforms": ["ascend", "cpu"]}


def register(registry: OpRegistry, dispatch_key: str = "CPU", *, lazy: bool = True
             ) -> list[str]:
    """Register provider ``mindspore`` when MindSpore is installed (else nothing).

    :param lazy: defer the MindSpore import and the build to the first call.
    :return: the ``op:provider`` pairs registered.
    """
    if importlib.util.find_spec("mindspore") is None:
        return []
    from opmux.plugins.ascend import dlpack_provider

    return dlpack_provider.register(registry, dispatch_key, lazy=lazy)


@hookimpl
def opmux_register(registry: OpRegistry, platform: PlatformLike) -> None:
    """Eager build on the ascend platform; lazy elsewhere (MindSpore's CPU backend)."""
    # torch tensors live on the NPU (PrivateUse1) only with torch_npu; otherwise on the CPU
    npu = platform.name == "ascend" and importlib.util.find_spec("torch_npu") is not None
    register(registry, "PrivateUse1" if npu else "CPU", lazy=platform.name != "ascend")


@hookimpl
def opmux_default_priority(op_name: str, platform: PlatformLike) -> list[str] | None:
    """``mindspore`` first for its op on the ascend platform only."""
    if op_name in SERVED_OPS and platform.name == "ascend":
        return ["mindspore", "native"]
    return None
