"""Built-in XLA plugin: ``torch.ops.xla_gpu.paged_attention`` and its providers.

The plugin claims every platform (``"*"``): the op is pure PyTorch at heart, so it must be
defined and callable on CPU (and under fake tensors) even where torch_xla is absent, for
the core test lane and for engines that trace on CPU before moving to an XLA device.
Nothing here imports torch_xla; the XLA provider is plain PyTorch that torch_xla traces.
"""

from typing import Any

from opmux.core.plugins import hookimpl


@hookimpl
def opmux_plugin_info() -> dict[str, Any]:
    return {"name": "xla", "platforms": ["*"]}


@hookimpl
def opmux_register(registry: Any, platform: Any) -> None:
    from opmux.plugins.xla.paged_attention import install

    install(registry)
