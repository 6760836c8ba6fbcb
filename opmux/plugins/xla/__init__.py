"""Built-in XLA plugin: ``torch.ops.xla_gpu.paged_attention`` and its providers.

The plugin claims every platform (``"*"``): the op is pure PyTorch at heart, so it must be
defined and callable on CPU (and under fake tensors) even where torch_xla is absent, for
the core test lane and for engines that trace on CPU before moving to an XLA device.
Nothing here imports torch_xla; the XLA provider is plain PyTorch that torch_xla traces.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from opmux.core.plugins import hookimpl

if TYPE_CHECKING:
    from opmux.core.registry import OpRegistry
    from opmux.plugins.registration import PlatformLike

__all__ = ["opmux_plugin_info", "opmux_register"]


@hookimpl
def opmux_plugin_info() -> dict[str, Any]:
    """Name and platforms; imports nothing heavy."""
    return {"name": "xla", "platforms": ["*"]}


@hookimpl
def opmux_register(registry: OpRegistry, platform: PlatformLike) -> None:
    """Define ``xla_gpu::paged_attention`` and register its providers on every key."""
    from opmux.plugins.xla.paged_attention import register

    register(registry)
