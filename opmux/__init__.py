"""opmux: define inference ops once, let every platform plug in faster providers."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from opmux._runtime import load_plugins
from opmux.core import errors as _errors
from opmux.core.errors import *  # noqa: F403  (every exception type is public here too)
from opmux.core.op import Op, OpImpl, enable_torch_wrap, torch_wrap_enabled
from opmux.core.plugins import PLUGIN_GROUP, PluginRecord, hookimpl, plugin_report
from opmux.core.registry import (
    OpRegistry,
    direct_register_custom_op,
    get_op,
    global_registry,
    list_ops,
    register_op,
)
from opmux.core.switches import enable_output_checks
from opmux.platforms import current_platform
from opmux.platforms.base import Platform

if TYPE_CHECKING:  # imported on first use (below): start-up needs none of them
    from opmux.core.forward_context import collect_layers, forward_context, get_forward_context
    from opmux.core.runners import (
        get_runner,
        register_runner,
        register_runner_op,
        release_runner,
        runner_scope,
    )
    from opmux.layers.custom_op import CustomOp, custom_op_counts, set_compile_mode, set_custom_ops
    from opmux.ops.kv_formats import (
        KVCacheFormat,
        KVCacheSpec,
        declare_kv_cache_formats,
        get_kv_cache_format,
        kv_cache_format,
        list_kv_cache_formats,
        register_kv_cache_format,
    )

_LAZY: dict[str, str] = {
    **dict.fromkeys(("CustomOp", "custom_op_counts", "set_compile_mode", "set_custom_ops"),
                    "opmux.layers.custom_op"),
    **dict.fromkeys(("collect_layers", "forward_context", "get_forward_context"),
                    "opmux.core.forward_context"),
    **dict.fromkeys(("get_runner", "register_runner", "register_runner_op", "release_runner",
                     "runner_scope"), "opmux.core.runners"),
    **dict.fromkeys(("KVCacheFormat", "KVCacheSpec", "declare_kv_cache_formats",
                     "get_kv_cache_format", "kv_cache_format", "list_kv_cache_formats",
                     "register_kv_cache_format"), "opmux.ops.kv_formats"),
}
"""Public names of the layer, forward-context, runner and KV-cache-format modules, imported
on first use."""

__all__ = [
    "PLUGIN_GROUP",
    "CustomOp",
    "KVCacheFormat",
    "KVCacheSpec",
    "Op",
    "OpImpl",
    "OpRegistry",
    "Platform",
    "PluginRecord",
    "collect_layers",
    "current_platform",
    "custom_op_counts",
    "declare_kv_cache_formats",
    "direct_register_custom_op",
    "enable_output_checks",
    "enable_torch_wrap",
    "forward_context",
    "get_forward_context",
    "get_kv_cache_format",
    "get_op",
    "get_runner",
    "global_registry",
    "hookimpl",
    "kv_cache_format",
    "list_kv_cache_formats",
    "list_ops",
    "load_plugins",
    "plugin_report",
    "register_kv_cache_format",
    "register_op",
    "register_runner",
    "register_runner_op",
    "release_runner",
    "runner_scope",
    "set_compile_mode",
    "set_custom_ops",
    "torch_wrap_enabled",
]
__all__ += _errors.__all__


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is not None:
        value = getattr(importlib.import_module(module), name)
        globals()[name] = value  # found directly from now on
        return value
    if name == "__version__":
        from importlib.metadata import PackageNotFoundError, version

        try:
            return version("opmux")
        except PackageNotFoundError:
            return "0+unknown"
    if name == "ops":
        import opmux.ops as ops

        return ops
    if name == "distributed":
        import opmux.distributed as distributed

        return distributed
    if name == "models":
        import opmux.models as models

        return models
    raise AttributeError(f"module 'opmux' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), *_LAZY})
