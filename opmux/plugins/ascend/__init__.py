"""Built-in ``ascend`` plugin: the MindSpore custom op (AscendC kernel on NPUs) as provider
``mindspore``.

The provider serves torch tensors through a zero-copy DLPack bridge into a MindSpore
``PyboostRunner`` extension (``csrc/module``; the AscendC kernel in ``csrc/ascendc`` is compiled
in when the CANN toolkit is present). The plugin applies to the ``ascend`` platform and also to
``cpu``: MindSpore runs on CPU, where the extension is built for its CPU backend with the same
semantics, so the bridge, the build and the op are tested on machines without an NPU. On CPU the
provider is registered but not placed in the default priority (``cpp`` and ``native`` are faster
there); select it with ``op.set_priority(["mindspore", "native"])`` or ``OPMUX_PRIORITY``.

MindSpore is imported only when it is used: on the ``ascend`` platform the extension is built
(or loaded) at registration; on ``cpu`` the provider registers without importing MindSpore and
builds on its first call, so a CPU process that never selects it never pays for MindSpore.
"""

from __future__ import annotations

import importlib.util
from typing import Any

from opmux.core.plugins import hookimpl

#: The op served by provider ``mindspore``.
SERVED_OPS = frozenset({"advance_step_flashattn"})


@hookimpl
def opmux_plugin_info() -> dict[str, Any]:
    return {"name": "ascend", "platforms": ["ascend", "cpu"]}


@hookimpl
def opmux_register(registry: Any, platform: Any) -> None:
    if importlib.util.find_spec("mindspore") is None:
        return
    from opmux.plugins.ascend import dlpack_provider

    # torch tensors live on the NPU (PrivateUse1) only with torch_npu; otherwise on the CPU
    npu = platform.name == "ascend" and importlib.util.find_spec("torch_npu") is not None
    dlpack_provider.register(registry, dispatch_key="PrivateUse1" if npu else "CPU",
                             lazy=platform.name != "ascend")


@hookimpl
def opmux_default_priority(op_name: str, platform: Any) -> list[str] | None:
    if op_name in SERVED_OPS and platform.name == "ascend":
        return ["mindspore", "native"]
    return None
