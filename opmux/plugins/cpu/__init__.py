"""Built-in ``cpu`` plugin: opmux's C++ CPU kernels as provider ``cpp`` on dispatch key ``CPU``.

CPU tensors exist on every platform, so the plugin applies everywhere (``"*"``).

The kernels are built at registration time, not on first call: ``supported`` is static and a
provider whose build failed must be registered unsupported (with the compiler message as its
reason, shown by ``explain`` and the plugin report) instead of failing later inside a model.
After the first build the library is loaded from ``$OPMUX_CACHE_DIR/cpu/<key>`` in
milliseconds; ``opmux build`` prebuilds it (:func:`opmux.plugins.cpu.build.build`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from opmux.core.plugins import hookimpl

if TYPE_CHECKING:
    from opmux.core.registry import OpRegistry
    from opmux.plugins.registration import PlatformLike

__all__ = ["SERVED_OPS", "opmux_default_priority", "opmux_plugin_info", "opmux_register",
           "register"]

#: Ops served by the ``cpp`` provider (kept here so the priority hook imports nothing heavy).
SERVED_OPS = frozenset({
    "advance_step_flashattn", "fused_add_rms_norm", "gelu_and_mul", "paged_attention",
    "reshape_and_cache", "rms_norm", "rotary_embedding", "silu_and_mul",
    "fatrelu_and_mul", "gelu_and_mul_sparse", "gelu_fast", "gelu_new", "mul_and_silu",
    "quick_gelu", "relu2", "swigluoai_and_mul", "xielu",
    "apply_rotary_emb", "dual_chunk_rotary_embedding",
    "gemma_rms_norm", "gemma_fused_add_rms_norm", "rms_norm_gated", "quant_fp8",
    "concat_and_cache_mla", "encoder_attention", "mla_attention",
    "causal_conv1d", "causal_conv1d_update", "selective_scan", "selective_state_update",
    "ssd_chunk_scan", "ssd_state_update", "fused_moe", "linear",
})


@hookimpl
def opmux_plugin_info() -> dict[str, Any]:
    """Name and platforms; imports nothing heavy."""
    return {"name": "cpu", "platforms": ["*"]}


def register(registry: OpRegistry, dispatch_key: str = "CPU") -> list[str]:
    """Register ``cpp`` (building the kernels) and ``grouped`` for ``dispatch_key``.

    :return: the ``op:provider`` pairs registered.
    """
    from . import cpp_ops, moe_ops

    return cpp_ops.register(registry, dispatch_key) + moe_ops.register(registry, dispatch_key)


@hookimpl
def opmux_register(registry: OpRegistry, platform: PlatformLike) -> None:
    """Register the providers on the ``CPU`` key (CPU tensors exist on every platform)."""
    register(registry, "CPU")


@hookimpl
def opmux_default_priority(op_name: str, platform: PlatformLike) -> list[str] | None:
    """``cpp`` first for the ops it serves; ``fused_moe``: ``cpp``, then ``grouped`` (which
    takes the large float32 batches ``cpp`` declines)."""
    if op_name == "fused_moe":
        return ["cpp", "grouped", "native"]
    return ["cpp", "native"] if op_name in SERVED_OPS else None
