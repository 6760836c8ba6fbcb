"""The CUDA plugin: provider ``triton`` (Triton kernels, CUDA and ROCm) and provider
``cuda_c`` (CUDA C++ kernels from ``csrc/cuda``), both on dispatch key ``CUDA``.

Only hook implementations live here; the kernels are imported inside the hooks.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from opmux.core.plugins import hookimpl

if TYPE_CHECKING:
    from opmux.core.registry import OpRegistry
    from opmux.plugins.registration import PlatformLike

__all__ = ["opmux_default_priority", "opmux_plugin_info", "opmux_register", "register"]


@hookimpl
def opmux_plugin_info() -> dict[str, Any]:
    """Name and platforms; imports nothing heavy."""
    return {"name": "cuda", "platforms": ["cuda", "rocm"]}


def register(registry: OpRegistry, dispatch_key: str = "CUDA") -> list[str]:
    """Register ``triton`` and ``cuda_c`` on ``registry`` for ``dispatch_key``.

    Tests call it with ``dispatch_key="CPU"`` to run the Triton kernels on CPU tensors under
    the interpreter; ``cuda_c`` is registered only for ``CUDA``.

    :return: the ``op:provider`` pairs registered.
    """
    from opmux.plugins.cuda import triton_ops

    done = triton_ops.register(registry, dispatch_key)
    if dispatch_key == "CUDA":
        from opmux.plugins.cuda import cuda_c

        done += cuda_c.register(registry, dispatch_key)
    return done


@hookimpl
def opmux_register(registry: OpRegistry, platform: PlatformLike) -> None:
    """Register the providers on the ``CUDA`` key (the key of both CUDA and ROCm torch)."""
    register(registry, "CUDA")


@hookimpl
def opmux_default_priority(op_name: str, platform: PlatformLike) -> list[str] | None:
    """Per-op order; see :mod:`opmux.plugins.cuda.priority` for the reasoning."""
    from opmux.plugins.cuda.priority import default_priority

    return default_priority(op_name, platform.name)
